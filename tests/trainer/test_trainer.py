"""Tests for copc.trainer.trainer: one actor-critic step on synthetic trajectories and the tiny model.

The second half holds the trainer's defects of issue 10, each with a test that failed before its fix:
the sampler's top-p / top-k transform in the trainer's log-probs (3), the ratio diagnostics of methods
without an ``old`` forward (5), eval-mode no-grad forwards, truncated rows out of the whitening
statistics and the KL / entropy denominators under ``denominator = kept`` (6)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from copc import tracking as m
from copc.channels.methods import get_method
from copc.models import build_tiny_model, build_tiny_tokenizer
from copc.models.hf import ValueModel, token_logprobs
from copc.ops import importance_diagnostics, log_ratio
from copc.rollout.engine import Engine
from copc.rollout.sampling import SamplingConfig
from copc.trainer.batching import TrainBatch, collate
from copc.trainer.config import TrainerConfig
from copc.trainer.trainer import ActorCriticTrainer
from copc.types import StopReason, Trajectory

TOKENIZER = build_tiny_tokenizer()


def synthetic_trajectories(model: torch.nn.Module, *, n: int = 8, seed: int = 0, behaviour_noise: float = 0.3,
                           version: int = 0) -> list[Trajectory]:
    """Prompt, a sampled span, a tool-output span (not sampled), a second sampled span; terminal reward.

    Behaviour log-probs are the model's own teacher-forced log-probs plus Gaussian noise (a stale mu);
    ``behaviour_noise = 0`` makes mu exactly the current policy.
    """
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        lens = [int(torch.randint(3, 6, (1,), generator=gen)), int(torch.randint(2, 7, (1,), generator=gen)),
                int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))]
        ids = torch.randint(4, 100, (sum(lens),), generator=gen)
        ids[0] = TOKENIZER.bos_token_id
        mask = torch.zeros(sum(lens), dtype=torch.bool)
        mask[lens[0]: lens[0] + lens[1]] = True
        mask[lens[0] + lens[1] + lens[2]:] = True
        with torch.no_grad():
            logp = token_logprobs(model, ids[None], torch.ones(1, len(ids), dtype=torch.bool)).logp[0]
        logp = logp + behaviour_noise * torch.randn(len(ids), generator=gen)
        reward = float(i % 3 == 0)
        rewards = torch.zeros(len(ids))
        rewards[-1] = reward
        trajs.append(Trajectory(
            prompt_id=f"p{i // 2}", token_ids=ids, prompt_len=lens[0], action_mask=mask,
            logp_behav=torch.where(mask, logp, 0.0), policy_version=torch.where(mask, version, -1),
            reward=reward, token_rewards=rewards,
            stop_reason=StopReason.ANSWER if i % 4 else StopReason.MAX_TOKENS, group=i // 2,
        ))
    return trajs


def make_trainer(method: str = "copc", *, seed: int = 0, **overrides: object) -> ActorCriticTrainer:
    policy = build_tiny_model(TOKENIZER, seed=seed)
    torch.manual_seed(seed)  # the value head is initialised from the global RNG
    critic = ValueModel.from_policy(policy)
    cfg = TrainerConfig(**{"actor_lr": 1e-3, "critic_lr": 1e-3, "micro_batch_size": 4,
                           "critic_warmup_steps": 0,
                           **overrides})  # type: ignore[arg-type]
    return ActorCriticTrainer(policy, critic, get_method(method), cfg)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_every_trainable_parameter_changes_and_version_advances() -> None:
    trainer = make_trainer()
    batch = collate(synthetic_trajectories(trainer.policy), pad_id=TOKENIZER.pad_token_id)
    before_pi, before_v = params(trainer.policy), params(trainer.critic)
    metrics = trainer.step(batch)
    assert trainer.version == 1
    for name, value in trainer.policy.named_parameters():
        assert not torch.equal(value, before_pi[name]), f"policy parameter {name} did not change"
    for name, value in trainer.critic.named_parameters():  # type: ignore[union-attr]
        assert not torch.equal(value, before_v[name]), f"critic parameter {name} did not change"
    for key in ("loss/policy", "loss/value", "grad/actor_norm", "grad/critic_norm", "critic/explained_var",
                "critic/value_bias_gap", "time/train", "time/train_cpu"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    # one thread's CPU time within its wall
    assert 0 < metrics["time/train_cpu"] <= metrics["time/train"] + 1e-3


def test_critic_warmup_freezes_the_actor() -> None:
    trainer = make_trainer(critic_warmup_steps=1)
    batch = collate(synthetic_trajectories(trainer.policy), pad_id=TOKENIZER.pad_token_id)
    before_pi, before_v = params(trainer.policy), params(trainer.critic)
    trainer.step(batch)
    assert all(torch.equal(v, before_pi[k]) for k, v in trainer.policy.named_parameters())
    assert not all(torch.equal(v, before_v[k]) for k,
                   v in trainer.critic.named_parameters())  # type: ignore[union-attr]
    assert trainer.version == 1
    trainer.step(batch)  # warm-up over: the actor moves
    assert not all(torch.equal(v, before_pi[k]) for k, v in trainer.policy.named_parameters())


@pytest.mark.parametrize("method", ["copc", "ppo"])
def test_micro_batch_accumulation_is_invariant(method: str) -> None:
    """One micro-batch of 8 rows and 8 micro-batches of 1 row give the same update (global token count).

    SGD (not Adam) so the update is linear in the gradient: Adam's first step is ~lr*sign(g), which turns
    float32 summation-order noise on near-zero gradients into full-size differences. Tolerance 1e-6:
    the two gradients differ only by float32 summation order (~1e-7 relative).
    """
    trajs = synthetic_trajectories(build_tiny_model(TOKENIZER, seed=0))
    batch = collate(trajs, pad_id=TOKENIZER.pad_token_id)
    results = []
    for micro in (8, 1):
        trainer = make_trainer(method, micro_batch_size=micro, optimizer="sgd", actor_lr=0.5, critic_lr=0.5,
                               max_grad_norm=0.0, critic_max_grad_norm=0.0, actor_minibatches=1,
                               entropy_coef=0.01)
        metrics = trainer.step(batch)
        results.append((params(trainer.policy), params(trainer.critic), metrics))
    (pi_a, v_a, m_a), (pi_b, v_b, m_b) = results
    moved = 0.0
    for name in pi_a:
        torch.testing.assert_close(pi_a[name], pi_b[name], rtol=0, atol=1e-6)
    for name in v_a:
        torch.testing.assert_close(v_a[name], v_b[name], rtol=0, atol=1e-6)
    init = params(build_tiny_model(TOKENIZER, seed=0))
    moved = max(float((pi_a[k] - init[k]).abs().max()) for k in init)
    assert moved > 1e-4  # the step did something, so equality is not vacuous
    assert m_a["loss/policy"] == pytest.approx(m_b["loss/policy"], abs=1e-6)
    # the logged entropy is the minibatch's token mean whatever the micro-batches (it was divided by the
    # global count and then weighted by each micro-batch's token share again: 1/8 of it in 8 pieces)
    assert m_b["loss/entropy"] == pytest.approx(m_a["loss/entropy"], rel=1e-5)


def test_tool_and_prompt_tokens_get_no_gradient() -> None:
    """The logits that predict a non-action token (prompt, tool output, padding) get exactly zero gradient."""
    trainer = make_trainer(entropy_coef=0.01, kl_coef=0.0)
    trajs = synthetic_trajectories(trainer.policy)
    batch = collate(trajs, pad_id=TOKENIZER.pad_token_id)
    state = trainer.prepare(batch)
    captured: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> None:
        output.retain_grad()
        captured.append(output)

    handle = trainer.policy.lm_head.register_forward_hook(keep)
    try:
        rows = torch.arange(batch.batch_size)
        from copc.trainer.batching import split_minibatches

        mb = split_minibatches(state.loss_mask, 1)[0]
        loss, _, _ = trainer._actor_loss(batch, state, rows, mb)
        loss.backward()
    finally:
        handle.remove()
    grad = captured[0].grad  # [B, T', V]: position p predicts token p + 1
    assert grad is not None
    length = grad.shape[1]
    predicts_action = batch.action_mask[:, 1:length + 1]
    predicts_action = torch.cat([predicts_action, torch.zeros(batch.batch_size,
                                                              length - predicts_action.shape[1],
                                                              dtype=torch.bool)], dim=1)
    assert bool((grad[~predicts_action] == 0).all()), "a non-action token received gradient"
    assert float(grad[predicts_action].abs().sum()) > 0


def test_zero_staleness_gives_unit_behaviour_weights() -> None:
    """mu == pi_old (same weights, same forward) makes log w exactly 0 on every action token."""
    trainer = make_trainer(micro_batch_size=8)
    trajs = synthetic_trajectories(trainer.policy, behaviour_noise=0.0)
    batch = collate(trajs, pad_id=TOKENIZER.pad_token_id)
    # Recompute mu with the trainer's own padded forward so it is bit-identical to logp_old.
    with torch.no_grad():
        logp = token_logprobs(trainer.policy, batch.input_ids, batch.attention_mask).logp
    batch = replace(batch, logp_behav=torch.where(batch.action_mask, logp, 0.0))
    state = trainer.prepare(batch)
    assert torch.equal(state.log_w, torch.zeros_like(state.log_w))
    stale = trainer.prepare(collate(synthetic_trajectories(trainer.policy), pad_id=TOKENIZER.pad_token_id))
    assert float(stale.log_w.abs().max()) > 0.1  # noisy mu: weights differ from 1


def test_engine_behaviour_logprobs_give_unit_weights_in_the_trainer() -> None:
    """End to end at lag 0: mu recorded by the engine (left-padded KV-cached decode, rows of different
    lengths, a real task's prompts and grading) and the trainer's step-start forward on the collated,
    right-padded batch agree on every action token to float rounding, so w = old/mu is 1 and COPC's mask and
    clips do nothing."""
    from copc.rollout.generator import RolloutConfig, RolloutGenerator
    from copc.tasks import get_task

    trainer = make_trainer("copc", micro_batch_size=4)
    config = RolloutConfig(prompts_per_batch=4, group_size=2, max_new_tokens_per_turn=12, max_total_tokens=24,
                           temperature=1.0)
    generator = RolloutGenerator(trainer.policy, TOKENIZER, get_task("kv_search", eval_size=8),
                                 config, seed=0)
    batch = collate(generator.generate(0).trajectories, pad_id=TOKENIZER.pad_token_id)
    lengths = batch.attention_mask.sum(dim=1)
    assert int(lengths.min()) < int(lengths.max()) and batch.num_action_tokens > 40  # padding is exercised
    state = trainer.prepare(batch)
    assert float(state.log_w[batch.action_mask].abs().max()) < 1e-5
    assert float(state.log_w[~batch.action_mask].abs().max()) == 0.0


def test_method_from_channel_configs_directly() -> None:
    """A MethodConfig assembled from channel configs (not a preset name) drives the trainer."""
    base = get_method("copc")
    custom = replace(base, name="custom", policy=get_method("ppo").policy)
    policy = build_tiny_model(TOKENIZER, seed=1)
    trainer = ActorCriticTrainer(policy, ValueModel.from_policy(policy), custom,
                                 TrainerConfig(actor_lr=1e-3, critic_warmup_steps=0))
    before = params(trainer.policy)
    trainer.step(collate(synthetic_trajectories(policy), pad_id=TOKENIZER.pad_token_id))
    assert not all(torch.equal(v, before[k]) for k, v in trainer.policy.named_parameters())


def test_state_dict_round_trip_continues_identically() -> None:
    trainer = make_trainer()
    batch = collate(synthetic_trajectories(trainer.policy), pad_id=TOKENIZER.pad_token_id)
    trainer.step(batch)
    clone = make_trainer(seed=5)
    clone.load_state_dict(copy.deepcopy(trainer.state_dict()))
    m1, m2 = trainer.step(batch), clone.step(batch)
    for name, value in trainer.policy.named_parameters():
        assert torch.equal(value, dict(clone.policy.named_parameters())[name])
    assert m1["loss/policy"] == m2["loss/policy"]


# ---------------------------------------------------------------- issue 10: faithful trainer

PROMPTS = ["Compute 3+4.", "hi", "<python>print(1)</python>\n<output>1\n</output>", "12*13="]


def sampled_batch(model: torch.nn.Module, config: SamplingConfig) -> TrainBatch:
    """Trajectories sampled by the real engine with ``config`` (behaviour log-probs as it recorded them)."""
    tok = build_tiny_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    gens = Engine(model, tok).generate(prompts, config, seeds=[11, 12, 13, 14])  # type: ignore[arg-type]
    trajs = []
    for i, (prompt, gen) in enumerate(zip(prompts, gens, strict=True)):
        n, k = len(prompt), len(gen.token_ids)
        ids = torch.tensor(prompt + gen.token_ids.tolist())
        mask = torch.arange(n + k) >= n
        logp = torch.zeros(n + k)
        logp[n:] = gen.logp
        rewards = torch.zeros(n + k)
        rewards[-1] = float(i % 2)
        trajs.append(Trajectory(
            prompt_id=f"p{i}", token_ids=ids, prompt_len=n, action_mask=mask, logp_behav=logp,
            policy_version=torch.where(mask, 0, -1), reward=float(i % 2), token_rewards=rewards,
            stop_reason=StopReason.ANSWER, group=i,
        ))
    return collate(trajs, pad_id=tok.pad_token_id)


def test_top_p_sampling_at_zero_staleness_gives_unit_weights() -> None:
    # Defect 3: mu is the truncated, renormalised distribution, so a trainer computing old from the
    # full distribution sees old < mu (w < 1) on every token whose nucleus dropped mass, at s = 0.
    sampling = SamplingConfig(temperature=0.7, top_p=0.8, max_new_tokens=12)
    trainer = make_trainer("ppo", temperature=0.7, top_p=0.8, micro_batch_size=8)
    batch = sampled_batch(trainer.policy, sampling)
    st = trainer.prepare(batch)
    mask = batch.action_mask
    # KV-cached one-token-at-a-time vs one full forward: ~1e-6 (the engine tests' 1e-5 bound)
    assert float(st.log_w[mask].abs().max()) < 1e-5
    full = make_trainer("ppo", temperature=0.7, micro_batch_size=8).prepare(batch)  # the full distribution
    assert float(full.log_w[mask].mean()) < -0.05 and float((full.log_w[mask] < -1e-4).float().mean()) > 0.5
    # the sync PPO step on it: ESS 1, KL 0 (to float rounding)
    metrics = trainer.step(batch)
    assert metrics["ratio/ess_tok"] == pytest.approx(1.0, abs=1e-6)
    assert abs(metrics["ratio/kl_k3"]) < 1e-8


def test_top_k_transform_and_gradients_stay_finite() -> None:
    sampling = SamplingConfig(temperature=1.0, top_k=3, max_new_tokens=10)
    trainer = make_trainer("copc", top_k=3, micro_batch_size=8, entropy_coef=0.01)
    batch = sampled_batch(trainer.policy, sampling)
    st = trainer.prepare(batch)
    assert float(st.log_w[batch.action_mask].abs().max()) < 1e-5
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    metrics = trainer.step(batch)
    assert all(v == v for v in metrics.values())  # no NaN anywhere
    assert any(not torch.equal(v, before[k]) for k, v in trainer.policy.named_parameters())
    assert all(torch.isfinite(v).all() for v in trainer.policy.parameters())


def test_methods_without_an_old_forward_log_the_ratio_of_cur_to_mu() -> None:
    # Defect 5: async PPO (bypass) sets old := mu, so log w = 0 and the logs read ESS 1 and KL 0
    # whatever the staleness. One actor minibatch = every row: the stats must be those of cur/mu at
    # the step start, i.e. of the policy's own log-probs against the (noisy, stale) mu.
    trainer = make_trainer("async_ppo", actor_minibatches=1, micro_batch_size=3)
    batch = collate(synthetic_trajectories(trainer.policy, behaviour_noise=0.5),
                    pad_id=TOKENIZER.pad_token_id)
    with torch.no_grad():
        cur = token_logprobs(trainer.policy, batch.input_ids, batch.attention_mask).logp
    adv = get_method("async_ppo").advantage
    want = importance_diagnostics(log_ratio(cur, batch.logp_behav, batch.action_mask), batch.action_mask,
                                  clip_low=adv.ratio_low, clip_high=adv.ratio_high)
    metrics = trainer.step(batch)
    assert metrics["ratio/ess_tok"] < 0.95 and metrics["ratio/kl_k3"] > 0.05
    for key, value in want.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), key


def _with_dropout(model: torch.nn.Module, p: float) -> None:
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = p


def test_no_grad_forwards_run_in_eval_mode() -> None:
    # Defect 6: in train mode the old and value forwards draw dropout masks, so old != pi_old.
    policy = build_tiny_model(TOKENIZER, seed=0)
    _with_dropout(policy, 0.5)
    torch.manual_seed(0)
    critic = ValueModel.from_policy(policy)
    trainer = ActorCriticTrainer(policy, critic, get_method("copc"), TrainerConfig(micro_batch_size=8,
                                                                                   critic_warmup_steps=0))
    batch = collate(synthetic_trajectories(policy), pad_id=TOKENIZER.pad_token_id)
    policy.train()
    critic.train()
    st = trainer.prepare(batch)
    assert policy.training and critic.training  # the modes are restored
    policy.eval()
    critic.eval()
    with torch.no_grad():
        want_old = token_logprobs(policy, batch.input_ids, batch.attention_mask).logp
        want_v = critic(batch.input_ids, batch.attention_mask)
    mask = batch.action_mask
    torch.testing.assert_close(st.logp_old[mask], want_old[mask], rtol=0, atol=1e-6)
    torch.testing.assert_close(st.values_old[mask], want_v[mask], rtol=0, atol=1e-6)


def test_truncation_mask_keeps_dropped_rows_out_of_the_whitening() -> None:
    # Defect 6: the rows that truncation = mask removes from the losses must not set the statistics.
    trainer = make_trainer("copc", truncation="mask")
    trajs = synthetic_trajectories(trainer.policy)
    batch = collate(trajs, pad_id=TOKENIZER.pad_token_id)
    batch = replace(batch, truncated=torch.tensor([True, True, True] + [False] * (len(trajs) - 3)),
                    token_rewards=batch.token_rewards + 5.0 * torch.tensor([1.0, 1, 1] + [0.0] * (len(
                        trajs) - 3))[:, None])
    st = trainer.prepare(batch)
    a = st.advantages[st.loss_mask].double()
    assert st.loss_mask[:3].sum() == 0 and a.numel() > 10
    assert abs(a.mean().item()) < 1e-5 and abs(a.std(unbiased=True).item() - 1.0) < 1e-5


def test_kept_denominator_leaves_kl_and_entropy_over_valid_tokens() -> None:
    # Defect 6: with denominator = kept only the actor loss divides by the kept tokens; the entropy
    # (and KL) terms are token means over all valid tokens. One minibatch, so the entropy metric is
    # that of the step-start policy in both runs and must agree.
    base = get_method("copc")
    narrow = replace(base.policy, mask_low=0.9, mask_high=1.1)
    results = {}
    for den in ("all", "kept"):
        method = replace(base, policy=replace(narrow, denominator=den))
        policy = build_tiny_model(TOKENIZER, seed=0)
        torch.manual_seed(0)
        trainer = ActorCriticTrainer(policy, ValueModel.from_policy(policy), method,
                                     TrainerConfig(micro_batch_size=4, actor_minibatches=1,
                                                   critic_warmup_steps=0, entropy_coef=0.01))
        batch = collate(synthetic_trajectories(policy, behaviour_noise=0.5), pad_id=TOKENIZER.pad_token_id)
        results[den] = trainer.step(batch)
    assert results["kept"]["policy/mask_frac"] > 0.2  # the band really removes tokens
    assert results["kept"]["loss/entropy"] == pytest.approx(results["all"]["loss/entropy"], rel=1e-6)
    assert results["kept"]["policy/mask_frac"] == pytest.approx(results["all"]["policy/mask_frac"], rel=1e-6)


@pytest.mark.parametrize(("method", "micro"), [("copc", 3), ("async_ppo", 3), ("ppo", 1)])
def test_micro_batches_by_length_train_like_index_order(method: str, micro: int) -> None:
    """``trainer.micro_batch_by_length`` regroups each minibatch's rows (sorted by length) before cutting
    micro-batches: the same update to float tolerance (the sums run in another order), with the forwards
    kept by their rows (old and critic forward reuse) found again and the first minibatch's ratio
    diagnostics (async PPO 3a: no step-start old), stitched row by row, unchanged. One actor minibatch of 8
    rows in pieces of 3, two critic minibatches, 2 steps of SGD (linear in the gradient, as in the
    accumulation test)."""
    runs = []
    for by_length in (False, True):
        trainer = make_trainer(method, micro_batch_size=micro, optimizer="sgd", actor_lr=0.1, critic_lr=0.03,
                               max_grad_norm=0.0, critic_max_grad_norm=0.0, actor_minibatches=1,
                               critic_minibatches=2, entropy_coef=0.01, old_forward_reuse=method == "copc",
                               critic_forward_reuse=True, micro_batch_by_length=by_length)
        history = []
        for s in range(2):
            batch = collate(synthetic_trajectories(trainer.policy, seed=s), pad_id=TOKENIZER.pad_token_id)
            history.append(trainer.step(batch))
        runs.append((params(trainer.policy), params(trainer.critic), history))
    (pi_a, v_a, h_a), (pi_b, v_b, h_b) = runs
    init = params(build_tiny_model(TOKENIZER, seed=0))
    assert max(float((pi_a[k] - init[k]).abs().max()) for k in init) > 1e-3  # not vacuous
    for a, b in ((pi_a, pi_b), (v_a, v_b)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6)
    for ma, mb in zip(h_a, h_b, strict=True):
        keys = [k for k in ma if k.startswith(("loss/", "ratio/", "adv/")) and not k.startswith("ratio/time")]
        assert len(keys) > 5
        for key in keys:
            assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-6), key


# ---------------------------------------------------------------------------------------------------
# What a step reports: review 14's defects of the trainer's statistics, each test failed before its fix


def _frozen_step(method: str, **overrides: object) -> dict[str, float]:
    """One step whose learning rates (1e-30: the config asks for > 0) move no weight a float32 can see."""
    trainer = make_trainer(method, actor_lr=1e-30, critic_lr=1e-30, **overrides)
    batch = collate(synthetic_trajectories(trainer.policy, n=8, behaviour_noise=0.5),
                    pad_id=TOKENIZER.pad_token_id)
    return trainer.step(batch)


def test_step_statistics_do_not_depend_on_how_the_step_is_cut() -> None:
    """At lr ~0 neither network moves, so every token's mask / clip indicator and every value is fixed:
    the step's ``policy/*`` and ``value/*`` fractions and the explained variance must then be the same
    however the 8 rows (of unequal lengths) are cut into minibatches and micro-batches. Before: a plain
    mean of each minibatch's token mean (weighting short rows up), the explained variance of each
    micro-batch (0 for one-row pieces: G is constant along a row), and every statistic divided by the
    minibatch count asked for even when the batch had fewer rows (16 asked, 8 made: all halved)."""
    cuts = [(1, 1, 8), (2, 2, 3), (4, 4, 1), (8, 8, 2), (16, 16, 2)]
    runs = [_frozen_step("copc_behaviour", actor_minibatches=a, critic_minibatches=c,
                         micro_batch_size=mb) for a, c, mb in cuts]
    keys = sorted(k for k in runs[0] if k.startswith(("policy/", "value/")))
    assert {"policy/mask_frac", "policy/clip_frac_high", "value/mean_abs_err",
            "value/explained_var"} <= set(keys)
    assert runs[0]["policy/mask_frac"] > 0.05 and runs[0]["value/explained_var"] != 0.0  # not vacuous
    for cut, run in zip(cuts[1:], runs[1:], strict=True):
        for key in keys:
            assert run[key] == pytest.approx(runs[0][key], rel=1e-5, abs=1e-7), (cut, key)
    # when the critic does not move, the values the loss saw are the step-start ones
    assert runs[0]["value/explained_var"] == pytest.approx(runs[0]["critic/explained_var"], abs=1e-6)
    # 16 minibatches asked of 8 rows make the same 8 one-row minibatches as 8 asked: the same losses
    for key in ("loss/policy", "loss/value"):
        assert runs[4][key] == pytest.approx(runs[3][key], rel=1e-6), key


def test_ess_is_taken_per_actor_minibatch_for_every_method() -> None:
    """A normalised ESS reads higher on fewer rows, and a method without an ``old`` forward (async PPO 3a)
    measures the step-start ratio on its first minibatch only. So every method reports ESS per actor
    minibatch: with ``old`` on every row (3b), the mean over the minibatches; without, the first one's,
    which must equal 3b's first minibatch on the same batch, split and starting policy. Means such as
    the drift stay over the whole batch. Before: 3b's ESS was the whole batch's, 3a's a quarter's."""
    batch = collate(synthetic_trajectories(build_tiny_model(TOKENIZER, seed=0), n=16, behaviour_noise=0.6),
                    pad_id=TOKENIZER.pad_token_id)
    with_old, without = make_trainer("async_ppo_recompute",
                                     actor_minibatches=4), make_trainer("async_ppo", actor_minibatches=4)
    split = with_old._minibatches(batch.action_mask, 4, salt=100)
    with torch.no_grad():
        cur = token_logprobs(with_old.policy, batch.input_ids, batch.attention_mask).logp
    log_w = log_ratio(cur, batch.logp_behav, batch.action_mask)
    per = [importance_diagnostics(log_w[mb.index], batch.action_mask[mb.index], clip_low=0.8, clip_high=1.2)
           for mb in split]
    whole = importance_diagnostics(log_w, batch.action_mask, clip_low=0.8, clip_high=1.2)
    got_old, got_without = with_old.step(batch), without.step(batch)
    for key in ("ratio/ess_seq", "ratio/ess_tok"):
        assert got_old[key] == pytest.approx(sum(float(p[key]) for p in per) / 4, rel=1e-4), key
        assert got_without[key] == pytest.approx(float(per[0][key]), rel=1e-4), key
    assert float(whole["ratio/ess_seq"]) < got_old["ratio/ess_seq"]  # the whole batch reads lower: why
    assert got_old["ratio/mean_abs_log"] == pytest.approx(float(whole["ratio/mean_abs_log"]), rel=1e-4)


def test_a_step_without_an_actor_update_reports_no_first_minibatch_ratios() -> None:
    """During critic warm-up a method without an ``old`` forward has ``old := mu``, so its ``ratio/*``
    would read drift 0 and ESS 1 by construction, not by measurement: they are left out until the actor
    trains. A method with ``old`` measures them from step 0."""
    batch = collate(synthetic_trajectories(build_tiny_model(TOKENIZER, seed=0), behaviour_noise=0.5),
                    pad_id=TOKENIZER.pad_token_id)
    without = make_trainer("async_ppo", critic_warmup_steps=1)
    first, second = without.step(batch), without.step(batch)
    assert not [k for k in first if k.startswith("ratio/")]
    assert second["ratio/mean_abs_log"] > 0.1 and second["ratio/ess_seq"] < 1.0
    with_old = make_trainer("async_ppo_recompute", critic_warmup_steps=1).step(batch)
    assert with_old["ratio/mean_abs_log"] > 0.1


def test_a_method_without_a_critic_reports_no_critic() -> None:
    """AReaL's preset has no critic: explained variance, mean value and the bias gap describe a critic, so
    they are absent rather than 0 (an all-zero value array explains nothing: it read 0.000 in the
    records); the bias ``E_pi[R] - E_mu[R]`` needs no critic and stays."""
    policy = build_tiny_model(TOKENIZER, seed=0)
    trainer = ActorCriticTrainer(policy, None, get_method("areal"), TrainerConfig(micro_batch_size=4))
    metrics = trainer.step(collate(synthetic_trajectories(policy), pad_id=TOKENIZER.pad_token_id))
    assert not {"critic/explained_var", "critic/values_mean", "critic/value_bias_gap",
                "value/explained_var"} & set(metrics)
    assert "critic/value_bias" in metrics


def test_void_turn_episodes_can_be_left_out_of_the_losses() -> None:
    """SimpleTIR's filter: with ``void_turns = mask`` an episode with a void turn gives no gradient, so
    rewriting its reward and its behaviour log-probs leaves the update unchanged; with ``keep`` it trains
    like any other. ``batch/void_frac`` counts them either way."""
    from dataclasses import replace

    base = synthetic_trajectories(build_tiny_model(TOKENIZER, seed=0), behaviour_noise=0.3)
    marked = [replace(t, info={"void_turn": 1.0}) if i in (1, 4) else t for i, t in enumerate(base)]
    changed = [replace(t, reward=1.0 - t.reward, token_rewards=t.token_rewards.flip(0),
                       logp_behav=t.logp_behav - 0.7)
               if i in (1, 4) else t for i, t in enumerate(marked)]

    def update(trajs: list, mode: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        trainer = make_trainer("copc", void_turns=mode)
        metrics = trainer.step(collate(trajs, pad_id=TOKENIZER.pad_token_id))
        return params(trainer.policy) | {f"critic.{k}": v for k, v in params(trainer.critic).items()}, metrics

    (masked_a, m_a), (masked_b, _) = update(marked, "mask"), update(changed, "mask")
    for name, value in masked_a.items():
        torch.testing.assert_close(value, masked_b[name], rtol=0, atol=0, msg=name)
    assert m_a["batch/void_frac"] == pytest.approx(2 / 8)
    (kept_a, m_keep), (kept_b, _) = update(marked, "keep"), update(changed, "keep")
    assert any(not torch.equal(v, kept_b[k]) for k, v in kept_a.items())  # kept rows do train
    assert m_keep["batch/void_frac"] == pytest.approx(2 / 8)
    with pytest.raises(ValueError, match=r"trainer\.void_turns must be keep or mask"):
        make_trainer("copc", void_turns="drop")


def test_step_metrics_are_measured_or_left_out_never_zero_by_construction() -> None:
    """Audit of 2026-12-04: without a step-start old forward, log w = old - mu is 0 by construction, so the
    value bias read exactly 0 (its gap ignored the weights) however stale the batch; documented metrics
    (reward/std, adv/*, train/version, train/actor_frozen, ratio/ess_seq_snis) were never emitted."""
    by_method = {}
    for method in ("async_ppo", "async_ppo_recompute"):
        trainer = make_trainer(method)
        batch = collate(synthetic_trajectories(trainer.policy, behaviour_noise=1.0),
                        pad_id=TOKENIZER.pad_token_id)
        by_method[method] = trainer.step(batch), trainer, batch
    no_old, _, _ = by_method["async_ppo"]
    assert m.CRITIC_VALUE_BIAS not in no_old and m.CRITIC_VALUE_BIAS_GAP not in no_old
    assert m.RATIO_ESS_SEQ_SNIS not in no_old
    metrics, trainer, batch = by_method["async_ppo_recompute"]
    assert metrics[m.CRITIC_VALUE_BIAS] != 0.0 and 0.0 < metrics[m.RATIO_ESS_SEQ_SNIS] <= 1.0
    assert metrics[m.REWARD_STD] == pytest.approx(float(batch.scores.std(correction=0)))
    assert metrics[m.TRAIN_VERSION] == trainer.version == 1
    assert metrics[m.TRAIN_ACTOR_FROZEN] == 0.0  # make_trainer: no critic warm-up
    assert abs(metrics[m.ADV_MEAN]) < 1e-6 and metrics[m.ADV_STD] == pytest.approx(1.0, abs=1e-6)  # whitened
    warming = make_trainer("async_ppo_recompute", critic_warmup_steps=2)
    assert warming.step(batch)[m.TRAIN_ACTOR_FROZEN] == 1.0


def test_ratio_statistics_skip_a_first_minibatch_without_loss_tokens() -> None:
    """Audit of 2026-12-04: a method without old measured ratio/... on its first actor minibatch even when
    that minibatch had no loss tokens, and reported ESS 1 and mean |log r| 0 (perfectly on-policy)."""
    trainer = make_trainer("async_ppo", truncation="mask", shuffle=False, actor_minibatches=4)
    batch = collate(synthetic_trajectories(trainer.policy, behaviour_noise=1.0),
                    pad_id=TOKENIZER.pad_token_id)
    truncated = batch.truncated.clone()
    truncated[: batch.batch_size // 4] = True  # the first minibatch's rows leave the loss
    metrics = trainer.step(replace(batch, truncated=truncated))
    assert metrics[m.RATIO_MEAN_ABS_LOG_W] > 0.0 and metrics[m.RATIO_ESS_TOKEN] < 1.0

