"""copc's verl plugin against verl itself (``make test-verl``; skipped where verl is not installed).

Batches are shaped as verl shapes them: right-padded ``[B, T]`` responses (padding 0), a float 0/1
``response_mask`` with holes for tool output in multi-turn rows, the score on the last response token,
and in TransferQueue jagged nested tensors of per-row response length. Tolerances: float32 results of
the same formula computed in a different order (verl's ``agg_loss`` multiplies by the mask and sums,
copc selects with ``torch.where``; verl's seq-mean adds 1e-8 to the token count): rtol 1e-6, atol 1e-6.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (make test-verl builds .venv-verl)")
pytestmark = pytest.mark.verl

from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.v1 import get_trainer_cls  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

import copc.integrations.verl as plugin  # noqa: E402
import copc.integrations.verl_trainers as verl_trainers  # noqa: E402
from copc.channels import AdvantageChannelConfig  # noqa: E402
from copc.channels.methods import get_method  # noqa: E402
from copc.ops import (  # noqa: E402
    AggSpec,
    ClipSpec,
    CorrectedInputs,
    brace,
    clipped_td,
    copc_policy_loss,
    fold_rewards,
    log_ratio,
    masked_whiten,
    vtrace,
)

RTOL = ATOL = 1e-6
VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
COPC_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ROOT = Path(__file__).resolve().parents[2]


def verl_config(**overrides: object):
    """verl's own default trainer config (its generated yaml) with ``key.sub=value`` overrides."""
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    defaults = {
        "algorithm.adv_estimator": "copc_clipped_td",
        "critic.enable": True,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
    }
    for key, value in {**defaults, **overrides}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def actor_config(**kw: object) -> FSDPActorConfig:
    base: dict[str, object] = {"strategy": "fsdp", "ppo_micro_batch_size_per_gpu": 2, "rollout_n": 1}
    return FSDPActorConfig(**{**base, **kw})


def verl_batch(B: int = 6, T: int = 14, seed: int = 0, drift: float = 0.6) -> dict[str, torch.Tensor]:
    """Random padded tensors as verl's trainer holds them before its advantage step."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if B > 1 and lengths[1] >= 6:  # a multi-turn row: a tool-output span inside the response
        lengths[1] = max(int(lengths[1]), 8)
        mask[1] = torch.arange(T) < lengths[1]
        mask[1, 3:6] = False
    old = -3.0 * torch.rand(B, T, generator=g)
    mu = old + drift * torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    scores = (torch.rand(B, generator=g) > 0.5).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = scores
    zero = lambda x: torch.where(mask, x, torch.zeros(()))  # noqa: E731 - verl pads with 0
    return {
        "response_mask": mask.float(),
        "old_log_probs": zero(old),
        "rollout_log_probs": zero(mu),
        "values": zero(values),
        "token_level_rewards": rewards,
        # every 5th token far from old (u ~ 4.5 > c_dual = 3), so the dual clip binds where A < 0
        "log_prob": zero(old + 0.2 * torch.randn(B, T, generator=g) + 1.5 * (torch.arange(T) % 5 == 0)),
        "advantages": zero(torch.randn(B, T, generator=g)),
    }


def copc_step(channels: plugin.CopcChannels, batch: dict[str, torch.Tensor]) -> plugin.CopcStep:
    return plugin.copc_advantage_step(
        channels,
        token_level_rewards=batch["token_level_rewards"],
        values=batch["values"],
        old_log_probs=batch["old_log_probs"],
        rollout_log_probs=batch["rollout_log_probs"],
        response_mask=batch["response_mask"],
    )


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# --- registration -----------------------------------------------------------------------------------


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env},
        check=False
    )


def test_import_verl_alone_finds_copc_through_verls_own_lookups() -> None:
    code = (
        "import verl\n"
        "from verl.trainer.ppo import core_algos\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "print(core_algos.get_policy_loss_fn('copc').__module__)\n"
        "for n in ('copc', 'copc_colocate_async', 'copc_separate_async'): "
        "print(get_trainer_cls(n).__name__)\n"
        "print(core_algos.get_adv_estimator_fn('copc_clipped_td').__name__)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [
        "copc.integrations.verl_losses",
        "CopcTrainerSync",
        "CopcTrainerColocateAsync",
        "CopcTrainerSeparateAsync",
        "copc_clipped_td_needs_copc_trainer",
    ]


def test_a_plugin_that_fails_to_register_is_loud_although_verl_swallows_the_error() -> None:
    # Take the name 'copc' first, then let verl's own loader (VERL_USE_EXTERNAL_PLUGINS=copc) load copc.
    code = (
        "import os, importlib, logging\n"
        "os.environ['VERL_USE_EXTERNAL_PLUGINS'] = 'none'\n"
        "import verl\n"
        "from verl.trainer.ppo.v1 import PPOTrainer, register_trainer\n"
        "register_trainer('copc')(type('Other', (PPOTrainer,), {}))\n"
        "os.environ['VERL_USE_EXTERNAL_PLUGINS'] = 'copc'\n"
        "importlib.reload(verl)\n"
        "print('verl went on')\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "verl went on" in out.stdout
    assert "ERROR" in out.stderr and "copc's verl plugin failed to register with verl" in out.stderr
    assert "already registered to Other" in out.stderr


def test_registration_is_idempotent_and_never_overwrites_another_loss(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plugin._register()  # a second call (module reload) is a no-op
    assert core_algos.get_policy_loss_fn("copc") is plugin.copc_policy_loss
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "copc", core_algos.get_policy_loss_fn("vanilla"))
    with pytest.raises(ValueError, match="will not overwrite"):
        plugin._register()


# --- policy loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", COPC_AGG_MODES)
@pytest.mark.parametrize("weight_mode", ["masked_is", "binary"])
def test_policy_loss_equals_copc_policy_loss(mode: str, weight_mode: str) -> None:
    batch = verl_batch(seed=1)
    cfg = verl_config(**{"copc.policy.weight_mode": weight_mode, "copc.policy.mask_high": 1.5})
    channels = plugin.channels_from_verl_config(cfg)
    step = copc_step(channels, batch)
    mask = batch["response_mask"].bool()
    actor = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
    logp = batch["log_prob"].clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn("copc")(
        old_log_prob=batch["old_log_probs"], log_prob=logp, advantages=batch["advantages"],
        response_mask=mask, loss_agg_mode=mode, config=actor, rollout_is_weights=step.rollout_is_weights,
    )
    ref_logp = batch["log_prob"].clone().requires_grad_(True)
    ref = copc_policy_loss(
        CorrectedInputs(ref_logp, batch["old_log_probs"], batch["rollout_log_probs"], batch["advantages"],
                        mask),
        mask_low=0.5, mask_high=1.5, weight_mode=weight_mode, clip=ClipSpec(0.2, 0.28, 3.0),
        agg=AggSpec(mode),  # type: ignore[arg-type]
    )
    close(loss, ref.loss)
    loss.backward()
    ref.loss.backward()
    close(logp.grad, ref_logp.grad)
    assert 0.0 < float(ref.stats["policy/mask_frac"]) < 1.0  # the band cuts some tokens, keeps others
    assert float(ref.stats["policy/dual_clip_frac"]) > 0.0  # verl's clip_ratio_c is honoured where it binds
    for name, value in ref.stats.items():
        close(metrics[f"copc/{name}"], value)


@pytest.mark.parametrize("mode", VERL_AGG_MODES)
def test_policy_loss_honours_verls_agg_loss_and_global_batch_info(mode: str) -> None:
    batch = verl_batch(seed=2)
    mask = batch["response_mask"].bool()
    step = copc_step(plugin.channels_from_verl_config(verl_config()), batch)
    actor = actor_config(clip_ratio_high=0.28, loss_agg_mode=mode, loss_scale_factor=32)
    # Two data-parallel ranks; global counts as verl's ppo_loss puts them into config.global_batch_info.
    info = {"dp_size": 2, "batch_num_tokens": int(mask.sum()) * 2 + 3, "global_batch_size": 13,
            "loss_scale_factor": 32}
    actor.global_batch_info.update(info)
    loss, _ = plugin.copc_policy_loss(
        batch["old_log_probs"], batch["log_prob"], batch["advantages"], mask, mode, actor,
        step.rollout_is_weights
    )
    per_token = copc_policy_loss(
        CorrectedInputs(batch["log_prob"], batch["old_log_probs"], batch["rollout_log_probs"],
                        batch["advantages"], mask),
        mask_low=0.5, mask_high=2.0, clip=ClipSpec(0.2, 0.28, 3.0),
    ).per_token
    close(loss, core_algos.agg_loss(per_token, mask, mode, **info))


def test_policy_loss_without_staleness_is_verls_vanilla_ppo() -> None:
    """w == 1 (old == mu): COPC's policy channel is PPO; verl's own vanilla loss must agree."""
    batch = verl_batch(seed=3, drift=0.0)
    mask = batch["response_mask"].bool()
    step = copc_step(plugin.channels_from_verl_config(verl_config()), batch)
    assert torch.equal(step.rollout_is_weights, mask.float())
    actor = actor_config(clip_ratio_high=0.28)
    args = (batch["old_log_probs"], batch["log_prob"], batch["advantages"], mask, "token-mean", actor)
    ours, _ = plugin.copc_policy_loss(*args, step.rollout_is_weights)
    theirs, _ = core_algos.compute_policy_loss_vanilla(*args, None)
    close(ours, theirs)


# --- advantage channel -------------------------------------------------------------------------------


def _expected(estimator: str, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """copc's ops called directly, with each preset's parameters (whitened advantages, raw returns)."""
    mask = batch["response_mask"].bool()
    rewards = fold_rewards(batch["token_level_rewards"], mask)
    log_w = log_ratio(batch["old_log_probs"], batch["rollout_log_probs"], mask)
    values = batch["values"]
    if estimator == "copc_clipped_td":
        out = clipped_td(rewards, values, log_w, mask, gamma=1.0, lam_critic=1.0, lam_actor=1.0, low=0.8,
                         high=1.2)
        adv, ret = out.advantages, out.returns
    elif estimator == "copc_vtrace":
        v = vtrace(rewards, values, log_w, mask, gamma=1.0, lam=1.0, rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0)
        # copc normalises the TD factor and keeps rho^pg outside it (docs/algorithms.md, V-trace).
        return v.pg_rho * masked_whiten(v.pg_td, mask), v.vs
    else:
        b = brace(rewards, values, log_w, mask, gamma=1.0, lam=1.0, rho_bar=1.2, c_bar=1.1, k=100)
        adv, ret = b.advantages, b.returns
    return masked_whiten(adv, mask), ret


@pytest.mark.parametrize("estimator", sorted(plugin.ESTIMATORS))
@pytest.mark.parametrize(("B", "seed"), [(6, 4), (1, 5), (9, 6)])
def test_advantages_equal_copcs_ops(estimator: str, B: int, seed: int) -> None:
    batch = verl_batch(B=B, seed=seed)
    step = copc_step(plugin.channels_from_verl_config(verl_config(**{"algorithm.adv_estimator": estimator})),
                     batch)
    advantages, returns = _expected(estimator, batch)
    close(step.advantages, advantages)
    close(step.returns, returns)
    mask = batch["response_mask"].bool()
    w = torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"])
    close(step.rollout_is_weights, torch.where(mask & (w >= 0.5) & (w <= 2.0), w, torch.zeros(())))


def test_advantages_read_gamma_lambda_and_copc_options_from_verls_config() -> None:
    batch = verl_batch(seed=7)
    cfg = verl_config(**{"algorithm.gamma": 0.9, "algorithm.lam": 0.8, "copc.advantage.ratio_high": 1.5})
    channels = plugin.channels_from_verl_config(cfg)
    assert (channels.advantage.gamma, channels.advantage.lam_critic,
            channels.advantage.lam_actor) == (0.9, 0.8, 0.8)
    step = copc_step(channels, batch)
    mask = batch["response_mask"].bool()
    out = clipped_td(
        fold_rewards(batch["token_level_rewards"], mask), batch["values"],
        log_ratio(batch["old_log_probs"], batch["rollout_log_probs"], mask), mask,
        gamma=0.9, lam_critic=0.8, lam_actor=0.8, low=0.8, high=1.5,
    )
    close(step.advantages, masked_whiten(out.advantages, mask))
    close(step.returns, out.returns)


def test_without_staleness_clipped_td_is_verls_own_gae_on_multi_turn_masks() -> None:
    """w == 1: COPC's advantage channel is GAE; verl's GAE (tool tokens skipped) must agree on the mask."""
    batch = verl_batch(B=7, seed=8, drift=0.0)
    assert (batch["response_mask"][1, 3:6] == 0).all()  # the multi-turn row is there
    cfg = verl_config(**{"algorithm.gamma": 0.95, "algorithm.lam": 0.9})
    step = copc_step(plugin.channels_from_verl_config(cfg), batch)
    adv, ret = core_algos.compute_gae_advantage_return(
        batch["token_level_rewards"], batch["values"], batch["response_mask"], gamma=0.95, lam=0.9
    )
    mask = batch["response_mask"].bool()
    close(step.advantages[mask], adv[mask])
    close(step.returns[mask], ret[mask])


# --- the trainer's advantage step on TransferQueue-shaped data ---------------------------------------


def _nested(padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.nested.as_nested_tensor([padded[i, : int(n)] for i, n in enumerate(lengths)],
                                         layout=torch.jagged)


class FakeTQ:
    """kv_batch_get / kv_batch_put over one in-memory batch of jagged tensors (fields may be absent)."""

    def __init__(self, fields: dict[str, torch.Tensor], n: int) -> None:
        self.fields, self.n, self.written = fields, n, None

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> TensorDict:
        assert len(keys) == self.n
        return TensorDict({k: self.fields[k] for k in select_fields if k in self.fields}, batch_size=self.n)

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: TensorDict) -> str:
        self.written = fields
        return "meta"


def _trainer_run(
    monkeypatch: pytest.MonkeyPatch, batch: dict[str, torch.Tensor], drop: tuple[str, ...] = (),
    **overrides: object
):
    mask = batch["response_mask"]
    lengths = (mask.cumsum(-1) * mask).argmax(-1) + 1  # last response token + 1 (tool holes inside)
    fields = {"rm_scores": batch["token_level_rewards"]} | {
        k: batch[k] for k in ("response_mask", "old_log_probs", "rollout_log_probs", "values")
    }
    fake = FakeTQ({k: _nested(v, lengths) for k, v in fields.items() if k not in drop}, len(lengths))
    monkeypatch.setattr(verl_trainers, "tq", fake)
    cfg = verl_config(**{"trainer.v1.trainer_mode": "copc"}, **overrides)
    trainer = object.__new__(get_trainer_cls("copc"))  # the driver-side object, without Ray or workers
    trainer.config = cfg
    trainer._copc = plugin.check_verl_config(cfg)
    meta = KVBatchMeta(partition_id="train", keys=[f"u{i}_0_0" for i in range(len(lengths))],
                       tags=[{}] * len(lengths))
    metrics: dict[str, float] = {}
    assert trainer._compute_advantage(meta, metrics) == "meta"
    return fake.written.to_padded_tensor(), metrics, trainer._copc


def test_trainer_advantage_step_writes_copcs_advantages_into_verls_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    batch = verl_batch(B=6, seed=9)
    written, metrics, channels = _trainer_run(monkeypatch, batch)
    step = copc_step(channels, batch)
    T = written["advantages"].shape[1]
    for name in ("advantages", "returns", "rollout_is_weights"):
        close(written[name], getattr(step, name)[:, :T])
    for name in ("copc/policy/mask_frac", "copc/adv/raw_std", "copc/ratio/ess_tok", "copc/returns/mean"):
        assert isinstance(metrics[name], float)


@pytest.mark.parametrize(
    ("drop", "option"),
    [(("rollout_log_probs",), "actor_rollout_ref.rollout.calculate_log_probs=True"), (("values",),
                                                                                      "critic.enable=True")],
)
def test_trainer_missing_field_fails_with_one_line_naming_the_verl_option(
    monkeypatch: pytest.MonkeyPatch, drop: tuple[str, ...], option: str
) -> None:
    with pytest.raises(ValueError) as err:
        _trainer_run(monkeypatch, verl_batch(seed=10), drop=drop)
    message = str(err.value)
    assert option in message and "\n" not in message


# --- R1: policy_loss.loss_mode=copc_behaviour ------------------------------------------------------------

ACTOR_CORRECTION = "actor_rollout_ref.actor.policy_loss.rollout_correction"
R1 = {
    "actor_rollout_ref.actor.policy_loss.loss_mode": "copc_behaviour",
    f"{ACTOR_CORRECTION}.rollout_rs": "token_k1",
    f"{ACTOR_CORRECTION}.rollout_rs_threshold": "0.5_2.0",
}


def test_r1_trainer_step_reads_old_for_the_advantages_then_centres_the_actor_on_mu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    batch = verl_batch(B=6, seed=9)
    written, metrics, channels = _trainer_run(monkeypatch, batch, **R1)
    assert channels.behaviour and channels.policy == get_method("copc_behaviour").policy
    T = written["advantages"].shape[1]
    mask = batch["response_mask"][:, :T].bool()
    # the actor's ratio is now exp(cur - mu): verl's bypass-mode loss reads old_log_probs as the sampler's
    # no weight: the loss masks on cur/mu
    assert set(written.keys()) == {"advantages", "returns", "old_log_probs"}
    close(written["old_log_probs"][mask], batch["rollout_log_probs"][:, :T][mask])
    # the advantage channel is R0's, on w = old/mu from the recomputed old, read before it was replaced
    r0 = copc_step(plugin.CopcChannels(get_method("copc").policy, channels.advantage), batch)
    close(written["advantages"], r0.advantages[:, :T])
    close(written["returns"], r0.returns[:, :T])
    on_policy = copc_step(channels, batch | {"old_log_probs": batch["rollout_log_probs"]})
    assert not torch.allclose(written["advantages"], on_policy.advantages[:, :T])  # w was not 1
    w = (batch["old_log_probs"] - batch["rollout_log_probs"]).exp()[batch["response_mask"].bool()]
    assert metrics["copc/policy/mask_frac_step_start"] == pytest.approx(float(((w < 0.5) | (w > 2.0)).float(
        ).mean()))
    assert "copc/policy/weight_mean" not in metrics and "copc/adv/raw_std" in metrics


@pytest.mark.parametrize(
    ("threshold", "band"),
    [("0.5_2.0", (0.5, 2.0)), ("0.8_1.25", (0.8, 1.25)), ("0.5_1.25", (0.8, 2.0)), ("2.0", (0.5, 2.0)),
     (4, (0.25, 4.0))],
)
def test_r1_band_is_verls_token_k1_threshold_inverted(threshold: object, band: tuple[float, float]) -> None:
    """verl's token_k1 keeps ``lower <= mu/cur <= upper``; copc's band is on ``r = cur/mu``."""
    channels = plugin.check_verl_config(verl_config(**(
        R1 | {f"{ACTOR_CORRECTION}.rollout_rs_threshold": threshold})))
    assert (channels.policy.mask_low, channels.policy.mask_high) == pytest.approx(band)


def test_r1_without_a_band_is_3a_with_the_advantage_channel() -> None:
    channels = plugin.check_verl_config(verl_config(**(R1 | {f"{ACTOR_CORRECTION}.rollout_rs": None})))
    assert channels.policy == get_method("async_ppo_advantage").policy
    assert channels.advantage == get_method("async_ppo_advantage").advantage


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({f"{ACTOR_CORRECTION}.rollout_rs_threshold": None}, "rollout_rs_threshold is not set"),
        ({f"{ACTOR_CORRECTION}.rollout_rs_threshold": "2.0_0.5"}, "the band needs lower < upper"),
        ({f"{ACTOR_CORRECTION}.rollout_rs_threshold": "half_2"}, "is not a positive number"),
        ({f"{ACTOR_CORRECTION}.rollout_rs": "seq_mean_k3"}, "rollout_rs=token_k1 (or null for no band)"),
        ({f"{ACTOR_CORRECTION}.loss_type": "reinforce"}, "R1's DIS form has no verl path"),
        ({"copc.policy.mask_high": 3.0}, "copc.policy.mask_high is R0's"),
        ({"copc.channels": "policy", "algorithm.adv_estimator": "grpo"}, "is verl's own bypass mode"),
        ({"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"},
         "use token-mean, seq-mean-token-sum"),
        ({"algorithm.rollout_correction.bypass_mode": True},
         "set algorithm.rollout_correction.bypass_mode=False"),
        ({"actor_rollout_ref.actor.policy_loss.loss_mode": "bypass_mode"},
         "set loss_mode=copc_behaviour for COPC R1"),
        ({f"{ACTOR_CORRECTION}.rollout_rs_threshold": 0.52},
         "Hydra reads digits around an underscore as one number"),
    ],
)
def test_bad_r1_config_fails_at_start_up_with_one_line(overrides: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError) as err:
        plugin.check_verl_config(verl_config(**(R1 | overrides)))
    assert says in str(err.value) and "\n" not in str(err.value)


# --- start-up checks and one-line errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"actor_rollout_ref.rollout.calculate_log_probs": False},
         "set actor_rollout_ref.rollout.calculate_log_probs=True"),
        ({"critic.enable": False}, "set critic.enable=True"),
        ({"algorithm.adv_estimator": "gae"}, "set algorithm.adv_estimator to one of copc_clipped_td"),
        ({"algorithm.rollout_correction.bypass_mode": True},
         "set algorithm.rollout_correction.bypass_mode=False"),
        ({"algorithm.rollout_correction.rollout_is": "token"},
         "set algorithm.rollout_correction.rollout_is=null"),
        ({"copc.policy.clip_low": 0.1},
         "copc.policy.clip_low is verl's actor_rollout_ref.actor.clip_ratio_low"),
        ({"copc.advantage.gamma": 0.9}, "copc.advantage.gamma is verl's algorithm.gamma"),
        ({"copc.policy.mask_source": "current"}, "copc.policy.mask_source is not a copc option in verl"),
        ({"copc.advantage.ratio_lo": 0.9}, "copc.advantage:"),
        ({"copc.policy.mask_low": 3.0}, "policy.mask_low/mask_high need 0 <= low < high"),
        ({"copc.extra": 1}, "unknown copc section"),
    ],
)
def test_bad_verl_config_fails_at_start_up_with_one_line(overrides: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError) as err:
        plugin.check_verl_config(verl_config(**overrides))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_trainer_checks_the_config_before_starting_anything() -> None:
    with pytest.raises(ValueError, match="calculate_log_probs=True"):
        get_trainer_cls("copc_separate_async")(verl_config(
            **{"actor_rollout_ref.rollout.calculate_log_probs": False}))


def test_loss_without_copcs_trainer_fails_with_one_line() -> None:
    batch = verl_batch(seed=11)
    with pytest.raises(ValueError) as err:
        plugin.copc_policy_loss(
            batch["old_log_probs"], batch["log_prob"], batch["advantages"], batch["response_mask"].bool(),
            "token-mean", actor_config(), None,
        )
    assert "set trainer.v1.trainer_mode=copc" in str(err.value) and "\n" not in str(err.value)


def test_copc_estimator_in_a_plain_verl_trainer_says_which_trainer_to_use() -> None:
    with pytest.raises(ValueError,
                       match=r"algorithm.adv_estimator=copc_vtrace .*trainer.v1.trainer_mode=copc"):
        core_algos.get_adv_estimator_fn("copc_vtrace")(token_level_rewards=None, response_mask=None,
                                                       config=None)


def test_presets_are_copcs_own() -> None:
    channels = plugin.channels_from_verl_config(verl_config(**{"algorithm.adv_estimator": "copc_brace"}))
    assert channels.advantage == dataclasses.replace(get_method("brace").advantage, gamma=1.0, lam_critic=1.0,
                                                     lam_actor=1.0)
    assert channels.policy == get_method("copc").policy


# --- the command in docs/verl.md ----------------------------------------------------------------------


def docs_command() -> list[str]:
    """The command in docs/verl.md, as argv words ($HOME expanded)."""
    import shlex

    text = (ROOT / "docs/verl.md").read_text()
    block = text.split("<!-- verl-command")[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " ").replace("$HOME", str(Path.home())))


def test_docs_command_composes_with_verls_hydra_config_and_selects_copc(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented command parses against verl's own config and picks copc everywhere.

    verl's full ``validate_config`` is not run: it loads the model's config from the hub (offline here).
    """
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    words = docs_command()
    assert words[:5] == ["python3", "-m", "verl.trainer.main_ppo", "--config-name", plugin.CONFIG_NAME]
    assert not [w for w in words if w.startswith("+")]  # copc_ppo_trainer has every copc option: no Hydra '+'
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer/config"),
                               version_base=None):
        cfg = compose(config_name=words[4], overrides=words[5:])
    channels = plugin.check_verl_config(cfg)
    assert channels.policy == get_method("copc").policy
    assert channels.advantage == get_method("copc").advantage
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode) is plugin.copc_policy_loss
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    assert get_trainer_cls(cfg.trainer.v1.trainer_mode) is plugin.CopcTrainerColocateAsync
    assert cfg.actor_rollout_ref.model.path.startswith("Qwen/Qwen3")


def test_docs_command_through_verls_own_cli_prints_copcs_config() -> None:
    """verl's ``main_ppo`` (its Hydra app, copc loaded by ``import verl``) composes the documented command;
    ``--cfg job`` prints the config and stops before Ray or any model starts."""
    import yaml

    words = docs_command()
    out = subprocess.run(
        [sys.executable, *words[1:], "--cfg", "job"], capture_output=True, text=True, timeout=300,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # the whole of stdout is the config (logs go to stderr)
    cfg = OmegaConf.create(yaml.safe_load(out.stdout))
    assert plugin.check_verl_config(cfg) == plugin.CopcChannels(get_method("copc").policy,
                                                                get_method("copc").advantage)
    assert cfg.trainer.v1.trainer_mode == "copc_colocate_async"


def r1_command() -> list[str]:
    """The R1 block of docs/verl.md, as argv words (its ``...`` line dropped)."""
    import shlex

    text = (ROOT / "docs/verl.md").read_text()
    block = text.split("<!-- verl-command-r1")[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [w for w in shlex.split(block.replace("\\\n", " "), comments=True) if w != "..."]


def test_docs_r1_command_composes_to_copcs_r1_preset() -> None:
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    words = r1_command()
    assert words[:5] == ["python3", "-m", "verl.trainer.main_ppo", "--config-name", plugin.CONFIG_NAME]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer/config"),
                               version_base=None):
        cfg = compose(config_name=words[4],
                      overrides=[*words[5:], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    channels = plugin.check_verl_config(cfg)
    r1 = get_method("copc_behaviour")
    assert channels == plugin.CopcChannels(r1.policy, r1.advantage) and channels.behaviour
    # what verl's actor worker builds and its loss reads
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == plugin.BEHAVIOUR_LOSS
    assert actor.policy_loss.rollout_correction["rollout_rs"] == "token_k1"
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (
        r1.policy.clip_low, r1.policy.clip_high, r1.policy.dual_clip_c,
    )
    assert get_trainer_cls(cfg.trainer.v1.trainer_mode) is plugin.CopcTrainerColocateAsync


def test_docs_r1_command_through_verls_own_cli() -> None:
    import yaml

    words = r1_command()
    out = subprocess.run(
        [sys.executable, *words[1:], "--cfg", "job"], capture_output=True, text=True, timeout=300,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = OmegaConf.create(yaml.safe_load(out.stdout))
    r1 = get_method("copc_behaviour")
    assert plugin.check_verl_config(cfg) == plugin.CopcChannels(r1.policy, r1.advantage)


@pytest.mark.parametrize("estimator", sorted(plugin.ESTIMATORS))
def test_copc_ppo_trainer_lists_every_copc_option_and_its_nulls_are_the_presets(estimator: str) -> None:
    from hydra import compose, initialize_config_dir

    overrides = [f"algorithm.adv_estimator={estimator}", "critic.enable=True", "algorithm.lam=0.95"]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer/config"),
                               version_base=None):
        ours = compose(config_name=plugin.CONFIG_NAME, overrides=overrides)
        plain = compose(config_name="ppo_trainer", overrides=overrides)
    fields = {f.name for f in dataclasses.fields(AdvantageChannelConfig)} - {"estimator", "gamma",
                                                                             "lam_critic"}
    assert set(ours.copc.advantage) == fields
    assert set(ours.copc.policy) == {"mask_low", "mask_high", "weight_mode"}
    # null: the preset's value, so an option the user sets can be told from a default (R1 refuses R0's band)
    assert OmegaConf.to_container(ours.copc.policy) == {"mask_low": None, "mask_high": None,
                                                        "weight_mode": None}
    assert plugin.check_verl_config(ours).policy == get_method("copc").policy
    assert plugin.check_verl_config(ours) == plugin.check_verl_config(plain)
    assert OmegaConf.masked_copy(ours, [k for k in ours if k != "copc"]) == plain  # verl's config, untouched


def test_a_composed_struct_config_without_a_copc_section_gets_copcs_defaults() -> None:
    from hydra import compose, initialize_config_dir

    overrides = ["algorithm.adv_estimator=copc_vtrace", "critic.enable=True", "algorithm.lam=0.95"]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer/config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    channels = plugin.check_verl_config(cfg)  # Hydra's struct mode: the absent copc section is not an error
    vtrace_preset = get_method("vtrace").advantage
    assert channels.advantage == dataclasses.replace(vtrace_preset, lam_critic=0.95, lam_actor=0.95)
    assert channels.policy == get_method("copc").policy


def test_trainer_logs_its_channels_at_start_up(caplog: pytest.LogCaptureFixture) -> None:
    assert plugin._log.isEnabledFor(20)  # INFO gets through although verl leaves the root logger at WARNING
    # verl's __init__ starts no Ray, no workers
    with caplog.at_level("INFO", logger="copc.integrations.verl"):
        trainer = get_trainer_cls("copc")(verl_config(**{"trainer.v1.trainer_mode": "copc"}))
    assert trainer._copc == plugin.check_verl_config(verl_config())
    assert ("copc trainer copc (verl's sync trainer): "
            "CopcChannels(policy=PolicyChannelConfig(objective='copc'" in caplog.text)
