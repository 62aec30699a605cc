"""Benchmark of the advantage channel (copc.ops.advantages) on one CPU thread.

B = 64 sequences, T = 4096 tokens, float32, realistic multi-turn action masks (prompt prefix, several
turns of sampled tokens separated by tool-output spans, right padding). Prints medians over repeats of:

* each estimator's time;
* its speed-up over a loop over T with batch-vectorised steps (the verl-style reference loop, written
  here; its output is checked against the vectorised one before timing);
* its time relative to one ``torch.cumsum`` over a [64, 4096] float32 tensor;
* COPC's whole per-step math (behaviour ratio, clipped-TD advantages and returns, whitening, masked
  clipped surrogate forward + backward) relative to async PPO 3a's (GAE, whitening, PPO clip against
  the behaviour log-probs, forward + backward).

Run: ``.venv/bin/python benchmarks/ops_bench.py [--repeats N]``. Ratios are measured in one run, on
the same inputs. Times are process CPU time (``time.process_time``), not wall-clock, so that load from
other processes on a shared machine does not inflate them; absolute numbers depend on the machine.
Note: with glibc's default malloc, every fresh [64, 4096] temporary that the heap has trimmed back to
the OS costs page faults (~1 ms each here), which a single cumsum in a loop never pays; run with
``MALLOC_TRIM_THRESHOLD_=1000000000 MALLOC_MMAP_THRESHOLD_=1000000000`` to see the compute alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from copc.ops.advantages import (
    brace,
    broadcast_to_tokens,
    clipped_td,
    gae,
    group_advantages,
    vtrace,
)
from copc.ops.importance import importance_diagnostics, log_ratio
from copc.ops.masked import masked_whiten

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


def loop_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
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
    rewards: torch.Tensor, values: torch.Tensor, rho: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed repeats per vectorised measurement")
    parser.add_argument("--loop-repeats", type=int, default=3, help="timed repeats per loop baseline")
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = realistic_batch()
    mask, rew, val = d["mask"], d["rewards"], d["values"]
    log_w = log_ratio(d["logp_old"], d["logp_behav"], mask)
    rho = torch.exp(log_w).clamp(0.8, 1.2)
    n_act = int(mask.sum())
    print(f"B={B} T={T} float32, 1 thread; action tokens {n_act} ({n_act / (B * T):.0%}), "
          f"median of {args.repeats} (loops: {args.loop_repeats})")

    # Loop baselines must agree with the vectorised estimators before their times mean anything.
    ref_gae = gae(rew, val, mask, gamma=1.0, lam=1.0).advantages
    torch.testing.assert_close(loop_gae(rew, val, mask, 1.0, 1.0), ref_gae, rtol=1e-4, atol=1e-4)
    ctd_kw = {"gamma": 1.0, "lam_critic": 1.0, "lam_actor": 1.0, "low": 0.8, "high": 1.2}
    ref_ctd = clipped_td(rew, val, log_w, mask, **ctd_kw).advantages  # type: ignore[arg-type]
    torch.testing.assert_close(loop_clipped_td(rew, val, rho, mask, 1.0, 1.0), ref_ctd, rtol=1e-4, atol=1e-4)

    x = torch.randn(B, T)
    t_cumsum = median_time(lambda: torch.cumsum(x, dim=1), args.repeats * 5)
    t_loop_gae = median_time(lambda: loop_gae(rew, val, mask, 1.0, 1.0), args.loop_repeats)
    t_loop_ctd = median_time(lambda: loop_clipped_td(rew, val, rho, mask, 1.0, 1.0), args.loop_repeats)
    t_loop_gae95 = median_time(lambda: loop_gae(rew, val, mask, 1.0, 0.95), args.loop_repeats)

    rows: list[tuple[str, Callable[[], object], float | None]] = [
        ("gae (gamma=lam=1)", lambda: gae(rew, val, mask, gamma=1.0, lam=1.0), t_loop_gae),
        ("gae (gamma=1, lam=0.95)", lambda: gae(rew, val, mask, gamma=1.0, lam=0.95), t_loop_gae95),
        ("clipped_td default", lambda: clipped_td(rew, val, log_w, mask, **ctd_kw), t_loop_ctd),  # type: ignore[arg-type]
        ("clipped_td k_A=100", lambda: clipped_td(rew, val, log_w, mask, advantage_window=100, **ctd_kw), None),  # type: ignore[arg-type]
        ("vtrace", lambda: vtrace(rew, val, log_w, mask, gamma=1.0, lam=1.0, rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0), None),
        ("brace k=100", lambda: brace(rew, val, log_w, mask, gamma=1.0, lam=1.0, rho_bar=1.2, c_bar=1.1, k=100), None),
        ("group (grpo + broadcast)",
         lambda: broadcast_to_tokens(group_advantages(d["scores"], d["groups"], mode="grpo"), mask), None),
    ]
    print(f"\n{'estimator':<28}{'median ms':>11}{'loop ms':>10}{'speed-up':>10}{'x cumsum':>10}")
    print(f"{'torch.cumsum [64,4096]':<28}{t_cumsum * 1e3:>11.3f}{'':>10}{'':>10}{1.0:>10.2f}")
    for name, fn, loop_t in rows:
        t = median_time(fn, args.repeats if "brace" not in name and "vtrace" not in name else 5)
        loop_s = f"{loop_t * 1e3:>10.1f}" if loop_t else f"{'-':>10}"
        speed = f"{loop_t / t:>9.1f}x" if loop_t else f"{'-':>10}"
        print(f"{name:<28}{t * 1e3:>11.3f}{loop_s}{speed}{t / t_cumsum:>10.2f}")
    full_step(d, args.repeats)


def full_step(d: dict[str, torch.Tensor], repeats: int) -> None:
    """COPC vs async PPO 3a: advantages + whitening + actor loss forward and backward."""
    try:
        from copc.ops.policy_losses import copc_policy_loss, ppo_clip_loss
    except ImportError as err:
        print(f"\nfull step: unavailable (copc.ops.policy_losses: {err})")
        return
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
            ctd = clipped_td(rew, val, log_w, mask, gamma=1.0, lam_critic=1.0, lam_actor=1.0, low=0.8, high=1.2)
            adv = masked_whiten(ctd.advantages, mask)
            out = copc_policy_loss(logp, d["logp_old"], d["logp_behav"], adv, mask)
            out.loss.backward()
            logp.grad = None
            if diagnostics:
                importance_diagnostics(log_w, mask, clip_low=0.8, clip_high=1.2, keep_mask=out.keep)
        return step

    # Interleave the measurements so that load from other processes hits both sides alike.
    t_ppo, t_copc, t_diag = [], [], []
    fns = (async_ppo, copc(False), copc(True))
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, acc in zip(fns, (t_ppo, t_copc, t_diag), strict=True):
            start = time.process_time()
            fn()
            acc.append(time.process_time() - start)
    p, c, g = (statistics.median(x) for x in (t_ppo, t_copc, t_diag))
    print("\nfull per-step math (advantages + whitening + actor loss fwd/bwd), gamma=lam=1")
    print(f"{'async PPO 3a: gae + ppo_clip_loss(cur/mu)':<52}{p * 1e3:>9.2f} ms  1.00x")
    print(f"{'COPC: w, clipped_td, copc_policy_loss (mask)':<52}{c * 1e3:>9.2f} ms  {c / p:.2f}x")
    print(f"{'COPC + importance_diagnostics (ESS, clip, KL)':<52}{g * 1e3:>9.2f} ms  {g / p:.2f}x")


if __name__ == "__main__":
    main()
