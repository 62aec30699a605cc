"""Tests for the proximal sources (``trainer.proximal``, copc.trainer.proximal; issue 16 item 4).

- ``snapshot`` against a slow per-token oracle: each token's version's weights loaded into a fresh
  model, each token's log-prob computed alone from its own prefix;
- ``ewma`` and ``loglinear`` golden values worked by hand;
- resume losslessness of the stateful sources (``snapshot``, ``ewma``) through a weights-only checkpoint;
- every source with every preset that has a proximal policy, and one line for the presets without one.

``recompute`` staying bit-identical to main was checked against main's source on a fixed run (the
report of the branch); here its ``old`` is checked bit for bit against the plain formula.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import replace

import pytest
import torch

from copc import tracking as m
from copc.channels.methods import get_method, method_names
from copc.config import ConfigError
from copc.models import build_tiny_model
from copc.models.hf import ValueModel, token_logprobs
from copc.ops import zero_where_not
from copc.run.config import apply_run_overrides, default_config, validate_names
from copc.trainer.batching import TrainBatch, collate
from copc.trainer.checkpoint import load_checkpoint, save_checkpoint
from copc.trainer.config import TrainerConfig
from copc.trainer.proximal import (
    SnapshotMissingError,
    ewma_update,
    loglinear_alpha,
    loglinear_logp,
    weights_nbytes,
)
from copc.trainer.trainer import ActorCriticTrainer
from copc.types import Trajectory

from .test_trainer import TOKENIZER, make_trainer, params, synthetic_trajectories

PROXIMAL_METHODS = [name for name in method_names() if get_method(name).needs_old_forward]


def weights(trainer: ActorCriticTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.policy_weights().items()}


def batch_of(model: torch.nn.Module, *, seed: int, versions: tuple[int, ...] | None = None,
             n: int = 8) -> TrainBatch:
    """Synthetic rows; with ``versions``, every sampled token gets a version drawn from it (several per row,
    as interruptible rollouts produce)."""
    trajs = synthetic_trajectories(model, n=n, seed=seed)
    if versions is not None:
        gen = torch.Generator().manual_seed(seed + 100)
        choice = torch.tensor(versions)
        trajs = [
            replace(t, policy_version=torch.where(
                t.action_mask, choice[torch.randint(len(versions), t.action_mask.shape, generator=gen)], -1))
            for t in trajs
        ]
    return collate(trajs, pad_id=TOKENIZER.pad_token_id)


def trained(method: str = "copc", steps: int = 3,
            **overrides: object) -> tuple[ActorCriticTrainer, list[dict[str, torch.Tensor]]]:
    """A trainer after ``steps`` steps and the weights of every version it published (0 .. steps)."""
    trainer = make_trainer(method, micro_batch_size=3, **overrides)
    history = [weights(trainer)]
    for step in range(steps):
        trainer.step(batch_of(trainer.policy, seed=step, versions=(step,)))  # on-policy tags
        history.append(weights(trainer))
    return trainer, history


# ---------------------------------------------------------------- snapshot
def slow_snapshot_oracle(batch: TrainBatch, history: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """``old[i, t] = log pi_{v_it}(x_t | x_<t)`` token by token: a fresh model per version (other seed, then
    that version's weights), one unpadded prefix per token."""
    out = torch.zeros(batch.input_ids.shape)
    models = {}
    for v, w in enumerate(history):
        model = build_tiny_model(TOKENIZER, seed=123)
        model.load_state_dict(w)
        models[v] = model.eval()
    with torch.no_grad():
        for i, t in batch.action_mask.nonzero().tolist():
            prefix = batch.input_ids[i, : t + 1][None]
            logp = token_logprobs(models[int(batch.policy_version[i, t])], prefix,
                                  torch.ones_like(prefix, dtype=torch.bool)).logp
            out[i, t] = logp[0, t]
    return out


def test_snapshot_matches_the_per_token_recomputation_at_each_tokens_version() -> None:
    trainer, history = trained(proximal="snapshot")
    assert trainer.proximal.store is not None and trainer.proximal.store.versions == (0, 1, 2, 3)
    batch = batch_of(trainer.policy, seed=7, versions=(0, 1, 2, 3))
    assert (batch.policy_version[batch.action_mask].unique().numel() == 4
            and any(batch.policy_version[i][batch.action_mask[i]].unique().numel() > 1 for i in range(
                batch.batch_size)))
    st = trainer.prepare(batch)
    want = slow_snapshot_oracle(batch, history)
    # float32 forwards of padded micro-batches vs one unpadded prefix each: summation order only (~1e-7);
    # a wrong version is off by the policy change of one step (>> 1e-3 here: lr 1e-3 on a tiny model).
    mask = batch.action_mask
    torch.testing.assert_close(st.logp_old[mask], want[mask], rtol=0, atol=2e-5)
    assert torch.all(st.logp_old[~mask] == 0)
    recompute = zero_where_not(mask, token_logprobs(trainer.policy, batch.input_ids,
                                                    batch.attention_mask).logp.detach())
    older = mask & (batch.policy_version < 3)
    assert (st.logp_old[older] - recompute[older]).abs().max() > 1e-3  # the versions really differ
    assert trainer.proximal.version_forwards == 4


def test_snapshot_at_staleness_zero_is_recompute_bit_for_bit() -> None:
    a, _ = trained(proximal="snapshot", steps=2)
    b, _ = trained(proximal="recompute", steps=2)
    batch = batch_of(a.policy, seed=9, versions=(2,))
    ma, mb = a.step(batch), b.step(batch)
    for name, value in a.policy.named_parameters():
        assert torch.equal(value, dict(b.policy.named_parameters())[name]), name
    assert ma[m.LOSS_POLICY] == mb[m.LOSS_POLICY]
    assert ma[m.PROXIMAL_SNAPSHOT_VERSIONS] == 4 and ma[m.PROXIMAL_VERSION_FORWARDS] == 1
    assert ma[m.PROXIMAL_SNAPSHOT_BYTES] == 4 * weights_nbytes(a.policy.state_dict())


def test_snapshot_memory_bound_evicts_the_oldest_and_names_the_fix() -> None:
    one = weights_nbytes(build_tiny_model(TOKENIZER, seed=0).state_dict())
    trainer, _ = trained(proximal="snapshot", proximal_max_bytes=2 * one)
    assert trainer.proximal.store is not None and trainer.proximal.store.versions == (2, 3)
    with pytest.raises(SnapshotMissingError,
                       match=r"version 1 .* holds versions 2..3 .* raise proximal_max_bytes"):
        trainer.prepare(batch_of(trainer.policy, seed=3, versions=(1, 3)))
    with pytest.raises(ValueError, match="cannot hold one policy version"):
        make_trainer(proximal="snapshot", proximal_max_bytes=one - 1)


# ---------------------------------------------------------------- ewma
def test_ewma_update_golden() -> None:
    # beta = 0.5, theta_0 = 0, theta_1 = 1, theta_2 = 2: W = 1 -> 1.5 -> 1.75;
    # bar_1 = (0.5 * 1 * 0 + 1) / 1.5 = 2/3; bar_2 = (0.5 * 1.5 * 2/3 + 2) / 1.75 = 2.5 / 1.75 = 10/7
    # = (0.25 * 0 + 0.5 * 1 + 1 * 2) / (0.25 + 0.5 + 1), the normalised EWMA.
    avg = {"w": torch.zeros(2, dtype=torch.float64)}
    total = ewma_update(avg, {"w": torch.ones(2, dtype=torch.float64)}, total=1.0, decay=0.5)
    assert total == 1.5 and torch.allclose(avg["w"], torch.full((2,), 2 / 3, dtype=torch.float64), rtol=0,
                                           atol=1e-15)
    total = ewma_update(avg, {"w": torch.full((2,), 2.0, dtype=torch.float64)}, total=total, decay=0.5)
    assert total == 1.75 and torch.allclose(avg["w"], torch.full((2,), 10 / 7, dtype=torch.float64), rtol=0,
                                            atol=1e-15)


def test_ewma_weights_after_three_updates_and_the_old_they_give() -> None:
    # One optimizer step per trainer step (1 minibatch); beta = 0.5: bar_3 = (1 th0 + 2 th1 + 4 th2 + 8 th3) /
    # 15.
    trainer, history = trained("areal", proximal="ewma", proximal_decay=0.5, actor_minibatches=1,
                               optimizer="sgd", actor_lr=0.5)
    assert trainer.proximal.ewma is not None
    bar = trainer.proximal.ewma.weights()
    for key in bar:
        want = sum(c * h[key].double() for c, h in zip((1, 2, 4, 8), history, strict=True)) / 15
        torch.testing.assert_close(bar[key].double(), want, rtol=0, atol=1e-6)
    assert trainer.proximal.ewma.updates == 3 and trainer.proximal.ewma.total == pytest.approx(1.875)
    batch = batch_of(trainer.policy, seed=5)
    st = trainer.prepare(batch)
    model = build_tiny_model(TOKENIZER, seed=77)
    model.load_state_dict({k: v.float() for k, v in bar.items()})
    with torch.no_grad():
        want_old = token_logprobs(model.eval(), batch.input_ids, batch.attention_mask).logp
    mask = batch.action_mask
    torch.testing.assert_close(st.logp_old[mask], want_old[mask], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- loglinear
def test_loglinear_alpha_and_logp_golden() -> None:
    # n = 5, so v_theta = 5, v_prox = 4: alpha = (4 - v) / (5 - v) clamped to [0, 1]:
    # v = 5 -> 0 (v_theta = v), 4 -> 0, 3 -> 1/2, 2 -> 2/3, 1 -> 3/4; unsampled (-1) -> 0.
    versions = torch.tensor([[5, 4, 3, 2, 1, -1]])
    mask = torch.tensor([[True, True, True, True, True, False]])
    alpha = loglinear_alpha(versions, mask, version=5)
    torch.testing.assert_close(alpha, torch.tensor([[0.0, 0.0, 0.5, 2 / 3, 0.75, 0.0]]), rtol=0, atol=1e-7)
    mu = torch.full((1, 6), -2.0)
    cur = torch.full((1, 6), -1.0)
    # mu + alpha (cur - mu): -2, -2, -1.5, -2 + 2/3, -1.25; 0 off the mask.
    got = loglinear_logp(mu, cur, alpha, mask)
    torch.testing.assert_close(got, torch.tensor([[-2.0, -2.0, -1.5, -4 / 3, -1.25, 0.0]]), rtol=0, atol=1e-6)


def count_forwards(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_loglinear_skips_the_old_forward_and_interpolates_towards_the_first_forward() -> None:
    trainer, _ = trained("areal", steps=3, proximal="loglinear", actor_minibatches=1)
    batch = batch_of(trainer.policy, seed=11, versions=(0, 1, 2, 3))
    with torch.no_grad():
        cur0 = token_logprobs(trainer.policy.eval(), batch.input_ids, batch.attention_mask).logp
    calls = count_forwards(trainer.policy)
    metrics = trainer.step(batch)
    assert calls[0] == 3  # 8 rows in micro-batches of 3: the actor's forwards only, no old forward
    # One minibatch: its forward is the step-start policy, so old = mu + alpha (cur0 - mu) and
    # log(old / mu) = alpha (cur0 - mu); n = 3: alpha = 1/2 at v = 1, 2/3 at v = 0, else 0.
    mask = batch.action_mask
    alpha = torch.where(batch.policy_version == 1, 0.5, torch.where(batch.policy_version == 0, 2 / 3, 0.0))
    want = (alpha * (cur0 - batch.logp_behav)).clamp(-20, 20)[mask].abs().mean()
    assert metrics[m.RATIO_MEAN_ABS_LOG_W] == pytest.approx(float(want), rel=1e-5)


def test_loglinear_with_a_step_start_ratio_costs_one_forward() -> None:
    trainer, _ = trained("copc", steps=2, proximal="loglinear")
    batch = batch_of(trainer.policy, seed=3, versions=(0, 1, 2))
    calls = count_forwards(trainer.policy)
    trainer.step(batch)
    # 8 rows: the step-start forward in micro-batches of 3 (the advantage channel reads log w), then
    # copc's 4 minibatches of 2 rows, one forward each.
    assert calls[0] == 3 + 4


# ---------------------------------------------------------------- resume, presets, rejection
def round_trip(state: dict[str, object]) -> dict[str, object]:
    """Through a checkpoint on disk (state.pt under torch.load(weights_only=True), safetensors files)."""
    with tempfile.TemporaryDirectory() as tmp:
        return load_checkpoint(save_checkpoint(tmp, 1,
                                               {"trainer": state}))["trainer"]  # type: ignore[return-value]


@pytest.mark.parametrize("source", ["snapshot", "ewma"])
def test_stateful_sources_resume_losslessly(source: str) -> None:
    trainer, _ = trained("copc", steps=2, proximal=source)
    clone = make_trainer("copc", seed=4, micro_batch_size=3, proximal=source)
    clone.load_state_dict(round_trip(copy.deepcopy(trainer.state_dict())))
    for step in range(2):
        batch = batch_of(trainer.policy, seed=20 + step, versions=(0, 1, 2))
        m1, m2 = trainer.step(batch), clone.step(batch)
        assert m1[m.LOSS_POLICY] == m2[m.LOSS_POLICY]
    for name, value in params(trainer.policy).items():
        assert torch.equal(value, params(clone.policy)[name]), name
    if source == "ewma":
        assert trainer.proximal.ewma is not None and clone.proximal.ewma is not None
        for key, value in trainer.proximal.ewma.weights().items():
            assert torch.equal(value, clone.proximal.ewma.weights()[key]), key


@pytest.mark.parametrize("source", ["recompute", "snapshot", "ewma", "loglinear"])
@pytest.mark.parametrize("method", PROXIMAL_METHODS)
def test_every_source_trains_every_method_with_a_proximal_policy(method: str, source: str) -> None:
    policy = build_tiny_model(TOKENIZER, seed=0)
    torch.manual_seed(0)
    critic = ValueModel.from_policy(policy) if get_method(method).needs_critic else None
    trainer = ActorCriticTrainer(policy, critic, get_method(method),
                                 TrainerConfig(actor_lr=1e-3, micro_batch_size=4, critic_warmup_steps=0,
                                               proximal=source))
    before = params(policy)
    trainer.step(batch_of(policy, seed=0, n=6))
    metrics = trainer.step(batch_of(policy, seed=1, n=6, versions=(0, 1)))
    assert all(v == v for v in metrics.values())  # no NaN
    assert any(not torch.equal(v, before[k]) for k, v in policy.named_parameters())


def test_sources_are_refused_for_methods_without_a_proximal_policy() -> None:
    with pytest.raises(ValueError, match=r"trainer\.proximal=snapshot needs a method with a proximal"):
        make_trainer("async_ppo", proximal="snapshot")
    cfg = apply_run_overrides(default_config(), ["method=async_ppo", "trainer.proximal=ewma"])
    with pytest.raises(ConfigError, match=r"trainer\.proximal=ewma needs a method with a proximal"):
        validate_names(cfg, check_options=False)
    with pytest.raises(ValueError, match=r"trainer\.proximal must be one of"):
        TrainerConfig(proximal="exact")  # type: ignore[arg-type]


def test_trajectory_versions_reach_the_batch() -> None:
    """The per-token version the sources read is ``Trajectory.policy_version`` as collated (-1 off-action)."""
    traj: Trajectory = synthetic_trajectories(build_tiny_model(TOKENIZER, seed=0), n=1, version=4)[0]
    batch = collate([traj], pad_id=TOKENIZER.pad_token_id)
    assert torch.equal(batch.policy_version[0][traj.action_mask], torch.full((traj.num_action_tokens,), 4))
    assert torch.all(batch.policy_version[0][~traj.action_mask] == -1)


# ---------------------------------------------------------------- issue 12 item 2: old from the first forward
@pytest.mark.parametrize("micro", [2, 1])
def test_old_forward_reuse_trains_like_the_separate_forward(micro: int) -> None:
    """copc, 8 rows in 4 minibatches: the first minibatch's 2 rows take ``old`` from their own first
    (train-mode, with grad) forward instead of the step-start no-grad one.

    Equal to float tolerance, not bit for bit: the separate forward runs those rows in other micro-batches
    (other neighbours, other padded length), so its values differ in float32 summation order (~1e-7), and
    with reuse ``cur / old`` is exactly 1 on those rows instead of 1 +- 1e-7. SGD (linear in the gradient,
    as in the accumulation-invariance test, lr 0.1: at 0.5 eight chained updates amplify 1e-8 to 1e-6) so
    the difference stays ~1e-7 in the weights; 1e-6 bounds it. ``micro = 1`` holds two micro-batch graphs
    of the first minibatch (and is bit-identical here: one-row micro-batches are the same computation
    either way); entropy bonus and 2 epochs on.
    """
    runs = []
    for reuse in (False, True):
        trainer = make_trainer("copc", micro_batch_size=micro, optimizer="sgd", actor_lr=0.1, critic_lr=0.1,
                               max_grad_norm=0.0, critic_max_grad_norm=0.0, entropy_coef=0.01, ppo_epochs=2,
                               old_forward_reuse=reuse)
        history = [trainer.step(batch_of(trainer.policy, seed=s, versions=(max(s - 1, 0),
                                                                           ))) for s in range(2)]
        runs.append((params(trainer.policy), params(trainer.critic), history))
    (pi_a, v_a, h_a), (pi_b, v_b, h_b) = runs
    moved = 0.0
    for name in pi_a:
        torch.testing.assert_close(pi_b[name], pi_a[name], rtol=0, atol=1e-6)
        moved = max(moved, float((pi_a[name] - make_trainer("copc").policy.state_dict()[name]).abs().max()))
    assert moved > 1e-3  # the comparison is not vacuous
    for name in v_a:
        torch.testing.assert_close(v_b[name], v_a[name], rtol=0, atol=1e-6)
    for ma, mb in zip(h_a, h_b, strict=True):
        assert mb[m.PROXIMAL_REUSED_ROWS_FRAC] == 0.25 and m.PROXIMAL_REUSED_ROWS_FRAC not in ma
        for key in (m.LOSS_POLICY, m.LOSS_VALUE, m.RATIO_MEAN_ABS_LOG_W, m.ADV_RAW_MEAN):
            assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key


def test_old_forward_reuse_saves_the_first_minibatchs_old_forward() -> None:
    trainer = make_trainer("copc", micro_batch_size=2, old_forward_reuse=True)
    batch = batch_of(trainer.policy, seed=0, versions=(0,))
    calls = count_forwards(trainer.policy)
    trainer.step(batch)
    assert calls[0] == 3 + 4  # old for the 6 other rows in micro-batches of 2, then 4 actor minibatches
    assert trainer.prepare(batch).reused_rows == 2


@pytest.mark.parametrize(("method", "minibatches"), [("copc", 1), ("ppo", 2)])
def test_critic_forward_reuse_trains_like_the_separate_forward(method: str, minibatches: int) -> None:
    """V_old of the first critic minibatch's rows from their own first critic forward: the same training to
    float tolerance (as the old-forward test above: other micro-batch neighbours, other summation order),
    with the old forward reuse on too (both kept forwards in one step), value clipping on (copc, ppo: 0.5),
    and a second critic minibatch (ppo) whose rows keep the separate forward. Critic lr 0.03: at 0.1 the ppo
    critic diverges in the second step (weights ~2e5), where any rounding difference grows past any tolerance
    (bit-identical on one CPU, 1e4 apart on another)."""
    runs = []
    for reuse in (False, True):
        trainer = make_trainer(method, micro_batch_size=2, optimizer="sgd", actor_lr=0.1, critic_lr=0.03,
                               max_grad_norm=0.0, critic_max_grad_norm=0.0, critic_minibatches=minibatches,
                               critic_updates=2, old_forward_reuse=True, critic_forward_reuse=reuse)
        history = [trainer.step(batch_of(trainer.policy, seed=s, versions=(max(s - 1, 0),
                                                                           ))) for s in range(2)]
        runs.append((params(trainer.policy), params(trainer.critic), history))
    (pi_a, v_a, h_a), (pi_b, v_b, h_b) = runs
    start = params(make_trainer(method).critic)
    assert max(float((v_a[k] - start[k]).abs().max()) for k in v_a) > 1e-3  # the comparison is not vacuous
    assert max(float(v.abs().max()) for v in v_a.values()) < 10  # ... nor made in a diverging run
    for a, b in ((pi_a, pi_b), (v_a, v_b)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6)
    for ma, mb in zip(h_a, h_b, strict=True):
        for key in (m.LOSS_POLICY, m.LOSS_VALUE, m.ADV_RAW_MEAN, m.RETURNS_MEAN):
            assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key


def test_critic_forward_reuse_saves_the_first_minibatchs_value_forward() -> None:
    """8 rows in micro-batches of 2, one critic minibatch, one critic epoch: without reuse 4 value forwards
    before the update and 4 in it; with reuse only the update's 4. Nothing is held after the step."""
    counts = []
    for reuse in (False, True):
        trainer = make_trainer("copc", micro_batch_size=2, critic_forward_reuse=reuse)
        calls = count_forwards(trainer.critic)
        trainer.step(batch_of(trainer.policy, seed=0, versions=(0,)))
        counts.append(calls[0])
        assert not trainer._early_values
    assert counts == [4 + 4, 4]


def test_old_forward_reuse_falls_back_where_train_and_eval_forwards_differ() -> None:
    trainer = make_trainer("copc", micro_batch_size=2, old_forward_reuse=True)
    for module in trainer.policy.modules():  # dropout: a train-mode forward is not pi_old's
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    metrics = trainer.step(batch_of(trainer.policy, seed=0, versions=(0,)))
    assert metrics[m.PROXIMAL_REUSED_ROWS_FRAC] == 0.0
    frozen = make_trainer("copc", micro_batch_size=2, old_forward_reuse=True, critic_warmup_steps=1)
    metrics = frozen.step(batch_of(frozen.policy, seed=0, versions=(0,)))  # critic warm-up: no actor forward
    assert metrics[m.PROXIMAL_REUSED_ROWS_FRAC] == 0.0
