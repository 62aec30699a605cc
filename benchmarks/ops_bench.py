"""Benchmark of the advantage channel (copc.ops.advantages, copc.ops.corrected_advantages) on one CPU thread.

B = 64 sequences, T = 4096 tokens, float32, realistic multi-turn action masks (prompt prefix, several
turns of sampled tokens separated by tool-output spans, right padding). Prints medians over repeats of:

* each estimator's time;
* its speed-up over a loop over T with batch-vectorised steps (the verl-style reference loop, written
  here; its output is checked against the vectorised one before timing);
* its time relative to one ``torch.cumsum`` over a [64, 4096] float32 tensor;
* COPC's whole per-step math (behaviour ratio, clipped-TD advantages and returns, whitening, masked
  clipped surrogate forward + backward) relative to async PPO 3a's (GAE, whitening, PPO clip against
  the behaviour log-probs, forward + backward).

Run: ``.venv/bin/python benchmarks/ops_bench.py [--repeats N] [--runs R] [--warm-allocator]``. Ratios
are measured in one run, on the same inputs. Times are process CPU time (``time.process_time``), not
wall-clock, so that load from other processes on a shared machine does not inflate them (it still
slows them through shared caches); absolute numbers depend on the machine. Every figure is the median
over ``repeats`` calls, measured ``runs`` times; ``[lo-hi]`` is the range of those medians across runs
(the run-to-run spread), ``pf`` the minor page faults per call.

Allocator: a fresh process holding only small tensors keeps glibc's dynamic mmap/trim thresholds low,
so every call that grows the heap by a few MiB of [64, 4096] temporaries gives them back to the OS on
return and page-faults them in again next time (~3 us per 4 KiB page here: ~1 ms per MiB), which a
single cumsum in a loop never pays. A trainer process has freed large activation tensors, which raises
those thresholds (up to 32 MiB) and stops the churn. ``--warm-allocator`` reproduces that by freeing
one 16 MiB tensor first; both settings are worth reporting.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch

from copc.ops import (
    CorrectedInputs,
    brace,
    broadcast_to_tokens,
    clipped_td,
    copc_policy_loss,
    gae,
    group_advantages,
    importance_diagnostics,
    log_ratio,
    masked_whiten,
    ppo_clip_loss,
    vtrace,
)

B, T = 64, 4096


def realistic_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Prompt of 128-512 tokens, 1-4 turns of 200-900 sampled tokens split by 50-400 tool tokens."""
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        t = draw(128, 512)
        for turn in range(draw(1, 4)):
            if turn:
                t += draw(50, 400)  # tool output
            span = draw(200, 900)
            mask[b, t : min(t + span, T)] = True
            t += span
            if t >= T:
                break
    logp_behav = -torch.rand(B, T, generator=gen) * 2
    logp_old = logp_behav + torch.randn(B, T, generator=gen) * 0.3  # stale: |log w| ~ 0.3
    last = mask & (mask.long().flip(1).cumsum(1).flip(1) == 1)
    rewards = torch.where(last, (torch.rand(B, 1, generator=gen) > 0.5).float().expand(B, T), 0.0)
    return {
        "mask": mask,
        "rewards": rewards,
        "values": torch.rand(B, T, generator=gen),
        "logp_behav": logp_behav,
        "logp_old": logp_old,
        "logp": (logp_old + torch.randn(B, T, generator=gen) * 0.05),
        "scores": rewards.sum(1),
        "groups": torch.arange(B) // 8,
    }


# ------------------------------------------------------------------------------------------------
# Loop baselines: one batch-vectorised step per token position (verl compute_gae_advantage_return
# style: carry the next value and the running sum across non-action positions).


def loop_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
             lam: float) -> torch.Tensor:
    next_value = torch.zeros(B)
    running = torch.zeros(B)
    cols = []
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new_running = delta + gamma * lam * running
        running = torch.where(m, new_running, running)
        next_value = torch.where(m, values[:, t], next_value)
        cols.append(torch.where(m, running, 0.0))
    return torch.stack(cols[::-1], dim=1)


def loop_clipped_td(
    rewards: torch.Tensor, values: torch.Tensor, rho: torch.Tensor, mask: torch.Tensor, gamma: float,
    lam: float
) -> torch.Tensor:
    """Advantages A_t = delta_t + gamma lam E_{t+1}, E_t = rho~_t delta_t + gamma lam E_{t+1} (trace none)."""
    next_value = torch.zeros(B)
    running = torch.zeros(B)
    cols = []
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * running
        running = torch.where(m, rho[:, t] * delta + gamma * lam * running, running)
        next_value = torch.where(m, values[:, t], next_value)
        cols.append(torch.where(m, adv, 0.0))
    return torch.stack(cols[::-1], dim=1)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


class Spread:
    """Medians of one measurement over several runs: their median and range, and page faults per call."""

    def __init__(self) -> None:
        self.medians: list[float] = []
        self.faults: list[float] = []

    def measure(self, fn: Callable[[], object], repeats: int) -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.medians.append(median_time(fn, repeats))
        self.faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (repeats + 1))

    @property
    def mid(self) -> float:
        return statistics.median(self.medians)

    def cell(self) -> str:
        lo, hi = min(self.medians) * 1e3, max(self.medians) * 1e3
        return f"{self.mid * 1e3:>9.3f} [{lo:.2f}-{hi:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed repeats per vectorised measurement")
    parser.add_argument("--runs", type=int, default=3, help="times every measurement is repeated (spread)")
    parser.add_argument("--loop-repeats", type=int, default=3, help="timed repeats per loop baseline")
    parser.add_argument("--warm-allocator", action="store_true",
                        help="free a 16 MiB tensor first (see docstring)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.warm_allocator:
        # freed at once: raises glibc's mmap/trim thresholds
        torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
    d = realistic_batch()
    mask, rew, val = d["mask"], d["rewards"], d["values"]
    log_w = log_ratio(d["logp_old"], d["logp_behav"], mask)
    rho = torch.exp(log_w).clamp(0.8, 1.2)
    n_act = int(mask.sum())
    print(f"B={B} T={T} float32, 1 thread; action tokens {n_act} ({n_act / (B * T):.0%}); median of "
          f"{args.repeats} calls, {args.runs} runs [range of run medians]; loops: median of "
          f"{args.loop_repeats}; allocator {'warm' if args.warm_allocator else 'cold'}")

    # Loop baselines must agree with the vectorised estimators before their times mean anything.
    ref_gae = gae(rew, val, mask, gamma=1.0, lam=1.0).advantages
    torch.testing.assert_close(loop_gae(rew, val, mask, 1.0, 1.0), ref_gae, rtol=1e-4, atol=1e-4)
    ctd_kw = {"gamma": 1.0, "lam_critic": 1.0, "lam_actor": 1.0, "low": 0.8, "high": 1.2}
    ref_ctd = clipped_td(rew, val, log_w, mask, **ctd_kw).advantages  # type: ignore[arg-type]
    torch.testing.assert_close(loop_clipped_td(rew, val, rho, mask, 1.0, 1.0), ref_ctd, rtol=1e-4, atol=1e-4)

    x = torch.randn(B, T)
    t_loop_gae = median_time(lambda: loop_gae(rew, val, mask, 1.0, 1.0), args.loop_repeats)
    t_loop_ctd = median_time(lambda: loop_clipped_td(rew, val, rho, mask, 1.0, 1.0), args.loop_repeats)
    t_loop_gae95 = median_time(lambda: loop_gae(rew, val, mask, 1.0, 0.95), args.loop_repeats)

    rows: list[tuple[str, Callable[[], object], float | None]] = [
        ("torch.cumsum [64,4096]", lambda: torch.cumsum(x, dim=1), None),
        ("gae (gamma=lam=1)", lambda: gae(rew, val, mask, gamma=1.0, lam=1.0), t_loop_gae),
        ("gae (gamma=1, lam=0.95)", lambda: gae(rew, val, mask, gamma=1.0, lam=0.95), t_loop_gae95),
        ("clipped_td default", lambda: clipped_td(rew, val, log_w, mask, **ctd_kw), t_loop_ctd),
        # type: ignore[arg-type]
        ("clipped_td k_A=100", lambda: clipped_td(rew, val, log_w, mask, advantage_window=100, **ctd_kw),
         None),  # type: ignore[arg-type]
        ("vtrace", lambda: vtrace(rew, val, log_w, mask, gamma=1.0, lam=1.0, rho_bar=1.0, c_bar=1.0,
                                  pg_rho_bar=1.0), None),
        ("brace k=100", lambda: brace(rew, val, log_w, mask, gamma=1.0, lam=1.0, rho_bar=1.2, c_bar=1.1,
                                      k=100), None),
        ("group (grpo + broadcast)",
         lambda: broadcast_to_tokens(group_advantages(d["scores"], d["groups"], mode="grpo"), mask), None),
    ]
    spreads = {name: Spread() for name, _, _ in rows}
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for _ in range(args.runs):  # every run measures every row, so the x-cumsum ratios come from one run
        for name, fn, _ in rows:
            slow = "brace" in name or "vtrace" in name
            spreads[name].measure(fn, 5 if slow else args.repeats * (5 if "cumsum" in name else 1))
            ratios[name].append(spreads[name].medians[-1] / spreads[rows[0][0]].medians[-1])
    print(f"\n{'estimator':<26}{'median ms [lo-hi]':>24}{'pf':>7}{'loop ms':>9}{'speed-up':>9}"
          f"{'x cumsum [lo-hi]':>22}")
    for name, _, loop_t in rows:
        sp, r = spreads[name], ratios[name]
        loop_s = f"{loop_t * 1e3:>9.1f}{loop_t / sp.mid:>8.1f}x" if loop_t else f"{'-':>9}{'-':>9}"
        x_cum = f"{statistics.median(r):>8.2f} [{min(r):.2f}-{max(r):.2f}]"
        print(f"{name:<26}{sp.cell():>24}{statistics.median(sp.faults):>7.0f}{loop_s}{x_cum:>22}")
    full_step(d, args.repeats, args.runs)


def full_step(d: dict[str, torch.Tensor], repeats: int, runs: int) -> None:
    """COPC vs async PPO 3a: advantages + whitening + actor loss forward and backward."""
    mask, rew, val = d["mask"], d["rewards"], d["values"]
    logp = d["logp"].clone().requires_grad_(True)

    def async_ppo() -> None:
        adv = masked_whiten(gae(rew, val, mask, gamma=1.0, lam=1.0).advantages, mask)
        out = ppo_clip_loss(logp, d["logp_behav"], adv, mask)  # 3a: ratio against mu
        out.loss.backward()
        logp.grad = None

    def copc(diagnostics: bool) -> Callable[[], None]:
        def step() -> None:
            log_w = log_ratio(d["logp_old"], d["logp_behav"], mask)
            ctd = clipped_td(rew, val, log_w, mask, gamma=1.0, lam_critic=1.0, lam_actor=1.0, low=0.8,
                             high=1.2)
            adv = masked_whiten(ctd.advantages, mask)
            out = copc_policy_loss(CorrectedInputs(logp, d["logp_old"], d["logp_behav"], adv, mask))
            out.loss.backward()
            logp.grad = None
            if diagnostics:
                importance_diagnostics(log_w, mask, clip_low=0.8, clip_high=1.2, keep_mask=out.keep)
        return step

    # Interleave the measurements so that load from other processes hits both sides alike.
    fns = (async_ppo, copc(False), copc(True))
    for fn in fns:
        fn()
    runs_ms: list[tuple[float, float, float]] = []
    for _ in range(runs):
        times: tuple[list[float], list[float], list[float]] = ([], [], [])
        for _ in range(repeats):
            for fn, acc in zip(fns, times, strict=True):
                start = time.process_time()
                fn()
                acc.append(time.process_time() - start)
        p, c, g = (statistics.median(x) for x in times)
        runs_ms.append((p, c, g))
    print(f"\nfull per-step math (advantages + whitening + actor loss fwd/bwd), gamma=lam=1; {runs} runs")
    labels = (
        "async PPO 3a: gae + ppo_clip_loss(cur/mu)",
        "COPC: w, clipped_td, copc_policy_loss (mask)",
        "COPC + importance_diagnostics (ESS, clip, KL)",
    )
    for i, label in enumerate(labels):
        ms = [r[i] * 1e3 for r in runs_ms]
        rel = [r[i] / r[0] for r in runs_ms]
        print(f"{label:<48}{statistics.median(ms):>8.2f} ms [{min(ms):.1f}-{max(ms):.1f}]"
              f"  {statistics.median(rel):.3f}x [{min(rel):.3f}-{max(rel):.3f}]")

if __name__ == "__main__":
    main()
