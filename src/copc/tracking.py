"""One metrics namespace, defined once, and a tracker that writes it to JSONL and TensorBoard.

Every metric a run logs is named here, with a one-line doc (STYLE.md, point 12). Code logs with the
constants (``tracking.LOSS_POLICY``), never with string literals, so a renamed metric is a one-line
change and a typo is an ``AttributeError``. Families whose members are only known at run time
(``buffer/dropped_<reason>``, ``eval/accuracy/<task>``) are declared by prefix in :data:`PREFIXES`.

The run always writes ``metrics.jsonl`` (one JSON object per step: ``{"step": n, "time": unix_s,
name: value, ...}``, flushed per line; a resumed run appends). TensorBoard mirrors the scalars (and the
staleness histogram) when ``torch.utils.tensorboard`` is importable. Plots read the JSONL.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

import torch

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
ROLLOUT_TOOL_USE_RATE = "rollout/tool_use_rate"
ROLLOUT_ENTROPY_MC = "rollout/entropy_mc"
ROLLOUT_TOOL_CALLS = "rollout/tool_calls"
ROLLOUT_TOOL_INFRA_ERRORS = "rollout/tool_infra_errors"
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

#: Every metric name with its one-line meaning (units in brackets). Tokens are sampled (policy) tokens.
METRICS: dict[str, str] = {
    LOSS_POLICY: "actor loss (masked clipped surrogate, token-mean over the global minibatch count)",
    LOSS_VALUE: "critic loss 1/2 max((V-G)^2, (clip(V)-G)^2), token-mean",
    LOSS_ENTROPY: "mean policy entropy over sampled tokens [nats] (only with trainer.entropy_coef != 0)",
    ROLLOUT_ENTROPY_MC: "Monte-Carlo per-token entropy of the behaviour policy: mean -log mu over sampled tokens [nats]",
    LOSS_KL: "KL to the reference policy, token-mean",
    RATIO_MASK_FRAC: "fraction of sampled tokens outside the behaviour-ratio mask band (M_t = 0)",
    RATIO_CLIP_FRAC_LOW: "fraction of tokens whose behaviour ratio w is clipped at 1 - eps_A^- (advantage channel)",
    RATIO_CLIP_FRAC_HIGH: "fraction of tokens whose behaviour ratio w is clipped at 1 + eps_A^+ (advantage channel)",
    RATIO_ESS_TOKEN: "token ESS of the behaviour ratio w: (sum w)^2 / (N sum w^2), in (0, 1]",
    RATIO_ESS_SEQ: "sequence ESS of W_i = exp(sum_t log w_it), normalised to (0, 1]",
    RATIO_ESS_SEQ_SNIS: "ESS of the self-normalised sequence weights used for the value-bias estimate",
    RATIO_MEAN_ABS_LOG_W: "mean |log w| = |old - mu| over sampled tokens",
    RATIO_KL_K1: "KL(mu || pi_old) estimate k1 = -log w, token mean",
    RATIO_KL_K2: "KL estimate k2 = (log w)^2 / 2, token mean",
    RATIO_KL_K3: "KL estimate k3 = w - 1 - log w, token mean",
    POLICY_MASK_FRAC: "fraction of sampled tokens the actor loss masks out (policy channel)",
    POLICY_WEIGHT_MEAN: "mean per-token weight omega_t multiplying the actor term",
    POLICY_CLIP_FRAC_LOW: "fraction of tokens where the PPO clip is active at 1 - eps_low",
    POLICY_CLIP_FRAC_HIGH: "fraction of tokens where the PPO clip is active at 1 + eps_high",
    POLICY_DUAL_CLIP_FRAC: "fraction of tokens where the dual clip (c_dual) is active",
    POLICY_APPROX_KL: "approximate KL(pi_old || pi_theta) during the actor update",
    VALUE_CLIP_FRAC: "fraction of tokens where value clipping is active",
    VALUE_MEAN_ABS_ERR: "mean |V - G| over sampled tokens in the critic update",
    VALUE_EXPLAINED_VAR: "explained variance of the critic inside the value loss (per minibatch)",
    STALENESS_MEAN: "mean per-token staleness n - v_t of the consumed batch [versions]",
    STALENESS_MAX: "max per-token staleness of the consumed batch [versions]",
    STALENESS_SEQ_MAX_MEAN: "mean over trajectories of s_max = n - min_t v_t [versions]",
    STALENESS_GENERATION_MEAN: "mean over trajectories of generation staleness s_gen = max_t v_t - min_t v_t [versions]",
    STALENESS_GENERATION_MAX: "max over the batch's trajectories of s_gen = max_t v_t - min_t v_t [versions]",
    STALENESS_WAITING_MEAN: "mean over trajectories of waiting staleness s_wait = n - max_t v_t [versions]",
    STALENESS_WAITING_MAX: "max over the batch's trajectories of s_wait = n - max_t v_t [versions]",
    STALENESS_PACE_REJECTED: "trajectories the PACE filter rejected (cumulative; also in buffer/dropped_pace)",
    STALENESS_PACE_REJECT_RATE: "fraction of this step's batch the PACE filter rejected",
    STALENESS_PACE_BUDGET: "PACE rejection budget of this step [trajectories] (from pool occupancy)",
    STALENESS_PACE_POOL: "completed trajectories in the pool when this step's batch was taken (PACE occupancy)",
    STALENESS_PACE_SCORE_MEAN: "mean PACE effective-staleness score of this step's batch before filtering [versions]",
    STALENESS_HIST: "per-token staleness (TensorBoard histogram; JSONL keeps {counts: [c_0, c_1, ...]})",
    CRITIC_EXPLAINED_VAR: "1 - Var(G - V) / Var(G) over sampled tokens, pre-update values",
    CRITIC_VALUE_BIAS_GAP: "g_pi = |mean V(s_1) - E_pi[R]| (BRACE eq. 7, self-normalised IS)",
    CRITIC_VALUE_BIAS: "b = E_pi[R] - E_mu[R] (BRACE eq. 7)",
    CRITIC_VALUES_MEAN: "mean pre-update critic value over sampled tokens",
    CRITIC_RETURNS_MEAN: "mean critic target G over sampled tokens",
    ADV_MEAN: "mean advantage fed to the actor loss (after whitening, if any)",
    ADV_STD: "std of advantages fed to the actor loss",
    ADV_RAW_MEAN: "mean advantage before whitening (m of spec 9.5), over sampled tokens",
    ADV_RAW_STD: "std of advantages before whitening (sqrt v of spec 9.5)",
    RETURNS_MEAN: "mean critic target G over sampled tokens (advantage channel output)",
    GRAD_ACTOR_NORM: "actor gradient norm before clipping",
    GRAD_CRITIC_NORM: "critic gradient norm before clipping",
    PERF_TOKENS_PER_S: "tokens of the batch per second of step wall time",
    PERF_TRAIN_TOKENS_PER_S: "tokens of the batch per second of training time (excludes generation, wait)",
    TIME_GENERATE: "seconds spent generating the consumed batch (in whichever process) [s]",
    TIME_WAIT: "seconds the trainer waited for its batch [s]",
    TIME_TRAIN: "seconds of the training update (forward, backward, optimizer) [s]",
    TIME_TRAIN_CPU: "CPU seconds the training thread ran during the update; below time/train it was off a CPU "
                    "(waiting for a core, the GIL or I/O; with trainer_threads > 1 torch's pool threads are not counted) [s]",
    TIME_STEP: "wall seconds of the whole step [s]",
    TIME_PUBLISH: "seconds from the end of the update to the new weights being published (finiteness check, copy, hand-over) [s]",
    TIME_EVAL: "wall seconds of the held-out evaluation made after this step (not in time/step) [s]",
    REWARD_MEAN: "mean episode reward of the consumed batch",
    REWARD_STD: "std of episode rewards of the consumed batch",
    EVAL_ACCURACY: "eval accuracy on held-out prompts (avg@k at the rollout temperature)",
    EVAL_GREEDY_ACCURACY: "greedy (temperature 0) accuracy on held-out prompts",
    EVAL_PASS_AT_K: "unbiased pass@k on held-out prompts",
    EVAL_TOOL_USE_RATE: "fraction of eval episodes that called a tool",
    EVAL_TRUNCATED_FRAC: "fraction of sampled eval episodes cut by a budget (max tokens/turns/context)",
    EVAL_TRUNCATED_TURN_FRAC: "fraction of sampled eval policy turns cut by a token limit before they stopped",
    EVAL_TURN_LIMIT_FRAC: "fraction of sampled eval episodes ended by the per-turn limit max_new_tokens_per_turn",
    ROLLOUT_TOOL_USE_RATE: "fraction of trajectories that called a tool at least once",
    ROLLOUT_TOOL_CALLS: "mean tool calls per trajectory",
    ROLLOUT_TOOL_INFRA_ERRORS: "mean tool calls per trajectory that failed for the machine, not the code (sandbox fault=infra)",
    ROLLOUT_RESPONSE_TOKENS: "mean number of sampled tokens per trajectory",
    ROLLOUT_TRUNCATED_FRAC: "fraction of trajectories cut by a budget (max tokens/turns/context)",
    ROLLOUT_TRUNCATED_TURN_FRAC: "fraction of policy turns cut by a token limit before they stopped on their own",
    ROLLOUT_TURN_LIMIT_FRAC: "fraction of trajectories ended by the per-turn limit max_new_tokens_per_turn",
    ROLLOUT_ACCURACY: "fraction of trajectories of the batch graded correct",
    ROLLOUT_VERSION: "policy version that generated the consumed batch (oldest token)",
    ROLLOUT_VERSIONS_PER_TRAJ: "mean over the batch of distinct policy versions among a trajectory's sampled tokens",
    ROLLOUT_VERSIONS_PER_TRAJ_MAX: "max over the batch of distinct policy versions in one trajectory (> 1: partial rollouts)",
    ROLLOUT_DYNSAMPLE_ROUNDS: "dynamic sampling: generation rounds of the batch (1 = its own prompts only)",
    ROLLOUT_DYNSAMPLE_EXTRA_GROUPS: "dynamic sampling: groups generated beyond the batch's own prompts",
    ROLLOUT_DYNSAMPLE_DROPPED_GROUPS: "dynamic sampling: generated groups not trained on (equal rewards, or surplus)",
    ROLLOUT_DYNSAMPLE_PADDED_GROUPS: "dynamic sampling: equal-reward groups kept to fill a batch the round cap left short",
    ROLLOUT_DYNSAMPLE_SHORT: "dynamic sampling: 1 if the batch had too few informative groups after max_rounds",
    ROLLOUT_OVERLONG_PENALTY: "mean DAPO overlong penalty added to the batch's rewards (<= 0)",
    ROLLOUT_INFRA_DROPPED_GROUPS: "groups dropped because a tool call failed for the machine (rollout.infra_failures=drop)",
    BATCH_SEQUENCES: "sequences in the training batch",
    BATCH_ACTION_TOKENS: "sampled tokens in the training batch",
    BATCH_TRUNCATED_FRAC: "fraction of truncated sequences in the training batch",
    BUFFER_SIZE: "trajectories stored in the buffer after the step took its batch",
    BUFFER_IN_FLIGHT: "generation requests admitted but not finished",
    BUFFER_CONSUMED: "trajectories consumed by the trainer so far (cumulative)",
    BUFFER_OVER_BOUND: "trajectories consumed with lag > s in bounded mode (cumulative; not dropped)",
    BUFFER_REQUEUED: "in-flight prompts requeued on resume (cumulative)",
    BUFFER_DROPPED: "trajectories dropped for any reason (cumulative; never for age)",
    BUFFER_EMPTY_KEPT: "trajectories without a sampled token kept in their batch (cumulative; rows without action tokens)",
    RUNTIME_WORKER_RESTARTS: "rollout workers restarted after a death, error or timeout (cumulative)",
    RUNTIME_JOURNAL_DAMAGED: "damaged journal entries set aside on resume and generated again (cumulative)",
    ROLLOUT_EMPTY_FRAC: "fraction of trajectories of the batch without a sampled token (prompt fills the context)",
    TRAIN_VERSION: "policy version after the step",
    TRAIN_ACTOR_FROZEN: "1 while the critic warms up and the actor is frozen",
    PROXIMAL_SNAPSHOT_BYTES: "trainer.proximal=snapshot: bytes of the policy versions the snapshot store holds after the step [B]",
    PROXIMAL_SNAPSHOT_VERSIONS: "trainer.proximal=snapshot: policy versions the snapshot store holds after the step",
    PROXIMAL_VERSION_FORWARDS: "trainer.proximal=snapshot: distinct behaviour versions of the batch (one old forward each)",
    PROXIMAL_REUSED_ROWS_FRAC: "fraction of rows whose old log-probs came from their first actor forward (trainer.old_forward_reuse)",
}

#: Families named at run time: ``prefix + suffix``, e.g. ``buffer/dropped_timeout``, ``eval/accuracy/arith``.
PREFIXES: dict[str, str] = {
    "buffer/dropped_": "trajectories dropped for the named reason (cumulative)",
    "eval/": "per-benchmark and per-k eval metrics: eval/<metric>/<task>, eval/pass@<k>, eval/avg@<k>",
    "time/": "other named timings [s]",
    "rollout/": "task-specific rollout counters (means over the batch)",
    "train/lr_": "learning rate of the named optimizer (train/lr_actor, train/lr_critic)",
}


def is_known(name: str) -> bool:
    """Whether ``name`` is in :data:`METRICS` or starts with one of :data:`PREFIXES`."""
    return name in METRICS or any(name.startswith(p) for p in PREFIXES)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, float]]:
    """All records of a ``metrics.jsonl`` (a ``RUN_DIR`` is accepted too); a torn last line is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    records = []
    with path.open() as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash: the step is simply re-logged after resume
            if isinstance(record, dict):
                records.append(record)
    return records


#: TensorBoard event files go to ``run_dir/tb``.
TENSORBOARD_DIR = "tb"
#: Rendered episodes of a run (one JSON object a line, each with ``step`` and ``source``).
SAMPLES_FILE = "samples.jsonl"


class SummaryWriterLike(Protocol):
    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...
    def add_histogram(self, tag: str, values: torch.Tensor, global_step: int) -> None: ...
    def add_text(self, tag: str, text_string: str, global_step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class Tracker:
    """Appends one JSON line per :meth:`log` call to ``run_dir/metrics.jsonl`` and mirrors to TensorBoard.

    Args:
        run_dir: the run directory (created if needed).
        tensorboard: mirror scalars to ``run_dir/tb`` (skipped with a warning if unavailable).
        strict: raise on a metric name not in the namespace (default: warn once per name).
        resume_step: when resuming from the checkpoint of this step, drop records with ``step >=
            resume_step`` first (they belong to steps the resumed run will redo), then append.
        keep_resume_evaluation: keep the evaluation records of ``resume_step`` itself (the final
            evaluation of an earlier process that finished there: a run continued past it keeps it).
        wandb: mirror scalars to Weights & Biases as well (``pip install 'copc[wandb]'``; offline with
            ``WANDB_MODE=offline``): :class:`WandbMirror`'s settings, or None (off). metrics.jsonl stays the
            record; the mirror is one-way.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        tensorboard: bool = True,
        strict: bool = False,
        resume_step: int | None = None,
        keep_resume_evaluation: bool = False,
        wandb: WandbMirror | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.strict = strict
        self._warned: set[str] = set()
        self.samples_path = self.run_dir / SAMPLES_FILE
        if resume_step is not None:
            for path in (self.path, self.samples_path):
                if path.exists():
                    _truncate_from(path, resume_step, keep_evaluation=keep_resume_evaluation)
        self._file: IO[str] | None = self.path.open("a")
        self._tb: SummaryWriterLike | None = self._open_tensorboard() if tensorboard else None
        self._wandb = wandb.open(self.run_dir) if wandb is not None else None

    def _open_tensorboard(self) -> SummaryWriterLike | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # tensorboard is a core dependency, but keep JSONL working without it
            warnings.warn(f"TensorBoard mirror off ({err}); metrics.jsonl is still written", stacklevel=3)
            return None
        return SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))  # type: ignore[no-any-return]

    def _check(self, name: str) -> None:
        if is_known(name):
            return
        message = (
            f"metric {name!r} is not in copc.tracking.METRICS; add it there with a one-line "
            "doc (one namespace, defined once)"
        )
        if self.strict:
            raise KeyError(message)
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(message, stacklevel=3)

    def log(
        self,
        step: int,
        metrics: Mapping[str, float | int | bool | torch.Tensor],
        *,
        histograms: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
    ) -> dict[str, float]:
        """Write one record for ``step``; returns it. Tensors must be scalars (``.item()`` happens here,
        never in the losses). Histograms go to TensorBoard; JSONL keeps :func:`histogram_record` of them."""
        if self._file is None:
            raise RuntimeError("Tracker is closed")
        record: dict[str, float] = {}
        for name, value in metrics.items():
            self._check(name)
            record[name] = _scalar(name, value)
        line: dict[str, object] = {"step": int(step), "time": time.time(), **record}
        for name, values in (histograms or {}).items():
            self._check(name)
            tensor = torch.as_tensor(values).detach().flatten().cpu()
            line[name] = histogram_record(tensor)
            if self._tb is not None and tensor.numel() > 0:
                self._tb.add_histogram(name, tensor.double(), int(step))
        with _naming(self.path):
            self._file.write(json.dumps(line, allow_nan=True) + "\n")
            self._file.flush()
        if self._tb is not None:
            with _naming(self._tb_file()):
                for name, value in record.items():
                    if math.isfinite(value):
                        self._tb.add_scalar(name, value, int(step))
                self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if math.isfinite(v)}, step=int(step))
        return record

    def _tb_file(self) -> Path:
        """The TensorBoard event file being written (its directory where the writer hides it)."""
        name = getattr(getattr(getattr(self._tb, "file_writer", None), "event_writer", None), "_file_name", None)
        return Path(name) if isinstance(name, str) else self.run_dir / TENSORBOARD_DIR

    def log_samples(self, step: int, source: str, episodes: Sequence[Mapping[str, object]]) -> None:
        """Append rendered episodes (:func:`copc.rollout.samples.render_episode`) of ``step`` to
        ``samples.jsonl``, tagged with ``source`` (``train``, ``eval``), and to TensorBoard's text tab."""
        if not episodes:
            return
        with _naming(self.samples_path), self.samples_path.open("a") as out:
            for episode in episodes:
                out.write(json.dumps({"step": int(step), "source": source, **episode}) + "\n")
        if self._tb is not None:
            with _naming(self._tb_file()):
                self._tb.add_text(f"samples/{source}", "\n\n---\n\n".join(_markdown(e) for e in episodes),
                                  int(step))
                self._tb.flush()

    def records(self) -> Iterator[dict[str, float]]:
        """Records written so far (re-read from disk)."""
        return iter(read_metrics(self.path))

    def close(self) -> None:
        file, tb, self._file = self._file, self._tb, None
        run, self._wandb = self._wandb, None
        if run is not None:
            run.finish()
        try:
            if file is not None:
                with _naming(self.path):
                    file.close()
        finally:
            if tb is not None:
                with _naming(self._tb_file()):
                    self._tb = None
                    tb.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class WandbMirror:
    """Where a run's scalars are mirrored in Weights & Biases (the ``wandb`` package, imported lazily)."""

    project: str = "copc"
    """W&B project."""
    name: str = ""
    """Run name ('' = the run directory's name)."""
    config: Mapping[str, object] | None = None
    """The run's resolved config, shown beside the curves."""

    def open(self, run_dir: Path) -> WandbRun:
        """Start (or, for a resumed copc run, continue) the W&B run of ``run_dir``: its id is kept in
        ``run_dir/wandb_id`` and its files under ``run_dir/wandb``."""
        try:
            import wandb
        except ImportError:
            raise ImportError("wandb=true needs the wandb package: pip install 'copc[wandb]' (offline: "
                              "WANDB_MODE=offline)") from None
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        return wandb.init(project=self.project, name=self.name or run_dir.name, id=run_id, resume="allow",
                          dir=str(run_dir), config=dict(self.config or {}))


class WandbRun(Protocol):
    """What :class:`Tracker` uses of a ``wandb`` run."""

    def log(self, data: dict[str, float], step: int) -> None: ...
    def finish(self) -> None: ...


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Give an ``OSError`` raised while writing ``path`` that file's name: a failed ``write`` (a full disk)
    carries none, and TensorBoard's writer thread re-raises its error without one."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or str(err), str(path)) from None


def _truncate_from(path: Path, step: int, *, keep_evaluation: bool = False) -> None:
    """Keep only the JSON lines of ``path`` whose ``step`` is below ``step`` and, with ``keep_evaluation``,
    the evaluation records of ``step`` itself (atomic replace)."""
    kept = [r for r in read_metrics(path) if int(r.get("step", -1)) < step
            or (keep_evaluation and int(r.get("step", -1)) == step and _is_evaluation(r))]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as handle:
        for record in kept:
            handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _is_evaluation(record: Mapping[str, object]) -> bool:
    """A record of an evaluation alone: a sample of ``source`` eval, or metrics that are all ``eval/``."""
    if "source" in record:
        return record["source"] == "eval"
    names = [k for k in record if k not in ("step", "time")]
    return bool(names) and all(k.startswith("eval/") for k in names)


def _markdown(episode: Mapping[str, object]) -> str:
    """One rendered episode as TensorBoard markdown: the prompt, each piece (policy / forced) as code."""
    lines = [f"**{episode.get('prompt_id', '')}**: reward {episode.get('reward')}, stop {episode.get('stop_reason')}",
             "", "prompt:", "", "    " + str(episode.get("prompt", "")).replace("\n", "\n    ")]
    for turn in episode.get("turns", []) or []:  # type: ignore[attr-defined]
        lines += ["", f"{turn['source']}:", "", "    " + str(turn["text"]).replace("\n", "\n    ")]
    return "\n".join(lines)


def histogram_record(values: torch.Tensor) -> dict[str, object]:
    """Compact JSONL form of a histogram's values ``[N]``: for small non-negative integers (staleness)
    the exact counts ``{"counts": [c_0, c_1, ...]}`` (``c_k`` = number of values equal to k); otherwise
    ``{"n", "min", "max", "mean"}``."""
    if values.numel() == 0:
        return {"counts": []}
    integral = not values.is_floating_point() or bool((values == values.round()).all())
    if integral and int(values.min()) >= 0 and int(values.max()) < 100_000:
        return {"counts": torch.bincount(values.long()).tolist()}
    as_double = values.double()
    return {
        "n": int(values.numel()),
        "min": float(as_double.min()),
        "max": float(as_double.max()),
        "mean": float(as_double.mean()),
    }


def _scalar(name: str, value: float | int | bool | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().item())
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")
