"""One metrics namespace, defined once, and the reader of a run's ``metrics.jsonl``.

Every metric a run logs is named here, with a one-line doc (CONTRIBUTING.md#metrics). Code logs with the
constants (``tracking.LOSS_POLICY``), never with string literals, so a renamed metric is a one-line
change and a typo is an ``AttributeError``. Families whose members are only known at run time
(``buffer/dropped_<reason>``, ``eval/accuracy/<task>``) are declared by prefix in :data:`PREFIXES`.

The run always writes ``metrics.jsonl`` (one JSON object per step: ``{"step": n, "time": unix_s,
name: value, ...}``, flushed per line; a resumed run appends). TensorBoard mirrors the scalars (and the
staleness histogram) when ``torch.utils.tensorboard`` is importable. Plots read the JSONL. The writer
is :class:`copc.run.tracker.Tracker`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# ---------------------------------------------------------------------------------- the namespace
# Names emitted by the ops diagnostics (copc.ops.importance / policy_losses / value_losses return
# dicts with these keys; ops cannot import this module, so the strings are repeated there and a
# test here checks the two agree).
LOSS_POLICY = "loss/policy"
LOSS_VALUE = "loss/value"
LOSS_ENTROPY = "loss/entropy"
LOSS_KL = "loss/kl"
RATIO_MASK_FRAC = "ratio/mask_frac"
RATIO_CLIP_FRAC_LOW = "ratio/clip_low_frac"
RATIO_CLIP_FRAC_HIGH = "ratio/clip_high_frac"
RATIO_ESS_TOKEN = "ratio/ess_tok"
RATIO_ESS_SEQ = "ratio/ess_seq"
RATIO_ESS_SEQ_SNIS = "ratio/ess_seq_snis"
RATIO_MEAN_ABS_LOG_W = "ratio/mean_abs_log"
RATIO_KL_K1 = "ratio/kl_k1"
RATIO_KL_K2 = "ratio/kl_k2"
RATIO_KL_K3 = "ratio/kl_k3"
POLICY_MASK_FRAC = "policy/mask_frac"
POLICY_WEIGHT_MEAN = "policy/weight_mean"
POLICY_CLIP_FRAC_LOW = "policy/clip_frac_low"
POLICY_CLIP_FRAC_HIGH = "policy/clip_frac_high"
POLICY_DUAL_CLIP_FRAC = "policy/dual_clip_frac"
POLICY_APPROX_KL = "policy/approx_kl"
VALUE_CLIP_FRAC = "value/clip_frac"
VALUE_MEAN_ABS_ERR = "value/mean_abs_err"
VALUE_EXPLAINED_VAR = "value/explained_var"
STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
STALENESS_SEQ_MAX_MEAN = "staleness/seq_max_mean"
STALENESS_GENERATION_MEAN = "staleness/generation_mean"
STALENESS_GENERATION_MAX = "staleness/generation_max"
STALENESS_WAITING_MEAN = "staleness/waiting_mean"
STALENESS_WAITING_MAX = "staleness/waiting_max"
STALENESS_PACE_REJECTED = "staleness/pace_rejected"
STALENESS_PACE_REJECT_RATE = "staleness/pace_reject_rate"
STALENESS_PACE_BUDGET = "staleness/pace_budget"
STALENESS_PACE_POOL = "staleness/pace_pool"
STALENESS_PACE_SCORE_MEAN = "staleness/pace_score_mean"
STALENESS_HIST = "staleness/hist"
CRITIC_EXPLAINED_VAR = "critic/explained_var"
CRITIC_VALUE_BIAS_GAP = "critic/value_bias_gap"
CRITIC_VALUE_BIAS = "critic/value_bias"
CRITIC_VALUES_MEAN = "critic/values_mean"
CRITIC_RETURNS_MEAN = "critic/returns_mean"
ADV_MEAN = "adv/mean"
ADV_STD = "adv/std"
ADV_RAW_MEAN = "adv/raw_mean"
ADV_RAW_STD = "adv/raw_std"
RETURNS_MEAN = "returns/mean"
GRAD_ACTOR_NORM = "grad/actor_norm"
GRAD_CRITIC_NORM = "grad/critic_norm"
PERF_TOKENS_PER_S = "perf/tokens_per_s"
PERF_TRAIN_TOKENS_PER_S = "perf/train_tokens_per_s"
TIME_GENERATE = "time/generate"
TIME_WAIT = "time/wait"
TIME_TRAIN = "time/train"
TIME_TRAIN_CPU = "time/train_cpu"
TIME_STEP = "time/step"
TIME_PUBLISH = "time/publish"
TIME_EVAL = "time/eval"
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
EVAL_ACCURACY = "eval/accuracy"
EVAL_GREEDY_ACCURACY = "eval/greedy_accuracy"
EVAL_PASS_AT_K = "eval/pass_at_k"
EVAL_TOOL_USE_RATE = "eval/tool_use_rate"
EVAL_TRUNCATED_FRAC = "eval/truncated_frac"
EVAL_TRUNCATED_TURN_FRAC = "eval/truncated_turn_frac"
EVAL_TURN_LIMIT_FRAC = "eval/turn_limit_frac"
EVAL_TOOL_INFRA_FRAC = "eval/tool_infra_frac"
EVAL_ENV_ERROR_FRAC = "eval/env_error_frac"
EVAL_GRADE_FAILURE_FRAC = "eval/grade_failure_frac"
ROLLOUT_TOOL_USE_RATE = "rollout/tool_use_rate"
ROLLOUT_ENTROPY_MC = "rollout/entropy_mc"
ROLLOUT_TOOL_CALLS = "rollout/tool_calls"
ROLLOUT_TOOL_INFRA_ERRORS = "rollout/tool_infra_errors"
ROLLOUT_ENV_ERROR_FRAC = "rollout/env_error_frac"
ROLLOUT_GRADE_FAILURE_FRAC = "rollout/grade_failure_frac"
ROLLOUT_RESPONSE_TOKENS = "rollout/response_tokens"
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
ROLLOUT_TRUNCATED_TURN_FRAC = "rollout/truncated_turn_frac"
ROLLOUT_TURN_LIMIT_FRAC = "rollout/turn_limit_frac"
ROLLOUT_ACCURACY = "rollout/accuracy"
ROLLOUT_VERSION = "rollout/version"
ROLLOUT_VERSIONS_PER_TRAJ = "rollout/versions_per_traj"
ROLLOUT_VERSIONS_PER_TRAJ_MAX = "rollout/versions_per_traj_max"
ROLLOUT_DYNSAMPLE_ROUNDS = "rollout/dynsample_rounds"
ROLLOUT_DYNSAMPLE_EXTRA_GROUPS = "rollout/dynsample_extra_groups"
ROLLOUT_DYNSAMPLE_DROPPED_GROUPS = "rollout/dynsample_dropped_groups"
ROLLOUT_DYNSAMPLE_PADDED_GROUPS = "rollout/dynsample_padded_groups"
ROLLOUT_DYNSAMPLE_SHORT = "rollout/dynsample_short"
ROLLOUT_OVERLONG_PENALTY = "rollout/overlong_penalty"
ROLLOUT_INFRA_DROPPED_GROUPS = "rollout/infra_dropped_groups"
BATCH_SEQUENCES = "batch/sequences"
BATCH_ACTION_TOKENS = "batch/action_tokens"
BATCH_TRUNCATED_FRAC = "batch/truncated_frac"
BATCH_VOID_FRAC = "batch/void_frac"
BUFFER_SIZE = "buffer/size"
BUFFER_IN_FLIGHT = "buffer/in_flight"
BUFFER_CONSUMED = "buffer/consumed"
BUFFER_OVER_BOUND = "buffer/over_bound"
BUFFER_REQUEUED = "buffer/requeued"
BUFFER_DROPPED = "buffer/dropped"
BUFFER_EMPTY_KEPT = "buffer/empty_kept"
RUNTIME_WORKER_RESTARTS = "runtime/worker_restarts"
RUNTIME_JOURNAL_DAMAGED = "runtime/journal_damaged"
ROLLOUT_EMPTY_FRAC = "rollout/empty_frac"
TRAIN_VERSION = "train/version"
TRAIN_ACTOR_FROZEN = "train/actor_frozen"
PROXIMAL_SNAPSHOT_BYTES = "proximal/snapshot_bytes"
PROXIMAL_SNAPSHOT_VERSIONS = "proximal/snapshot_versions"
PROXIMAL_VERSION_FORWARDS = "proximal/version_forwards"
PROXIMAL_REUSED_ROWS_FRAC = "proximal/reused_rows_frac"
MEMORY_PEAK = "memory/peak"
ORACLE_FAILED_FRAC = "oracle/failed_frac"
ORACLE_SECONDS = "oracle/seconds"
ORACLE_CHUNKS = "oracle/chunks"
ORACLE_NOISE_VAR = "oracle/noise_var"
ORACLE_VALUE_PROMPT = "oracle/value_prompt"
ORACLE_GAE_MSE = "oracle/gae_mse"
ORACLE_CLIPPED_TD_MSE = "oracle/clipped_td_mse"
ORACLE_VTRACE_MSE = "oracle/vtrace_mse"
ORACLE_LAG0_GAE_MSE = "oracle/lag0_gae_mse"
ORACLE_GAE_EXCESS = "oracle/gae_excess_mse"
ORACLE_CLIPPED_TD_GAIN = "oracle/clipped_td_minus_gae_mse"
ORACLE_VTRACE_GAIN = "oracle/vtrace_minus_gae_mse"
ORACLE_CRITIC_VALUE_CORR = "oracle/critic_value_corr"
OFFPOLICY_SUM_ABS_LOG_W = "offpolicy/sum_abs_log_w"
OFFPOLICY_SUM_ABS_LOG_W_P90 = "offpolicy/sum_abs_log_w_p90"
OFFPOLICY_TRACE_CLIP_MEDIAN = "offpolicy/trace_clip_median"
OFFPOLICY_TRACE_CLIP_P10 = "offpolicy/trace_clip_p10"
OFFPOLICY_TRACE_VTRACE_MEDIAN = "offpolicy/trace_vtrace_median"
OFFPOLICY_ADV_CLIP_FRAC = "offpolicy/adv_clip_frac"

#: Every metric name with its one-line meaning (units in brackets). Tokens are sampled (policy) tokens;
#: the trainer's statistics are over its loss tokens, which leave out truncated rows under
#: ``trainer.truncation = mask``.
METRICS: dict[str, str] = {
    LOSS_POLICY: "actor loss: the policy channel's surrogate, token-mean over the minibatch's global count, "
                 "plus kl_coef * KL - entropy_coef * H when those "
                 "are set; mean over the step's optimizer steps",
    LOSS_VALUE: "critic loss 1/2 max((V-G)^2, (clip(V)-G)^2), token-mean; mean over the step's optimizer "
                "steps",
    LOSS_ENTROPY: "mean policy entropy over sampled tokens [nats] (only with trainer.entropy_coef != 0)",
    ROLLOUT_ENTROPY_MC: "Monte-Carlo per-token entropy of the behaviour policy: mean -log mu over sampled "
                        "tokens [nats]",
    LOSS_KL: "KL to the reference policy, token-mean",
    RATIO_MASK_FRAC: "fraction of sampled tokens outside the behaviour-ratio mask band (M_t = 0)",
    RATIO_CLIP_FRAC_LOW: "fraction of tokens whose behaviour ratio w is below advantage.ratio_low "
                         "(clipped-TD's clip 1 - eps_A^-; for an estimator "
                         "without that clip, where it would bite)",
    RATIO_CLIP_FRAC_HIGH: "fraction of tokens whose behaviour ratio w is above advantage.ratio_high "
                          "(clipped-TD's clip 1 + eps_A^+; for an estimator "
                          "without that clip, where it would bite)",
    RATIO_ESS_TOKEN: "token ESS of the behaviour ratio w, (sum w)^2 / (N sum w^2) in (0, 1], per actor "
                     "minibatch (mean over the step's minibatches; the "
                     "first only for methods without an old forward)",
    RATIO_ESS_SEQ: "sequence ESS of W_i = exp(sum_t log w_it), normalised to (0, 1], per actor minibatch "
                   "(mean over the step's minibatches; the first only for methods without an old forward)",
    RATIO_ESS_SEQ_SNIS: "normalised ESS 1 / (n sum W_i^2) of the self-normalised sequence weights of the "
                        "value-bias estimate (left out without a step-start old, as the bias is)",
    RATIO_MEAN_ABS_LOG_W: "mean |log w| = |old - mu| over sampled tokens (ratio/*: of the step-start policy; "
                          "absent on a step where a method without an old forward does not train its actor)",
    RATIO_KL_K1: "KL(mu || pi_old) estimate k1 = -log w, token mean",
    RATIO_KL_K2: "KL estimate k2 = (log w)^2 / 2, token mean",
    RATIO_KL_K3: "KL estimate k3 = w - 1 - log w, token mean",
    POLICY_MASK_FRAC: "fraction of sampled tokens the actor loss masks out (policy channel; policy/* and "
                      "value/* are token fractions and means over the whole step's updates)",
    POLICY_WEIGHT_MEAN: "mean per-token weight omega_t multiplying the actor term",
    POLICY_CLIP_FRAC_LOW: "fraction of tokens where the PPO clip is active at 1 - eps_low",
    POLICY_CLIP_FRAC_HIGH: "fraction of tokens where the PPO clip is active at 1 + eps_high",
    POLICY_DUAL_CLIP_FRAC: "fraction of tokens where the dual clip (c_dual) is active",
    POLICY_APPROX_KL: "approximate KL(pi_old || pi_theta) during the actor update",
    VALUE_CLIP_FRAC: "fraction of tokens where value clipping is active",
    VALUE_MEAN_ABS_ERR: "mean |V - G| over sampled tokens in the critic update",
    VALUE_EXPLAINED_VAR: "explained variance 1 - Var(G - V) / Var(G) of the values the critic update's "
                         "forwards gave, over the step's loss tokens",
    STALENESS_MEAN: "mean per-token staleness n - v_t of the consumed batch [versions]",
    STALENESS_MAX: "max per-token staleness of the consumed batch [versions]",
    STALENESS_SEQ_MAX_MEAN: "mean over trajectories of s_max = n - min_t v_t [versions]",
    STALENESS_GENERATION_MEAN: "mean over trajectories of generation staleness s_gen = max_t v_t - min_t v_t "
                               "[versions]",
    STALENESS_GENERATION_MAX: "max over the batch's trajectories of s_gen = max_t v_t - min_t v_t [versions]",
    STALENESS_WAITING_MEAN: "mean over trajectories of waiting staleness s_wait = n - max_t v_t [versions]",
    STALENESS_WAITING_MAX: "max over the batch's trajectories of s_wait = n - max_t v_t [versions]",
    STALENESS_PACE_REJECTED: "trajectories the PACE filter rejected (cumulative; also in "
                             "buffer/dropped_pace)",
    STALENESS_PACE_REJECT_RATE: "fraction of this step's batch the PACE filter rejected",
    STALENESS_PACE_BUDGET: "PACE rejection budget of this step [trajectories] (from pool occupancy)",
    STALENESS_PACE_POOL: "completed trajectories in the pool when this step's batch was taken (PACE "
                         "occupancy)",
    STALENESS_PACE_SCORE_MEAN: "mean PACE effective-staleness score of this step's batch before filtering "
                               "[versions]",
    STALENESS_HIST: "per-token staleness (TensorBoard histogram; JSONL keeps {counts: [c_0, c_1, ...]})",
    CRITIC_EXPLAINED_VAR: "1 - Var(G - V) / Var(G) over sampled tokens, pre-update values (critic/*: only "
                          "with a critic, except value_bias and returns_mean)",
    CRITIC_VALUE_BIAS_GAP: "g_pi = |mean V(s_1) - E_pi[R]| (BRACE eq. 7, self-normalised IS; left out "
                           "without a step-start old, where log w = 0 by construction)",
    CRITIC_VALUE_BIAS: "b = E_pi[R] - E_mu[R] (BRACE eq. 7; left out without a step-start old, where it "
                       "would read 0)",
    CRITIC_VALUES_MEAN: "mean pre-update critic value over sampled tokens",
    CRITIC_RETURNS_MEAN: "mean critic target G over sampled tokens",
    ADV_MEAN: "mean advantage fed to the actor loss (after whitening, if any)",
    ADV_STD: "std of advantages fed to the actor loss",
    ADV_RAW_MEAN: "mean advantage before whitening (m of docs/formulas.md#one-step), over sampled tokens",
    ADV_RAW_STD: "std of advantages before whitening (sqrt v of docs/formulas.md#one-step)",
    RETURNS_MEAN: "mean critic target G over sampled tokens (advantage channel output)",
    GRAD_ACTOR_NORM: "actor gradient norm before clipping",
    GRAD_CRITIC_NORM: "critic gradient norm before clipping",
    PERF_TOKENS_PER_S: "tokens of the batch per second of step wall time",
    PERF_TRAIN_TOKENS_PER_S: "tokens of the batch per second of training time (excludes generation, wait)",
    TIME_GENERATE: "seconds spent generating the consumed batch (in whichever process) [s]",
    TIME_WAIT: "seconds the trainer waited for its batch [s]",
    TIME_TRAIN: "seconds of the training update (forward, backward, optimizer) [s]",
    TIME_TRAIN_CPU: "CPU seconds the training thread ran during the update; below time/train it was off a "
                    "CPU (waiting for a core, the GIL or I/O; with trainer_threads "
                    "> 1 torch's pool threads are not counted) [s]",
    TIME_STEP: "wall seconds of the whole step [s]",
    TIME_PUBLISH: "seconds from the end of the update to the new weights being published (finiteness check, "
                  "copy, hand-over) [s]",
    TIME_EVAL: "wall seconds of the held-out evaluation made after this step (not in time/step) [s]",
    REWARD_MEAN: "mean episode reward of the consumed batch (after the method's dynamic sampling and "
                 "overlong shaping, DAPO's: then not comparable with other methods' raw rewards)",
    REWARD_STD: "std of episode rewards of the consumed batch",
    EVAL_ACCURACY: "eval accuracy on held-out prompts (avg@k at the rollout temperature)",
    EVAL_GREEDY_ACCURACY: "greedy (temperature 0) accuracy on held-out prompts",
    EVAL_PASS_AT_K: "unbiased pass@k on held-out prompts",
    EVAL_TOOL_USE_RATE: "fraction of eval episodes that called a tool",
    EVAL_TRUNCATED_FRAC: "fraction of sampled eval episodes cut by a budget (max tokens/turns/context)",
    EVAL_TRUNCATED_TURN_FRAC: "fraction of sampled eval policy turns cut by a token limit before they "
                              "stopped",
    EVAL_TURN_LIMIT_FRAC: "fraction of sampled eval episodes ended by the per-turn limit "
                          "max_new_tokens_per_turn",
    EVAL_TOOL_INFRA_FRAC: "fraction of eval episodes (sampled and greedy) with a tool call that failed for "
                          "the machine (sandbox fault), graded wrong: a nonzero "
                          "value means the accuracies are low for the machine",
    EVAL_ENV_ERROR_FRAC: "fraction of eval episodes (sampled and greedy) ended because the environment "
                         "raised (a bug in the task or its tool, not the policy), graded wrong",
    EVAL_GRADE_FAILURE_FRAC: "fraction of eval episodes (sampled and greedy) whose grader could not decide "
                             "(math-verify timed out or raised), graded wrong",
    ROLLOUT_TOOL_USE_RATE: "fraction of trajectories that called a tool at least once",
    ROLLOUT_TOOL_CALLS: "mean tool calls per trajectory",
    ROLLOUT_TOOL_INFRA_ERRORS: "mean tool calls per trajectory that failed for the machine, not the code "
                               "(sandbox fault=infra)",
    ROLLOUT_ENV_ERROR_FRAC: "fraction of trajectories ended because the environment raised (a bug in the "
                            "task or its tool), reward 0",
    ROLLOUT_GRADE_FAILURE_FRAC: "fraction of trajectories whose grader could not decide (math-verify timed "
                                "out or raised), reward 0",
    ROLLOUT_RESPONSE_TOKENS: "mean number of sampled tokens per trajectory",
    ROLLOUT_TRUNCATED_FRAC: "fraction of trajectories cut by a budget (max tokens/turns/context)",
    ROLLOUT_TRUNCATED_TURN_FRAC: "fraction of policy turns cut by a token limit before they stopped on their "
                                 "own",
    ROLLOUT_TURN_LIMIT_FRAC: "fraction of trajectories ended by the per-turn limit max_new_tokens_per_turn",
    ROLLOUT_ACCURACY: "fraction of trajectories of the batch graded correct",
    ROLLOUT_VERSION: "policy version that generated the consumed batch (oldest token)",
    ROLLOUT_VERSIONS_PER_TRAJ: "mean over the batch of distinct policy versions among a trajectory's sampled "
                               "tokens",
    ROLLOUT_VERSIONS_PER_TRAJ_MAX: "max over the batch of distinct policy versions in one trajectory (> 1: "
                                   "partial rollouts)",
    ROLLOUT_DYNSAMPLE_ROUNDS: "dynamic sampling: generation rounds of the batch (1 = its own prompts only)",
    ROLLOUT_DYNSAMPLE_EXTRA_GROUPS: "dynamic sampling: groups generated beyond the batch's own prompts",
    ROLLOUT_DYNSAMPLE_DROPPED_GROUPS: "dynamic sampling: generated groups not trained on (equal rewards, or "
                                      "surplus)",
    ROLLOUT_DYNSAMPLE_PADDED_GROUPS: "dynamic sampling: equal-reward groups kept to fill a batch the round "
                                     "cap left short",
    ROLLOUT_DYNSAMPLE_SHORT: "dynamic sampling: 1 if the batch had too few informative groups after "
                             "max_rounds",
    ROLLOUT_OVERLONG_PENALTY: "mean DAPO overlong penalty added to the batch's rewards (<= 0)",
    ROLLOUT_INFRA_DROPPED_GROUPS: "groups dropped because a tool call failed for the machine "
                                  "(rollout.infra_failures=drop)",
    BATCH_SEQUENCES: "sequences in the training batch",
    BATCH_ACTION_TOKENS: "sampled tokens in the training batch",
    BATCH_TRUNCATED_FRAC: "fraction of truncated sequences in the training batch",
    BATCH_VOID_FRAC: "fraction of sequences in the training batch with a void turn (neither a tool call nor "
                     "an answer; out of the losses under trainer.void_turns = mask)",
    BUFFER_SIZE: "trajectories stored in the buffer after the step took its batch",
    BUFFER_IN_FLIGHT: "generation requests admitted but not finished",
    BUFFER_CONSUMED: "trajectories consumed by the trainer so far (cumulative)",
    BUFFER_OVER_BOUND: "trajectories consumed with lag > s in bounded mode (cumulative; not dropped)",
    BUFFER_REQUEUED: "in-flight prompts requeued on resume (cumulative)",
    BUFFER_DROPPED: "trajectories dropped for any reason (cumulative; never for age)",
    BUFFER_EMPTY_KEPT: "trajectories without a sampled token kept in their batch (cumulative; rows without "
                       "action tokens)",
    RUNTIME_WORKER_RESTARTS: "rollout workers restarted after a death, error or timeout (cumulative)",
    RUNTIME_JOURNAL_DAMAGED: "damaged journal entries set aside on resume and generated again (cumulative)",
    ROLLOUT_EMPTY_FRAC: "fraction of trajectories of the batch without a sampled token (prompt fills the "
                        "context)",
    TRAIN_VERSION: "policy version after the step",
    TRAIN_ACTOR_FROZEN: "1 while the critic warms up and the actor is frozen",
    PROXIMAL_SNAPSHOT_BYTES: "trainer.proximal=snapshot: bytes of the policy versions the snapshot store "
                             "holds after the step [B]",
    PROXIMAL_SNAPSHOT_VERSIONS: "trainer.proximal=snapshot: policy versions the snapshot store holds after "
                                "the step",
    PROXIMAL_VERSION_FORWARDS: "trainer.proximal=snapshot: distinct behaviour versions of the batch (one old "
                               "forward each)",
    PROXIMAL_REUSED_ROWS_FRAC: "fraction of rows whose old log-probs came from their first actor forward "
                               "(trainer.old_forward_reuse)",
    ORACLE_FAILED_FRAC: "fraction of the batch's trajectories the Monte-Carlo oracle could not replay "
                        "(mc_oracle arms: they get advantage 0)",
    ORACLE_SECONDS: "time spent sampling the oracle's continuations this step (diagnostic and estimator) [s]",
    ORACLE_CHUNKS: "turn chunks the diagnostic compared with the oracle this step",
    ORACLE_NOISE_VAR: "mean variance of the oracle's own chunk advantages from its finite continuations "
                      "(part of every estimator's oracle/*_mse)",
    ORACLE_VALUE_PROMPT: "mean oracle value of the prompt (the current policy's success rate on the scored "
                         "prompts)",
    ORACLE_GAE_MSE: "GAE's chunk-advantage MSE against the oracle on the batch (also _bias, _corr)",
    ORACLE_CLIPPED_TD_MSE: "COPC's clipped-TD chunk-advantage MSE against the oracle on the batch",
    ORACLE_VTRACE_MSE: "V-trace's chunk-advantage MSE against the oracle on the batch",
    ORACLE_LAG0_GAE_MSE: "GAE's chunk-advantage MSE against the oracle on fresh episodes (lag 0)",
    ORACLE_CRITIC_VALUE_CORR: "correlation of the critic's chunk-start values with the oracle's",
    ORACLE_GAE_EXCESS: "GAE's chunk-advantage MSE against the oracle on the (stale) batch minus the same "
                       "estimator's MSE on fresh episodes of the same prompts (lag 0): advantage staleness",
    ORACLE_CLIPPED_TD_GAIN: "COPC's clipped-TD chunk-advantage MSE against the oracle minus GAE's, on the "
                            "same trajectories (< 0: the advantage channel brings the estimate nearer the "
                            "oracle)",
    ORACLE_VTRACE_GAIN: "V-trace's chunk-advantage MSE against the oracle minus GAE's, on the same "
                        "trajectories",
    OFFPOLICY_SUM_ABS_LOG_W: "median over trajectories of sum_t |log(cur/mu)| over the policy tokens (whole "
                             "batch, at diagnostic steps)",
    OFFPOLICY_SUM_ABS_LOG_W_P90: "90th percentile over trajectories of sum_t |log(cur/mu)|",
    OFFPOLICY_TRACE_CLIP_MEDIAN: "median over trajectories of prod_t clip(cur/mu, ratio_low, ratio_high) "
                                 "(COPC's clipped weights, 0.8 and 1.2 of R1) over the policy tokens",
    OFFPOLICY_TRACE_CLIP_P10: "10th percentile over trajectories of that clipped trace product",
    OFFPOLICY_TRACE_VTRACE_MEDIAN: "median over trajectories of prod_t min(1, cur/mu) (V-trace's traces, "
                                   "c_bar = 1)",
    OFFPOLICY_ADV_CLIP_FRAC: "fraction of policy tokens whose cur/mu leaves [0.8, 1.2], where COPC's "
                             "advantage clip bites",
    MEMORY_PEAK: "peak resident memory of the training process over the step, start-up and evaluations since "
                 "the last step included (the largest memory/peak_<phase>; Linux) [GiB]",
}

#: Families named at run time: ``prefix + suffix``, e.g. ``buffer/dropped_timeout``, ``eval/accuracy/arith``.
PREFIXES: dict[str, str] = {
    "buffer/dropped_": "trajectories dropped for the named reason (cumulative)",
    "eval/": "per-benchmark and per-k eval metrics: eval/<metric>/<task>, eval/pass@<k>, eval/avg@<k>",
    "time/": "other named timings [s]",
    "memory/peak_": "peak resident memory of the training process in the named phase of the step (batch, "
                    "prepare, critic, actor, publish; other: start-up, "
                    "evaluation, checkpoints since the last step) [GiB]",
    "rollout/": "task-specific rollout counters (means over the batch)",
    "oracle/": "advantage estimates against the Monte-Carlo oracle at diagnostic steps: "
               "oracle/<estimator>_<bias|mse|corr> (gae, clipped_td, vtrace on the batch's stale "
               "trajectories; lag0_<estimator>_* on "
               "fresh ones sampled by the current weights), "
               "oracle/critic_value_<mse|corr> (critic vs oracle values)",
}


def is_known(name: str) -> bool:
    """Whether ``name`` is in :data:`METRICS` or starts with one of :data:`PREFIXES`."""
    return name in METRICS or any(name.startswith(p) for p in PREFIXES)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, float]]:
    """All records of a ``metrics.jsonl`` (a ``RUN_DIR`` is accepted too); a torn last line is skipped, and
    so is any line that is not a JSON object with a numeric ``step`` (bytes that are not UTF-8, a hand
    edit)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    records = []
    with path.open(errors="replace") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash: the step is simply re-logged after resume
            step = record.get("step", 0) if isinstance(record, dict) else None
            if isinstance(step, int | float) and not isinstance(step, bool) and math.isfinite(step):
                records.append(record)
    return records


#: TensorBoard event files go to ``run_dir/tb``.
TENSORBOARD_DIR = "tb"
#: Rendered episodes of a run (one JSON object a line, each with ``step`` and ``source``).
SAMPLES_FILE = "samples.jsonl"
