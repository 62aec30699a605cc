"""Tests for copc.ops.advantages and copc.ops.corrected_advantages: golden rows, slow-loop oracles, reductions
and masking invariances.

Tolerance: the vectorised code runs in float32, the oracles in float64 Python floats. Rows here hold at
most ~40 action tokens of O(1) residuals, so accumulated float32 rounding stays below ~40 * 6e-8 ~ 3e-6
(times the size of the ratio products, <= ~2 with these weights); rtol = atol = 1e-5 keeps a 3x margin
while any formula slip (a missing bridge, a wrong exponent, a weight on the wrong token) is O(0.1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from copc.ops import (
    brace,
    broadcast_to_tokens,
    clipped_td,
    discounted_reverse_cumsum,
    fold_rewards,
    gae,
    group_advantages,
    vtrace,
)
from reference.advantages import (
    brace_row,
    clipped_td_row,
    fold_rewards_row,
    gae_row,
    group_row,
    vtrace_row,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}
NAN, INF = float("nan"), float("inf")

# Golden row: [prompt, a1, a2, tool, a3, pad]. Values at prompt/tool/pad are garbage: the bridge must
# take V(s_{a3}) = 0.75 as the value after a2, not the tool token's 100.
G_MASK = torch.tensor([[False, True, True, False, True, False]])
G_REW = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
G_VAL = torch.tensor([[100.0, 0.5, 0.25, 100.0, 0.75, 100.0]])
# w = (2, 0.5, 1) on a1, a2, a3.
G_LOGW = torch.tensor([[5.0, math.log(2.0), math.log(0.5), 5.0, 0.0, 5.0]])


def _row(x: torch.Tensor) -> list[float]:
    return [float(v) for v in x[0]]


def test_gae_golden_with_tool_span() -> None:
    # gamma = lam = 1: A = R - V = (0.5, 0.75, 0.25), G = R = 1 on every action token.
    out = gae(G_REW, G_VAL, G_MASK, gamma=1.0, lam=1.0)
    assert _row(out.advantages) == pytest.approx([0, 0.5, 0.75, 0, 0.25, 0], abs=1e-7)
    assert _row(out.returns) == pytest.approx([0, 1, 1, 0, 1, 0], abs=1e-7)
    # gamma = 0.9, lam = 0.5: d3 = 1 - 0.75 = 0.25; d2 = 0.9*0.75 - 0.25 = 0.425 (bridged);
    # d1 = 0.9*0.25 - 0.5 = -0.275. A3 = 0.25; A2 = 0.425 + 0.45*0.25 = 0.5375;
    # A1 = -0.275 + 0.45*0.5375 = -0.033125.
    out = gae(G_REW, G_VAL, G_MASK, gamma=0.9, lam=0.5)
    assert _row(out.advantages) == pytest.approx([0, -0.033125, 0.5375, 0, 0.25, 0], abs=1e-6)
    assert _row(out.returns) == pytest.approx([0, 0.466875, 0.7875, 0, 1.0, 0], abs=1e-6)


def test_clipped_td_golden() -> None:
    # rho~ = clip((2, 0.5, 1), 0.8, 1.2) = (1.2, 0.8, 1); gamma = lam = 1: d = (-0.25, 0.5, 0.25).
    # D3 = 0.25; D2 = 0.8*0.5 + 0.25 = 0.65; D1 = 1.2*(-0.25) + 0.65 = 0.35 -> G = V + D = (0.85, 0.9, 1).
    # A_t = d_t + E_{t+1}: (-0.25 + 0.65, 0.5 + 0.25, 0.25) = (0.4, 0.75, 0.25); with own weight A = E.
    kw = {"gamma": 1.0, "lam_critic": 1.0, "lam_actor": 1.0, "low": 0.8, "high": 1.2}
    out = clipped_td(G_REW, G_VAL, G_LOGW, G_MASK, **kw)  # type: ignore[arg-type]
    assert _row(out.returns) == pytest.approx([0, 0.85, 0.9, 0, 1.0, 0], abs=1e-6)
    assert _row(out.advantages) == pytest.approx([0, 0.4, 0.75, 0, 0.25, 0], abs=1e-6)
    own = clipped_td(G_REW, G_VAL, G_LOGW, G_MASK, weight_own_residual=True, **kw)  # type: ignore[arg-type]
    assert _row(own.advantages) == pytest.approx([0, 0.35, 0.65, 0, 0.25, 0], abs=1e-6)


def test_brace_golden_k1() -> None:
    # rho = min(1.2, w) = (1.2, 0.5, 1), c = min(1.1, w) = (1.1, 0.5, 1), d = (-0.25, 0.5, 0.25), k = 1.
    # s=1: j=2: rho1 d1 + c1 (d2 + d3) = -0.3 + 1.1*0.75 = 0.525 -> V_targ1 = 1.025.
    # s=2: j=3: rho2 d2 + c2 d3 = 0.25 + 0.125 = 0.375 -> V_targ2 = 0.625.
    # s=3: j=3: empty window, tail d3 = 0.25 -> V_targ3 = 1.0 (MC anchor: R).
    # A_s = r_s + V_targ(s+1) - V_s = (0.625 - 0.5, 1 - 0.25, 1 - 0.75) = (0.125, 0.75, 0.25).
    out = brace(G_REW, G_VAL, G_LOGW, G_MASK, gamma=1.0, lam=1.0, rho_bar=1.2, c_bar=1.1, k=1)
    assert _row(out.returns) == pytest.approx([0, 1.025, 0.625, 0, 1.0, 0], abs=1e-6)
    assert _row(out.advantages) == pytest.approx([0, 0.125, 0.75, 0, 0.25, 0], abs=1e-6)


def test_vtrace_golden() -> None:
    # rho = c = pg = min(1, w) = (1, 0.5, 1); d = (-0.25, 0.5, 0.25).
    # v3 - V3 = 0.25; v2 - V2 = 0.5*0.5 + 0.5*0.25 = 0.375; v1 - V1 = -0.25 + 1*0.375 = 0.125.
    # vs = (0.625, 0.625, 1.0); pg_s = min(1, w_s)(r_s + v_{s+1} - V_s) = (0.125, 0.5*0.75, 0.25).
    out = vtrace(G_REW, G_VAL, G_LOGW, G_MASK, gamma=1.0, lam=1.0, rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0)
    assert _row(out.vs) == pytest.approx([0, 0.625, 0.625, 0, 1.0, 0], abs=1e-6)
    assert _row(out.pg_advantages) == pytest.approx([0, 0.125, 0.375, 0, 0.25, 0], abs=1e-6)


# ------------------------------------------------------------------------------------------------
# Random ragged batches against the oracles


def ragged_batch(batch: int, length: int, seed: int, stale: float = 0.4) -> dict[str, torch.Tensor]:
    """Prompt prefix, alternating action and tool spans, padding; row 1 (if any) has no action token."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        if b == 1:
            continue
        t = int(torch.randint(0, 4, (1,), generator=gen))
        end = length - int(torch.randint(0, 4, (1,), generator=gen))
        acting = True
        while t < end:
            span = int(torch.randint(1, 6, (1,), generator=gen))
            if acting:
                mask[b, t : min(t + span, end)] = True
            t += span
            acting = not acting
    rewards = torch.where(torch.rand(batch, length, generator=gen) < 0.2, torch.randn(batch, length,
                                                                                      generator=gen), 0.0)
    values = torch.randn(batch, length, generator=gen) * 0.5
    log_rho = torch.randn(batch, length, generator=gen) * stale
    boot = torch.randn(batch, generator=gen)
    return {"rewards": rewards, "values": values, "log_rho": log_rho, "action_mask": mask, "boot": boot}


def _against_rows(
    vec: tuple[torch.Tensor, ...], ref: Callable[[int], tuple[list[float], list[float]]], batch: int
) -> None:
    for b in range(batch):
        want = ref(b)
        for got, exp in zip(vec, want, strict=True):
            torch.testing.assert_close(got[b], torch.tensor(exp, dtype=torch.float32), **TOL)


CASES = [(1, 7, 0), (5, 33, 1), (6, 40, 2)]
GL = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.7)]


@pytest.mark.parametrize(("batch", "length", "seed"), CASES)
@pytest.mark.parametrize(("gamma", "lam"), GL)
@pytest.mark.parametrize("use_boot", [False, True])
def test_gae_matches_reference(batch: int, length: int, seed: int, gamma: float, lam: float,
                               use_boot: bool) -> None:
    d = ragged_batch(batch, length, seed)
    boot = d["boot"] if use_boot else None
    out = gae(d["rewards"], d["values"], d["action_mask"], gamma=gamma, lam=lam, bootstrap_value=boot)

    def ref(b: int) -> tuple[list[float], list[float]]:
        return gae_row(d["rewards"][b].tolist(), d["values"][b].tolist(), d["action_mask"][b].tolist(),
                       gamma, lam, float(d["boot"][b]) if use_boot else 0.0)

    _against_rows(tuple(out), ref, batch)


@pytest.mark.parametrize(("batch", "length", "seed"), CASES)
@pytest.mark.parametrize(("gamma", "lam"), GL)
def test_vtrace_matches_reference(batch: int, length: int, seed: int, gamma: float, lam: float) -> None:
    d = ragged_batch(batch, length, seed)
    kw = {"gamma": gamma, "lam": lam, "rho_bar": 1.2, "c_bar": 1.0, "pg_rho_bar": 1.5}
    out = vtrace(d["rewards"], d["values"], d["log_rho"], d["action_mask"], bootstrap_value=d["boot"], **kw)

    def ref(b: int) -> tuple[list[float], list[float]]:
        return vtrace_row(d["rewards"][b].tolist(), d["values"][b].tolist(), d["log_rho"][b].tolist(),
                          d["action_mask"][b].tolist(), boot=float(d["boot"][b]), **kw)

    _against_rows(tuple(out[:2]), ref, batch)
    # the two factors of A^pg: rho^pg = min(pg_rho_bar, w) and the TD term, both 0 off action tokens
    assert torch.equal(out.pg_advantages, out.pg_rho * out.pg_td)
    w = torch.exp(d["log_rho"].clamp(-20, 20))
    torch.testing.assert_close(out.pg_rho, torch.where(d["action_mask"], w.clamp(max=1.5), 0.0))


@pytest.mark.parametrize(("batch", "length", "seed"), CASES)
@pytest.mark.parametrize(("gamma", "lam"), GL)
@pytest.mark.parametrize("k", [0, 1, 3, 1000])
def test_brace_matches_reference(batch: int, length: int, seed: int, gamma: float, lam: float,
                                 k: int) -> None:
    d = ragged_batch(batch, length, seed)
    kw = {"gamma": gamma, "lam": lam, "rho_bar": 1.2, "c_bar": 1.1, "k": k}
    out = brace(d["rewards"], d["values"], d["log_rho"], d["action_mask"], bootstrap_value=d["boot"], **kw)

    def ref(b: int) -> tuple[list[float], list[float]]:
        return brace_row(d["rewards"][b].tolist(), d["values"][b].tolist(), d["log_rho"][b].tolist(),
                         d["action_mask"][b].tolist(), boot=float(d["boot"][b]), **kw)

    _against_rows(tuple(out), ref, batch)


CTD_VARIANTS = [
    {},
    {"weight_own_residual": True},
    {"lam_actor": 0.9},
    {"advantage_window": 3},
    {"advantage_window": 3, "lam_actor": 0.8, "weight_own_residual": True},
    {"advantage_window": 0},
    {"trace": "vtrace", "trace_low": 0.7, "trace_high": 1.1},
    {"trace": "vtrace", "trace_low": 0.7, "trace_high": 1.1, "lam_actor": 0.9},
    {"trace": "brace", "trace_low": 0.7, "trace_high": 1.1, "advantage_window": 2},
    {"trace": "brace", "trace_low": 0.7, "trace_high": 1.1, "advantage_window": 2, "lam_actor": 0.8},
]


@pytest.mark.parametrize(("batch", "length", "seed"), CASES)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95)])
@pytest.mark.parametrize("variant", CTD_VARIANTS)
def test_clipped_td_matches_reference(
    batch: int, length: int, seed: int, gamma: float, lam: float, variant: dict[str, object]
) -> None:
    d = ragged_batch(batch, length, seed)
    kw: dict[str, object] = {"gamma": gamma, "lam_critic": lam, "lam_actor": lam, "low": 0.8, "high": 1.2,
                             **variant}
    out = clipped_td(d["rewards"], d["values"], d["log_rho"], d["action_mask"], bootstrap_value=d["boot"],
                     **kw)  # type: ignore[arg-type]
    ref_kw = {k: v for k, v in kw.items() if k not in ("advantage_window", "weight_own_residual")}
    ref_kw["window"] = kw.get("advantage_window")
    ref_kw["weight_own"] = kw.get("weight_own_residual", False)

    def ref(b: int) -> tuple[list[float], list[float]]:
        return clipped_td_row(d["rewards"][b].tolist(), d["values"][b].tolist(), d["log_rho"][b].tolist(),
                              d["action_mask"][b].tolist(), boot=float(d["boot"][b]),
                              **ref_kw)  # type: ignore[arg-type]

    _against_rows(tuple(out), ref, batch)


# ------------------------------------------------------------------------------------------------
# Reductions


def _assert_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], **tol: float) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **(tol or TOL))


@pytest.mark.parametrize(("gamma", "lam"), GL)
def test_unit_weights_reduce_clipped_td_to_gae(gamma: float, lam: float) -> None:
    d = ragged_batch(6, 40, 3)
    ref = gae(d["rewards"], d["values"], d["action_mask"], gamma=gamma, lam=lam, bootstrap_value=d["boot"])
    args = (d["rewards"], d["values"])
    zero = torch.zeros_like(d["log_rho"])  # zero staleness: w = exp(0) = 1
    kw = {"gamma": gamma, "lam_critic": lam, "lam_actor": lam, "bootstrap_value": d["boot"]}
    _assert_same(tuple(clipped_td(*args, zero, d["action_mask"], low=0.8, high=1.2, **kw)),
                 tuple(ref))  # type: ignore[arg-type]
    # Zero-width clip: rho~ = 1 whatever w.
    _assert_same(tuple(clipped_td(*args, d["log_rho"], d["action_mask"], low=1.0, high=1.0, **kw)),
                 tuple(ref))  # type: ignore[arg-type]
    _assert_same(
        tuple(clipped_td(*args, d["log_rho"], d["action_mask"], low=1.0, high=1.0, advantage_window=4, **kw)),
        # type: ignore[arg-type]
        tuple(ref),
    )
    traced = clipped_td(*args, zero, d["action_mask"], low=0.8, high=1.2, trace="vtrace", trace_low=0.5,
                        # type: ignore[arg-type]
                        trace_high=1.1, **kw)
    _assert_same(tuple(traced), tuple(ref))


@pytest.mark.parametrize("lam", [1.0, 0.9])
def test_vtrace_with_unit_weights_gives_gae_targets(lam: float) -> None:
    d = ragged_batch(6, 40, 4)
    zero = torch.zeros_like(d["log_rho"])
    vt = vtrace(d["rewards"], d["values"], zero, d["action_mask"], gamma=0.99, lam=lam, rho_bar=1.0,
                c_bar=1.0, pg_rho_bar=1.0)
    ref = gae(d["rewards"], d["values"], d["action_mask"], gamma=0.99, lam=lam)
    torch.testing.assert_close(vt.vs, ref.returns, **TOL)
    if lam == 1.0:  # r + gamma v_{s+1} - V_s = GAE(1) advantage
        torch.testing.assert_close(vt.pg_advantages, ref.advantages, **TOL)


def test_brace_k0_is_monte_carlo_and_large_k_is_vtrace_with_last_rho_one() -> None:
    d = ragged_batch(6, 40, 5)
    mask = d["action_mask"]
    # Terminal reward only: R on each row's last action token.
    last = mask & (mask.long().flip(1).cumsum(1).flip(1) == 1)
    rewards = torch.where(last, torch.randn(6, 1).expand(6, 40), 0.0)
    gamma = 0.97
    mc = brace(rewards, d["values"], d["log_rho"], mask, gamma=gamma, lam=1.0, rho_bar=1.2, c_bar=1.1, k=0)
    steps_to_end = (mask.long().flip(1).cumsum(1).flip(1) - 1).float()  # T - s counted in action tokens
    r_row = rewards.sum(1, keepdim=True)
    expect = torch.where(mask, gamma**steps_to_end * r_row, 0.0)
    torch.testing.assert_close(mc.returns, expect, **TOL)
    # k >= T: V-trace whose last-token rho is 1 (set log w = 0 there; c_T never matters).
    full = brace(rewards, d["values"], d["log_rho"], mask, gamma=gamma, lam=0.9, rho_bar=1.2, c_bar=1.1, k=40)
    log_rho_last1 = torch.where(last, 0.0, d["log_rho"])
    vt = vtrace(rewards, d["values"], log_rho_last1, mask, gamma=gamma, lam=0.9, rho_bar=1.2, c_bar=1.1,
                pg_rho_bar=1.0)
    torch.testing.assert_close(full.returns, vt.vs, **TOL)


def test_copc_degenerate_to_vtrace() -> None:
    # eps_A^- = 1 (low = 0), eps_A^+ = rho_bar - 1 (high = rho_bar), c = min(c_bar = 1, w), lam_c = lam:
    # G == V-trace vs; with lam = 1 also A == pg_advantage / min(pg_rho_bar, w) (rlax, c_bar = 1).
    # With lam < 1 the advantages differ by design (COPC discounts E_{t+1} by lam, V-trace's v_{s+1} not).
    d = ragged_batch(6, 40, 6)
    for lam in (1.0, 0.9):
        vt = vtrace(d["rewards"], d["values"], d["log_rho"], d["action_mask"], gamma=0.99, lam=lam,
                    rho_bar=1.3, c_bar=1.0, pg_rho_bar=1.3)
        ct = clipped_td(d["rewards"], d["values"], d["log_rho"], d["action_mask"], gamma=0.99, lam_critic=lam,
                        lam_actor=lam, low=0.0, high=1.3, trace="vtrace", trace_low=0.0, trace_high=1.0)
        torch.testing.assert_close(ct.returns, vt.vs, **TOL)
        if lam == 1.0:
            pg_w = torch.exp(d["log_rho"]).clamp(max=1.3)
            torch.testing.assert_close(ct.advantages, torch.where(d["action_mask"], vt.pg_advantages / pg_w,
                                                                  0.0), **TOL)


# ------------------------------------------------------------------------------------------------
# Masked positions change nothing


def _all_estimators(r: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, m: torch.Tensor,
                    boot: torch.Tensor) -> list[torch.Tensor]:
    outs: list[torch.Tensor] = []
    outs += gae(r, v, m, gamma=0.99, lam=0.95, bootstrap_value=boot)
    outs += vtrace(r, v, lr, m, gamma=0.99, lam=0.95, rho_bar=1.2, c_bar=1.0, pg_rho_bar=1.0,
                   bootstrap_value=boot)
    outs += brace(r, v, lr, m, gamma=1.0, lam=1.0, rho_bar=1.2, c_bar=1.1, k=3, bootstrap_value=boot)
    outs += clipped_td(r, v, lr, m, gamma=1.0, lam_critic=1.0, lam_actor=0.9, low=0.8, high=1.2,
                       advantage_window=4)
    outs += clipped_td(r, v, lr, m, gamma=1.0, lam_critic=1.0, lam_actor=1.0, low=0.8, high=1.2,
                       trace="vtrace",
                       trace_low=0.5, trace_high=1.1)
    return outs


def test_non_action_inputs_change_nothing_and_gradients_stay_clean() -> None:
    d = ragged_batch(6, 40, 7)
    m = d["action_mask"]
    clean = _all_estimators(d["rewards"], d["values"], d["log_rho"], m, d["boot"])
    noise = torch.randn(6, 40) * 1e3
    noise[:, ::3] = NAN
    noise[:, 1::5] = INF
    noise[:, 2::7] = -INF
    values = torch.where(m, d["values"], noise).requires_grad_(True)
    dirty = _all_estimators(torch.where(m, d["rewards"], noise), values, torch.where(m, d["log_rho"], noise),
                            m,
                            torch.where(m.any(1), d["boot"], NAN))
    for a, b in zip(clean, dirty, strict=True):
        assert torch.equal(a, b.detach())
    sum(o.sum() for o in dirty).backward()  # type: ignore[union-attr]
    assert values.grad is not None and torch.isfinite(values.grad).all()
    assert values.grad[~m].abs().sum().item() == 0.0
    assert values.grad[m].abs().sum().item() > 0.0


def test_all_masked_batch_gives_zeros() -> None:
    z = torch.full((2, 5), NAN)
    m = torch.zeros(2, 5, dtype=torch.bool)
    for out in _all_estimators(z, z, z, m, torch.zeros(2)):
        assert torch.equal(out, torch.zeros(2, 5))


# ------------------------------------------------------------------------------------------------
# Rewards, groups, scans, errors


def test_fold_rewards_golden_and_reaches_return() -> None:
    # [r=1 on prompt, a, a, tool r=2, a, tool r=4 (trajectory ends in an observation)]
    rewards = torch.tensor([[1.0, 0.0, 0.5, 2.0, 0.0, 4.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[False, True, True, False, True, False], [False] * 6])
    folded = fold_rewards(rewards, mask)
    assert folded.tolist() == [[0.0, 1.0, 2.5, 0.0, 4.0, 0.0], [0.0] * 6]
    assert folded[0].tolist() == fold_rewards_row(rewards[0].tolist(), mask[0].tolist())
    # gamma = lam = 1: G_t is the sum of every reward from t on; the final observation reward 4 reaches G.
    out = gae(folded, torch.zeros(2, 6), mask, gamma=1.0, lam=1.0)
    assert out.returns[0].tolist() == [0.0, 7.5, 6.5, 0.0, 4.0, 0.0]


def test_fold_rewards_matches_reference() -> None:
    d = ragged_batch(6, 40, 8)
    rewards = torch.randn(6, 40)
    got = fold_rewards(rewards, d["action_mask"])
    for b in range(6):
        torch.testing.assert_close(got[b], torch.tensor(fold_rewards_row(rewards[b].tolist(),
                                                                         d["action_mask"][b].tolist())))


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_group_advantages_match_reference(mode: str) -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 2.0, 7.0, -1.0])
    groups = torch.tensor([3, 3, 3, 3, 9, 9, 5, 9])  # group 5 is a singleton: advantage 0
    got = group_advantages(scores, groups, mode=mode)  # type: ignore[arg-type]
    torch.testing.assert_close(got, torch.tensor(group_row(scores.tolist(), groups.tolist(), mode)), **TOL)
    # Golden grpo on group 3: mean 0.75, Bessel std 0.5 -> (0.5, -1.5, 0.5, 0.5).
    if mode == "grpo":
        assert got[:4].tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], rel=1e-5)
        assert got[6].item() == 0.0
    if mode == "rloo":  # 1 - (0 + 1 + 1)/3 = 1/3; 0 - 3/3 = -1
        assert got[:2].tolist() == pytest.approx([1 / 3, -1.0], rel=1e-6)


def test_broadcast_to_tokens() -> None:
    mask = torch.tensor([[True, False, True], [False, False, False]])
    assert broadcast_to_tokens(torch.tensor([2.0, NAN]), mask).tolist() == [[2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("discount", [0.95, 0.999, 0.5, 0.0, 1.0])
def test_discounted_reverse_cumsum_exact_at_t4096(discount: float) -> None:
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(9))
    got = discounted_reverse_cumsum(x, discount)
    ref = torch.zeros(2, 4096, dtype=torch.float64)
    carry = torch.zeros(2, dtype=torch.float64)
    xd = x.double()
    for t in range(4095, -1, -1):
        carry = xd[:, t] + discount * carry
        ref[:, t] = carry
    # float32 rounding of sums of up to 4096 O(1) terms: |error| <~ sqrt(T) * 6e-8 * |partial sums| ~ 1e-4
    # for discount 1 (partial sums ~ 60); discounted sums have an effective horizon 1/(1-g) and stay 1e-5.
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * max(scale,
                                                                          1.0) * (10 if discount == 1 else 1))


def test_input_errors_name_the_argument() -> None:
    m = torch.ones(2, 3, dtype=torch.bool)
    x = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="values must be float32"):
        gae(x, x.double(), m, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="log_rho has shape"):
        vtrace(x, x, torch.zeros(2, 4), m, gamma=1.0, lam=1.0, rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0)
    with pytest.raises(TypeError, match="action_mask must be torch"):
        gae(x, x, m.float(), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="bootstrap_value must be"):
        gae(x, x, m, gamma=1.0, lam=1.0, bootstrap_value=torch.zeros(3))
    with pytest.raises(ValueError, match="needs advantage_window"):
        clipped_td(x, x, x, m, gamma=1.0, lam_critic=1.0, lam_actor=1.0, low=0.8, high=1.2, trace="brace",
                   trace_low=0.8, trace_high=1.0)
    with pytest.warns(UserWarning, match="c_t can exceed"):
        clipped_td(x, x, x, m, gamma=1.0, lam_critic=1.0, lam_actor=1.0, low=0.8, high=1.2, trace="vtrace",
                   trace_low=0.5, trace_high=1.5)


@pytest.mark.parametrize("seed", [10, 11])
def test_trace_estimators_match_reference_across_scan_blocks(seed: int) -> None:
    # T = 200 > 3 blocks of the blocked scans (64): carries between blocks must be exact. Zero traces
    # (log w = -20 -> c = lam * min(c_bar, 2e-9) ~ 0) must cut the sum.
    d = ragged_batch(3, 200, seed)
    d["log_rho"][:, ::37] = -20.0
    kw = {"gamma": 0.995, "lam": 0.97, "rho_bar": 1.2, "c_bar": 1.1}
    vt = vtrace(d["rewards"], d["values"], d["log_rho"], d["action_mask"], pg_rho_bar=1.0,
                bootstrap_value=d["boot"], **kw)
    br = brace(d["rewards"], d["values"], d["log_rho"], d["action_mask"], k=500, bootstrap_value=d["boot"],
               **kw)
    ct = clipped_td(d["rewards"], d["values"], d["log_rho"], d["action_mask"], gamma=0.995, lam_critic=0.97,
                    lam_actor=0.9, low=0.8, high=1.2, trace="vtrace", trace_low=0.5, trace_high=1.1)
    for b in range(3):
        row = (d["rewards"][b].tolist(), d["values"][b].tolist(), d["log_rho"][b].tolist(),
               d["action_mask"][b].tolist())
        for got, exp in zip(vt[:2], vtrace_row(*row, pg_rho_bar=1.0, boot=float(d["boot"][b]), **kw),
                            strict=True):
            torch.testing.assert_close(got[b], torch.tensor(exp, dtype=torch.float32), **TOL)
        for got, exp in zip(br, brace_row(*row, k=500, boot=float(d["boot"][b]), **kw), strict=True):
            torch.testing.assert_close(got[b], torch.tensor(exp, dtype=torch.float32), **TOL)
        want = clipped_td_row(*row, gamma=0.995, lam_critic=0.97, lam_actor=0.9, low=0.8, high=1.2,
                              trace="vtrace",
                              trace_low=0.5, trace_high=1.1)
        for got, exp in zip(ct, want, strict=True):
            torch.testing.assert_close(got[b], torch.tensor(exp, dtype=torch.float32), **TOL)


def test_cummax_reports_the_latest_index_among_ties() -> None:
    # _next_action_values reads the latest action token at or before each position as the running
    # arg-max of a bool mask; that relies on torch.cummax breaking ties towards the latest index (its
    # CPU and CUDA kernels compare with >=). If a torch release changes this, the bridge breaks here first.
    mask = torch.tensor([[True, False, True, True, False, False]])
    assert mask.cummax(dim=1).indices.tolist() == [[0, 0, 2, 3, 3, 3]]


def test_default_path_bridges_long_tool_spans_like_the_oracle() -> None:
    # One row, T = 300: turns of 40-90 action tokens split by 20-60 tool tokens (no compaction on the
    # gamma * lam == 1 path: the value after each turn must come from the next turn's first token).
    gen = torch.Generator().manual_seed(3)
    mask = torch.zeros(1, 300, dtype=torch.bool)
    t = 10
    while t < 280:
        span = int(torch.randint(40, 90, (1,), generator=gen))
        mask[0, t : min(t + span, 290)] = True
        t += span + int(torch.randint(20, 60, (1,), generator=gen))
    rewards = torch.where(torch.rand(1, 300, generator=gen) < 0.05, torch.randn(1, 300, generator=gen), 0.0)
    values = torch.randn(1, 300, generator=gen)
    log_rho = torch.randn(1, 300, generator=gen) * 0.3
    row = (rewards[0].tolist(), values[0].tolist(), mask[0].tolist())
    for got, exp in zip(gae(rewards, values, mask, gamma=1.0, lam=1.0), gae_row(*row, gamma=1.0, lam=1.0),
                        strict=True):
        torch.testing.assert_close(got[0], torch.tensor(exp), rtol=1e-5, atol=1e-4)  # sums of ~200 O(1) terms
    kw = {"gamma": 1.0, "lam_critic": 1.0, "lam_actor": 1.0, "low": 0.8, "high": 1.2}
    got_ct = clipped_td(rewards, values, log_rho, mask, **kw)  # type: ignore[arg-type]
    want_ct = clipped_td_row(rewards[0].tolist(), values[0].tolist(), log_rho[0].tolist(), mask[0].tolist(),
                             **kw)  # type: ignore[arg-type]
    for got, exp in zip(got_ct, want_ct, strict=True):
        torch.testing.assert_close(got[0], torch.tensor(exp), rtol=1e-5, atol=1e-4)
