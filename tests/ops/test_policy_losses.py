"""Tests for copc.ops.policy_losses and corrected_policy_losses: golden values, the per-token oracle,
reductions, NaN safety, gradcheck and micro-batch accumulation."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from copc.channels import PolicyChannelConfig, PolicyInputs, policy_loss
from copc.ops import (
    AggSpec,
    ClipSpec,
    CorrectedInputs,
    PolicyLossOutput,
    copc_policy_loss,
    decoupled_ppo_loss,
    dis_loss,
    pg_loss,
    ppo_clip_loss,
    weighted_ppo_loss,
)
from reference import losses as ref

LN = math.log

# float32 inside the ops vs float64 in the oracle: per-token values are O(1-10), so 1e-5 relative
# (~100 float32 ulps) is loose enough for exp/clamp rounding and tight enough to catch any formula slip.
TOL = {"rtol": 1e-5, "atol": 1e-6}

# IcePop (Ring-1T) is COPC's loss with masked IS, the band [0.5, 5] and seq-mean-token-mean.
ICEPOP = {"mask_low": 0.5, "mask_high": 5.0, "weight_mode": "masked_is",
          "agg": AggSpec("seq-mean-token-mean")}


def ragged_batch(b: int, t: int, seed: int, *, stale: float = 0.7) -> dict[str, torch.Tensor]:
    """Random ragged batch: varied lengths, observation holes, an all-masked row when b > 2."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask &= torch.rand(b, t, generator=g) > 0.2  # tool-output holes inside responses
    if b > 2:
        mask[1] = False  # a row with no policy token at all
    mu = -3.0 * torch.rand(b, t, generator=g) - 0.05
    old = mu + stale * torch.randn(b, t, generator=g)
    cur = old + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    return {"logp": cur, "logp_old": old, "logp_behav": mu, "advantages": adv, "action_mask": mask}


# ---------------------------------------------------------------- golden values


def test_ppo_golden_dual_and_asymmetric() -> None:
    # old = 0, so u = exp(cur) = (1.5, 0.5, 4, 1.1); eps = 0.2 both sides.
    #   t0: A=+1,  u=1.5: max(-1.5, -1.2) = -1.2        (upper clip active)
    #   t1: A=-2,  u=0.5: max(1.0, 2*0.8=1.6) = 1.6       (lower clip active)
    #   t2: A=-1,  u=4:   max(4, 1.2) = 4 -> dual c=3: min(4, 3) = 3
    #   t3: A=0.5, u=1.1: max(-0.55, -0.55) = -0.55
    # token-mean: (-1.2 + 1.6 + 3 - 0.55) / 4 = 0.7125; without dual (.. + 4 ..) / 4 = 0.9625.
    logp = torch.tensor([[LN(1.5), LN(0.5), LN(4.0), LN(1.1)]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -2.0, -1.0, 0.5]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = ppo_clip_loss(logp, old, adv, mask, clip=ClipSpec(0.2, 0.2, 3.0))
    torch.testing.assert_close(out.per_token, torch.tensor([[-1.2, 1.6, 3.0, -0.55]]))
    torch.testing.assert_close(out.loss, torch.tensor(0.7125))
    assert out.stats["policy/clip_frac_high"] == 0.25 and out.stats["policy/clip_frac_low"] == 0.25
    assert out.stats["policy/dual_clip_frac"] == 0.25
    plain = ppo_clip_loss(logp, old, adv, mask, clip=ClipSpec(0.2, 0.2))
    torch.testing.assert_close(plain.loss, torch.tensor(0.9625))
    # clip-higher eps_high = 0.28: t0 becomes max(-1.5, -1.28) = -1.28.
    higher = ppo_clip_loss(logp, old, adv, mask, clip=ClipSpec(0.2, 0.28))
    torch.testing.assert_close(higher.per_token[0, 0], torch.tensor(-1.28))


def test_bypass_golden_uses_behaviour_ratio() -> None:
    # mu = log 0.5, cur = 0: r = 2, A = 1 -> max(-2, -1.2) = -1.2 (3a clips on the stale ratio).
    # Bypass PPO is ppo_clip_loss centred on mu.
    out = ppo_clip_loss(torch.zeros(1, 1), torch.full((1, 1), LN(0.5)), torch.ones(1, 1),
                        torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(out.loss, torch.tensor(-1.2))


def test_decoupled_golden_mask_and_clip_cap() -> None:
    # old = 0; mu = (log 1/2, log 1/8) -> w = (2, 8); cur = log 1.1 -> u = 1.1; A = (1, 1).
    #   PPO term: max(-1.1, -1.1) = -1.1 for both tokens.
    #   mask cap 5: (2 * -1.1, 0) = (-2.2, 0); denominator keeps both tokens -> -1.1.
    #   clip cap 5 (= TIS with C=5): (-2.2, 5 * -1.1 = -5.5) -> mean -3.85.
    #   "kept" denominator: -2.2 / 1.
    logp = torch.full((1, 2), LN(1.1))
    old = torch.zeros(1, 2)
    mu = torch.tensor([[LN(0.5), LN(0.125)]])
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    masked = decoupled_ppo_loss(CorrectedInputs(logp, old, mu, adv, mask), cap=5.0)
    torch.testing.assert_close(masked.per_token, torch.tensor([[-2.2, 0.0]]))
    torch.testing.assert_close(masked.loss, torch.tensor(-1.1))
    assert masked.stats["policy/mask_frac"] == 0.5
    clipped = decoupled_ppo_loss(CorrectedInputs(logp, old, mu, adv, mask), cap=5.0, cap_mode="clip")
    torch.testing.assert_close(clipped.loss, torch.tensor(-3.85))
    kept = decoupled_ppo_loss(CorrectedInputs(logp, old, mu, adv, mask), cap=5.0, denominator="kept")
    torch.testing.assert_close(kept.loss, torch.tensor(-2.2))
    # TIS C = 2: (min(2,2) * -1.1, min(8,2) * -1.1) = (-2.2, -2.2).
    tis = decoupled_ppo_loss(CorrectedInputs(logp, old, mu, adv, mask), cap=2.0, cap_mode="clip")
    torch.testing.assert_close(tis.loss, torch.tensor(-2.2))


def test_copc_golden_band_and_modes() -> None:
    # old = 0, cur = 0 (u = 1), A = 1 -> PPO term -1 per token. w = exp(-mu) = (1, 2.5, 0.25, 2).
    # band [0.5, 2] inclusive: keep (T, F, F, T); masked_is omega = (1, 0, 0, 2) -> (-1, 0, 0, -2),
    # token-mean over 4 tokens = -0.75; binary omega = (1, 0, 0, 1) -> -0.5.
    mu = torch.tensor([[0.0, -LN(2.5), -LN(0.25), -LN(2.0)]])
    z = torch.zeros(1, 4)
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = copc_policy_loss(CorrectedInputs(z, z, mu, torch.ones(1, 4), mask), mask_low=0.5, mask_high=2.0)
    torch.testing.assert_close(out.per_token, torch.tensor([[-1.0, 0.0, 0.0, -2.0]]))
    torch.testing.assert_close(out.loss, torch.tensor(-0.75))
    assert out.stats["policy/mask_frac"] == 0.5
    binary = copc_policy_loss(CorrectedInputs(z, z, mu, torch.ones(1, 4), mask), mask_low=0.5, mask_high=2.0,
                              weight_mode="binary")
    torch.testing.assert_close(binary.loss, torch.tensor(-0.5))
    # mask_source="current": cur = log 3 on token 0 -> cur/mu = 3 > 2, masked although old/mu = 1.
    cur = torch.tensor([[LN(3.0), 0.0, 0.0, 0.0]])
    current = copc_policy_loss(CorrectedInputs(cur, z, mu, torch.ones(1, 4), mask), mask_source="current")
    assert current.per_token[0, 0] == 0.0 and current.per_token[0, 3] != 0.0


def test_icepop_golden_seq_mean() -> None:
    # Row 0: w = (1, 6) -> band [0.5, 5] keeps t0 only; u = 1, A = 1: per-token (-1, 0); row mean -0.5.
    # Row 1: one token, w = 0.5 (inclusive edge... use 0.6): omega 0.6 -> -0.6; row mean -0.6.
    # seq-mean-token-mean: (-0.5 - 0.6) / 2 = -0.55.
    mu = torch.tensor([[0.0, -LN(6.0)], [-LN(0.6), 0.0]])
    z = torch.zeros(2, 2)
    mask = torch.tensor([[True, True], [True, False]])
    out = copc_policy_loss(CorrectedInputs(z, z, mu, torch.ones(2, 2), mask),
                           **ICEPOP)  # type: ignore[arg-type]
    torch.testing.assert_close(out.loss, torch.tensor(-0.55))


def test_icepop_current_takes_the_mask_from_cur_and_the_weight_from_old() -> None:
    # issue 10 defect 4. old = mu = 0, so k = old/mu = 1 on both tokens; cur = (ln 3, ln 6), A = 1.
    #   t0: cur/mu = 3 in [0.5, 5]: kept, weight k = 1 (not cur/mu = 3); u = 3: max(-3, -1.28) = -1.28.
    #   t1: cur/mu = 6 outside the band: masked (the step-start ratio k = 1 would keep it).
    # seq-mean-token-mean over the row's 2 tokens: -1.28 / 2 = -0.64 (weighting by cur/mu gave -1.92).
    cur = torch.tensor([[LN(3.0), LN(6.0)]])
    z = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = copc_policy_loss(CorrectedInputs(cur, z, z, torch.ones(1, 2), mask), mask_source="current",
                           **ICEPOP)  # type: ignore[arg-type]
    torch.testing.assert_close(out.per_token, torch.tensor([[-1.28, 0.0]]))
    torch.testing.assert_close(out.loss, torch.tensor(-0.64))
    assert out.keep.tolist() == [[True, False]]
    # the policy channel's icepop objective (its preset's band and aggregation) is this loss
    cfg = PolicyChannelConfig(objective="icepop", mask_high=5.0, mask_source="current",
                              loss_agg="seq-mean-token-mean")
    channel = policy_loss(cfg, PolicyInputs(logp=cur, logp_old=z, logp_behav=z, advantages=torch.ones(1, 2),
                                            action_mask=mask, num_tokens=None))
    assert torch.equal(out.per_token, channel.per_token) and torch.equal(out.loss, channel.loss)


def test_dis_golden_strict_band_and_gradient() -> None:
    # r = exp(cur - mu) = (1, 7, 0.5, 2), band (0.7, 6): keep (T, F, F, T).
    # A = (1, 1, -1, -1): l = (-1, 0, 0, 2) -> token-mean over 4 = 0.25.
    # d l_t / d cur_t = -M r A: (-1, 0, 0, 2) / 4 after the mean.
    logp = torch.tensor([[0.0, LN(7.0), LN(0.5), LN(2.0)]], requires_grad=True)
    out = dis_loss(logp, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -1.0, -1.0]]),
                   torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(out.loss, torch.tensor(0.25))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 0.0, 0.0, 0.5]]))


def test_dis_band_edges_are_strict_but_copc_edges_inclusive() -> None:
    # cur == mu gives r = exp(0) = 1 exactly: on the edge of a band starting at 1.
    # SAO's f(r) uses strict inequalities -> masked (loss 0); COPC's M_t is inclusive -> kept (-A).
    z = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    sao = dis_loss(z, z, torch.ones(1, 2), mask, mask_low=1.0, mask_high=6.0)
    assert sao.loss == 0 and sao.stats["policy/mask_frac"] == 1
    copc = copc_policy_loss(CorrectedInputs(z, z, z, torch.ones(1, 2), mask), mask_low=1.0, mask_high=6.0)
    assert copc.loss == -1 and copc.stats["policy/mask_frac"] == 0


def test_pg_golden() -> None:
    # l = -A cur: (-(2)(-1), -(-1)(-0.5)) = (2, -0.5); mean 0.75; gradient -A / 2 = (-1, 0.5).
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    out = pg_loss(logp, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(out.loss, torch.tensor(0.75))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.5]]))


# ---------------------------------------------------------------- oracle on ragged batches

LossCase = tuple[Callable[..., PolicyLossOutput], Callable[..., tuple[float, list[list[float]]]]]


def _cases() -> dict[str, LossCase]:
    def ora_ppo(d: dict, mode: str, den: str) -> tuple[float, list[list[float]]]:
        return ref.weighted_ppo(d["logp"], d["logp_old"], d["advantages"], d["action_mask"], clip_low=0.2,
                                clip_high=0.28, dual=3.0, mode=mode)

    def ora_bypass(d: dict, mode: str, den: str) -> tuple[float, list[list[float]]]:
        return ref.weighted_ppo(d["logp"], d["logp_behav"], d["advantages"], d["action_mask"], clip_low=0.2,
                                clip_high=0.28, dual=3.0, mode=mode)

    def ora_rule(rule: ref.WeightRule) -> Callable[..., tuple[float, list[list[float]]]]:
        def run(d: dict, mode: str, den: str) -> tuple[float, list[list[float]]]:
            return ref.weighted_ppo(
                d["logp"], d["logp_old"], d["advantages"], d["action_mask"], rule=rule,
                logp_behav=d["logp_behav"],
                clip_low=0.2, clip_high=0.28, mode=mode, denominator=den,
            )
        return run

    def ora_dis(d: dict, mode: str, den: str) -> tuple[float, list[list[float]]]:
        return ref.dis(d["logp"], d["logp_behav"], d["advantages"], d["action_mask"], low=0.7, high=6.0,
                       mode=mode, denominator=den)

    def ora_pg(d: dict, mode: str, den: str) -> tuple[float, list[list[float]]]:
        return ref.pg(d["logp"], d["advantages"], d["action_mask"], mode=mode)

    clip = ClipSpec(0.2, 0.28)
    dual = ClipSpec(0.2, 0.28, 3.0)

    def agg(mode: str, kw: dict) -> AggSpec:
        return AggSpec(mode, **kw)  # type: ignore[arg-type]

    return {
        "ppo": (lambda d, mode, den, **kw: ppo_clip_loss(
            d["logp"], d["logp_old"], d["advantages"], d["action_mask"], clip=dual, agg=agg(mode, kw)),
            ora_ppo),
        "bypass": (lambda d, mode, den, **kw: ppo_clip_loss(
            d["logp"], d["logp_behav"], d["advantages"], d["action_mask"], clip=dual, agg=agg(mode, kw)),
            ora_bypass),
        "decoupled_mask": (lambda d, mode, den, **kw: decoupled_ppo_loss(CorrectedInputs(
            **d), cap=2.0, agg=agg(mode, kw), denominator=den, clip=clip),
            ora_rule(ref.rule_decoupled(2.0, "mask"))),
        "tis": (lambda d, mode, den, **kw: decoupled_ppo_loss(CorrectedInputs(
            **d), cap=2.0, cap_mode="clip", agg=agg(mode, kw), clip=clip),
            ora_rule(ref.rule_decoupled(2.0, "clip"))),
        "copc": (lambda d, mode, den, **kw: copc_policy_loss(CorrectedInputs(**d), agg=agg(
            mode, kw), denominator=den, clip=clip),
            ora_rule(ref.rule_band(0.5, 2.0, binary=False, select_current=False, weight_current=False))),
        "copc_binary": (lambda d, mode, den, **kw: copc_policy_loss(CorrectedInputs(
            **d), weight_mode="binary", agg=agg(mode, kw), denominator=den, clip=clip),
            ora_rule(ref.rule_band(0.5, 2.0, binary=True, select_current=False, weight_current=False))),
        "copc_current": (lambda d, mode, den, **kw: copc_policy_loss(CorrectedInputs(
            **d), mask_source="current", agg=agg(mode, kw), denominator=den, clip=clip),
            ora_rule(ref.rule_band(0.5, 2.0, binary=False, select_current=True, weight_current=False))),
        "icepop_current": (lambda d, mode, den, **kw: copc_policy_loss(CorrectedInputs(
            **d), mask_high=5.0, mask_source="current", agg=agg(mode, kw), denominator=den, clip=clip),
            ora_rule(ref.rule_band(0.5, 5.0, binary=False, select_current=True, weight_current=False))),
        "dis": (lambda d, mode, den, **kw: dis_loss(
            d["logp"], d["logp_behav"], d["advantages"], d["action_mask"], agg=agg(mode, kw),
            denominator=den), ora_dis),
        "pg": (lambda d, mode, den, **kw: pg_loss(d["logp"], d["advantages"], d["action_mask"],
                                                  agg=agg(mode, kw)), ora_pg),
    }


CASES = _cases()
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("b", [1, 6])
def test_matches_per_token_oracle(name: str, b: int) -> None:
    fn, oracle = CASES[name]
    for seed in range(3):
        d = ragged_batch(b, 9, seed + 10 * b)
        for mode in MODES:
            for den in ("all", "kept"):
                out = fn(d, mode, den)
                want_loss, want_tok = oracle(d, mode, den)
                torch.testing.assert_close(out.per_token, torch.tensor(want_tok, dtype=torch.float32), **TOL)
                torch.testing.assert_close(out.loss, torch.tensor(want_loss, dtype=torch.float32), **TOL)
                assert out.loss.dtype == torch.float32
                assert all(not v.requires_grad for v in out.stats.values())


# ---------------------------------------------------------------- reductions


def test_copc_with_unit_weights_is_ppo() -> None:
    # w = 1 (old == mu, zero staleness): M = 1, omega = 1 -> COPC's actor loss == PPO's, same dual clip.
    d = ragged_batch(6, 9, 3)
    for dual in (None, 3.0):
        ppo = ppo_clip_loss(d["logp"], d["logp_old"], d["advantages"], d["action_mask"],
                            clip=ClipSpec(0.2, 0.28, dual))
        copc = copc_policy_loss(CorrectedInputs(**d)._replace(logp_behav=d["logp_old"]),
                                clip=ClipSpec(0.2, 0.28, dual))
        assert torch.equal(copc.per_token, ppo.per_token) and torch.equal(copc.loss, ppo.loss)
        assert copc.stats["policy/mask_frac"] == 0 and copc.stats["policy/weight_mean"] == 1


def test_infinite_band_removes_masking() -> None:
    # band [0, inf]: COPC (masked_is) == AReaL decoupled without cap; binary == 3b PPO.
    d = ragged_batch(6, 9, 4, stale=3.0)
    copc = copc_policy_loss(CorrectedInputs(**d), mask_low=0.0, mask_high=math.inf)
    areal = decoupled_ppo_loss(CorrectedInputs(**d), cap=math.inf, clip=ClipSpec(0.2, 0.28))
    torch.testing.assert_close(copc.loss, areal.loss, rtol=0, atol=0)
    assert copc.stats["policy/mask_frac"] == 0
    binary = copc_policy_loss(CorrectedInputs(**d), mask_low=0.0, mask_high=math.inf, weight_mode="binary")
    ppo = ppo_clip_loss(d["logp"], d["logp_old"], d["advantages"], d["action_mask"], clip=ClipSpec(0.2, 0.28))
    torch.testing.assert_close(binary.loss, ppo.loss, rtol=0, atol=0)


def test_zero_staleness_makes_every_weight_one() -> None:
    d = ragged_batch(6, 9, 5)
    x = CorrectedInputs(**d)._replace(logp_behav=d["logp_old"])
    for out in (
        decoupled_ppo_loss(x),
        decoupled_ppo_loss(x, cap=2.0, cap_mode="clip"),  # TIS
        copc_policy_loss(x, **ICEPOP),  # type: ignore[arg-type]
        copc_policy_loss(x),
    ):
        assert out.stats["policy/weight_mean"] == 1 and out.stats["policy/mask_frac"] == 0


def test_kept_denominator_rescales_by_kept_fraction() -> None:
    # loss_all = loss_kept * N_kept / N_valid (docs/formulas.md#masks).
    d = ragged_batch(6, 9, 6, stale=1.5)
    all_ = copc_policy_loss(CorrectedInputs(**d))
    kept = copc_policy_loss(CorrectedInputs(**d), denominator="kept")
    frac_kept = 1 - all_.stats["policy/mask_frac"]
    torch.testing.assert_close(all_.loss, kept.loss * frac_kept, **TOL)


# ---------------------------------------------------------------- NaN safety and gradients


def _poison(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NaN and +-inf at every masked position of every float input."""
    out = dict(d)
    bad = torch.tensor([math.nan, math.inf,
                        -math.inf]).repeat(d["action_mask"].numel())[: d["action_mask"].numel()]
    bad = bad.view_as(d["logp"])
    for key in ("logp", "logp_old", "logp_behav", "advantages"):
        out[key] = torch.where(d["action_mask"], d[key], bad)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_nan_at_masked_positions_never_leaks(name: str) -> None:
    fn, _ = CASES[name]
    d = ragged_batch(6, 9, 7)
    clean = {k: v.clone() for k, v in d.items()}
    dirty = _poison(d)
    for src in (clean, dirty):
        src["logp"] = src["logp"].clone().requires_grad_(True)
    for mode in ("token-mean", "seq-mean-token-mean"):
        a, b = fn(clean, mode, "all"), fn(dirty, mode, "all")
        assert torch.isfinite(b.loss) and torch.equal(a.loss, b.loss)
        assert torch.equal(a.per_token, b.per_token)
        ga = torch.autograd.grad(a.loss, clean["logp"])[0]
        gb = torch.autograd.grad(b.loss, dirty["logp"])[0]
        assert torch.isfinite(gb).all() and torch.equal(ga, gb)
        assert all(torch.isfinite(v).all() for v in b.stats.values())


@pytest.mark.parametrize("name", sorted(set(CASES) - {"icepop_current"}))
def test_gradcheck_wrt_logp(name: str) -> None:
    # Ratios are computed in at least float32, and float64 inputs stay float64, so gradcheck runs in
    # double with its default eps = 1e-6 and tolerances; data are kept away from clip kinks
    # (|logp - logp_old| ~ 0.05, far from log(1 +- 0.2)).
    fn, _ = CASES[name]
    d = ragged_batch(2, 5, 8, stale=0.2)
    d = {k: (v.double() if v.is_floating_point() else v) for k, v in d.items()}
    d["logp"] = d["logp_old"] + 0.05 * torch.randn(d["logp"].shape, generator=torch.Generator().manual_seed(
        1), dtype=torch.float64)

    def f(logp: torch.Tensor) -> torch.Tensor:
        return fn({**d, "logp": logp}, "token-mean", "all").loss

    x = d["logp"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x,))


def test_icepop_current_mask_is_a_constant_in_the_gradient() -> None:
    # With ratio_source="current" the mask M(cur/mu) is detached and moves with cur, so the loss is
    # piecewise and gradcheck does not apply at the band edges: check instead that the gradient
    # equals that of the same loss with the mask frozen and the weight k = old/mu fixed.
    d = ragged_batch(4, 7, 11)
    x = d["logp"].clone().requires_grad_(True)
    out = copc_policy_loss(CorrectedInputs(**d)._replace(logp=x), mask_source="current",
                           **ICEPOP)  # type: ignore[arg-type]
    (g,) = torch.autograd.grad(out.loss, x)
    s = torch.exp(d["logp"] - d["logp_behav"])
    keep = d["action_mask"] & (s >= 0.5) & (s <= 5.0)
    k = torch.exp(d["logp_old"] - d["logp_behav"])
    y = d["logp"].clone().requires_grad_(True)

    frozen = weighted_ppo_loss(y, d["logp_old"], d["advantages"], d["action_mask"], weight=k, keep=keep,
                               clip=ClipSpec(0.2, 0.28), agg=AggSpec("seq-mean-token-mean"))
    (g_frozen,) = torch.autograd.grad(frozen.loss, y)
    torch.testing.assert_close(g, g_frozen, **TOL)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_sum_to_full_batch(name: str, mode: str) -> None:
    # Gradient accumulation: micro-batches given the GLOBAL token / sequence counts sum to the
    # full-minibatch loss and gradient (float32 sums in another order: 1e-6 relative).
    fn, _ = CASES[name]
    d = ragged_batch(6, 9, 9)
    n_tok = d["action_mask"].sum()
    n_seq = d["action_mask"].any(-1).sum()
    x = d["logp"].clone().requires_grad_(True)
    full = _with_counts(fn, {**d, "logp": x}, mode, n_tok, n_seq)
    g_full = torch.autograd.grad(full, x)[0]
    total = torch.zeros(())
    grads = []
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        xm = d["logp"][rows].clone().requires_grad_(True)
        part = _with_counts(fn, {**{k: v[rows] for k, v in d.items()}, "logp": xm}, mode, n_tok, n_seq)
        total = total + part.detach()
        grads.append(torch.autograd.grad(part, xm)[0])
    torch.testing.assert_close(total, full.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat(grads), g_full, rtol=1e-6, atol=1e-8)


def _with_counts(fn: Callable[..., PolicyLossOutput], d: dict, mode: str, n_tok: torch.Tensor,
                 n_seq: torch.Tensor) -> torch.Tensor:
    return fn(d, mode, "all", num_tokens=n_tok, num_seqs=n_seq).loss


# ---------------------------------------------------------------- input errors


def test_errors_name_the_argument() -> None:
    d = ragged_batch(2, 4, 0)
    with pytest.raises(ValueError, match="logp_old"):
        ppo_clip_loss(d["logp"], d["logp_old"][:, :3], d["advantages"], d["action_mask"])
    with pytest.raises(TypeError, match="action_mask"):
        ppo_clip_loss(d["logp"], d["logp_old"], d["advantages"], d["action_mask"].float())
    with pytest.raises(ValueError, match="dual_c"):
        ppo_clip_loss(d["logp"], d["logp_old"], d["advantages"], d["action_mask"], clip=ClipSpec(dual_c=0.5))
    with pytest.raises(ValueError, match=r"clip\.low"):
        ppo_clip_loss(d["logp"], d["logp_old"], d["advantages"], d["action_mask"], clip=ClipSpec(low=1.0))
    with pytest.raises(ValueError, match="cap_mode"):
        decoupled_ppo_loss(CorrectedInputs(**d), cap_mode="bogus")  # type: ignore[arg-type]
