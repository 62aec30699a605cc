"""GPU check of the correction maths: numerics on the device, and what each preset's maths costs beside a
model's step.

    python benchmarks/gpu/channels_gpu.py [--device cuda] [--repeats 20] [--model 0.6b|tiny] [--micro 2]
        [--out FILE.json]

The batch is ``benchmarks/ops_bench.py``'s: B = 64 sequences, T = 4096 tokens, multi-turn action masks
(prompt, 1-4 sampled turns split by tool output, right padding), stale log-probs (|old - mu| ~ 0.3).
Every preset of the method registry runs through the channels the trainer calls
(``compute_advantages``, ``policy_loss`` with ``count_loss_tokens``, ``value_loss``), on the whole batch as
one minibatch.

1. Numerics: each preset's advantages, critic targets, actor loss, critic loss and both gradients on the
   device against the same call on the CPU (float32 both; the reduction order differs). Printed: the
   largest absolute difference of each, and the largest over all presets. Run twice: at the presets'
   gamma = lambda = 1 (reverse cumulative sums) and at gamma = 0.99, lambda = 0.95 (compaction and
   the blocked matrix scan).
2. Time of each preset's channel maths on the device (CUDA events; medians of ``--repeats`` calls after
   a warm-up): advantages and targets, actor loss forward + backward, critic loss forward + backward.
3. Context, because the maths alone says nothing about a step: a random-weight Qwen3 model built from a
   config (``--model 0.6b``: Qwen3-0.6B's shapes, bfloat16, SDPA attention; nothing downloaded). Measured on
   micro-batches of ``--micro`` rows x T tokens: the actor's forward + backward (the sampled tokens'
   log-probs by the trainer's own ``copc.models.hf.token_logprobs``; the first run, in
   docs/figures/gpu_channels_h200.log, took a full float32 log-softmax instead), its no-grad forward (the
   ``old`` forward), the critic's forward + backward (the same trunk, a scalar head) and its no-grad
   forward (pre-update values). Each is scaled to the B rows. A preset's step estimate is the sum of the
   pieces it needs: actor forward + backward, the critic's forward + backward
   times its preset's critic updates and its no-grad forward if it has a critic, the ``old`` forward if
   ``needs_old_forward``, and its maths from part 2. Printed: each preset's estimate and its overhead
   over async PPO 3a (``async_ppo``). Rollout generation is not in it (asynchronous: it overlaps the
   step), nor the optimiser, nor communication, nor recomputation (gradient checkpointing), and the maths
   is one call over the whole batch where the trainer calls the losses once per micro-batch. It is an
   estimate assembled from measured pieces, not a measured trainer step: copc's own trainer runs on the
   CPU (docs/scaling.md). ``--estimates-from FILE.json`` recomputes the estimates from a saved run.

``--device cpu --model tiny --repeats 2`` runs the whole script on a CPU (how it was checked before any GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops_bench
sys.path.insert(0, str(Path(__file__).resolve().parent))  # shapes
from ops_bench import realistic_batch
from shapes import QWEN3_06B, QWEN3_TINY

from copc.channels import (
    PolicyInputs,
    ValueInputs,
    compute_advantages,
    count_loss_tokens,
    policy_loss,
    value_loss,
)
from copc.channels.methods import MethodConfig, get_method, method_names
from copc.models.hf import token_logprobs
from copc.ops import log_ratio

Batch = dict[str, torch.Tensor]


def on(d: Batch, device: str) -> Batch:
    return {k: v.to(device) for k, v in d.items()}


def channel_step(method: MethodConfig, d: Batch) -> dict[str, torch.Tensor]:
    """One step's maths of ``method`` on the whole batch: what the trainer computes, as one minibatch."""
    mask = d["mask"]
    # as the trainer forms it (clamped, 0 off actions)
    log_w = log_ratio(d["logp_old"], d["logp_behav"], mask)
    adv = compute_advantages(
        method.advantage, rewards=d["rewards"], values=d["values"] if method.needs_critic else None,
        log_w=log_w, action_mask=mask, scores=d["scores"], group_ids=d["groups"],
    )
    logp = d["logp"].clone().requires_grad_(True)
    old = d["logp_old"] if method.needs_old_forward else None
    tokens = count_loss_tokens(method.policy, logp_old=old, logp_behav=d["logp_behav"], action_mask=mask)
    actor = policy_loss(method.policy, PolicyInputs(logp, old, d["logp_behav"], adv.advantages, mask, tokens))
    actor.loss.backward()
    out = {"advantages": adv.advantages, "returns": adv.returns, "actor_loss": actor.loss.detach(),
           "actor_grad": logp.grad}
    if method.critic is not None:
        values = d["values_new"].clone().requires_grad_(True)
        critic = value_loss(method.critic, ValueInputs(values, d["values"], adv.returns, mask, mask.sum()))
        critic.loss.backward()
        out |= {"critic_loss": critic.loss.detach(), "critic_grad": values.grad}
    return out


def with_discount(method: MethodConfig, gamma: float, lam: float) -> MethodConfig:
    adv = replace(method.advantage, gamma=gamma, lam_critic=lam, lam_actor=lam)
    return replace(method, advantage=adv)


def numerics(device: str, d_cpu: Batch, d_dev: Batch, names: tuple[str, ...], gamma: float,
             lam: float) -> dict:
    """Largest |device - CPU| of every output of every preset."""
    print(f"\n1. numerics, {device} vs cpu (float32 both), gamma={gamma}, lambda={lam}: max |diff|")
    worst: dict[str, float] = {}
    rows = {}
    for name in names:
        method = with_discount(get_method(name), gamma, lam)
        ref = channel_step(method, d_cpu)
        got = channel_step(method, d_dev)
        diffs = {k: float((got[k].double().cpu() - ref[k].double()).abs().max()) for k in ref}
        scale = {k: float(ref[k].double().abs().max()) for k in ref}
        rows[name] = {"max_abs_diff": diffs, "max_abs_value": scale}
        print(f"  {name:<22}" + "  ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
        for k, v in diffs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    print("  largest over presets: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return {"per_preset": rows, "largest": worst}


def median_ms(fn: Callable[[], object], device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def maths_times(device: str, d_dev: Batch, names: tuple[str, ...], repeats: int) -> dict[str, float]:
    print(f"\n2. channel maths per step on {device} (advantages + actor loss fwd/bwd + critic loss fwd/bwd), "
          f"median of {repeats}")
    out = {name: median_ms(lambda n=name: channel_step(get_method(n), d_dev), device,
                           repeats) for name in names}
    base = out["async_ppo"]
    for name, ms in out.items():
        print(f"  {name:<22}{ms:>9.2f} ms  {ms / base:>6.2f}x async_ppo")
    return out


MODELS = {"0.6b": QWEN3_06B, "tiny": QWEN3_TINY}


def model_times(device: str, size: str, micro: int, batch: Batch, repeats: int) -> dict[str, float]:
    """Per-step ms of the actor's and the critic's passes over the whole batch, from micro-batch medians."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    cfg = Qwen3Config(**MODELS[size], max_position_embeddings=40960, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    with torch.device(device):
        actor = Qwen3ForCausalLM(cfg).to(dtype)
        critic_trunk = Qwen3ForCausalLM(cfg).model.to(dtype)  # the critic: the trunk and a scalar head
        head = torch.nn.Linear(cfg.hidden_size, 1).to(dtype)
    n_params = sum(p.numel() for p in actor.parameters())
    rows, seq = batch["mask"].shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (micro, seq), generator=gen).to(device)

    attention = torch.ones_like(ids, dtype=torch.bool)

    def actor_logp() -> torch.Tensor:  # the trainer's own log-probs (float32 picked entries minus logsumexp)
        return token_logprobs(actor, ids, attention).logp

    def critic_values() -> torch.Tensor:
        return head(critic_trunk(input_ids=ids).last_hidden_state).squeeze(-1).float()

    def fwd_bwd(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            f().mean().backward()
            actor.zero_grad(set_to_none=True)
            critic_trunk.zero_grad(set_to_none=True)
            head.zero_grad(set_to_none=True)
        return run

    def no_grad(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                f()
        return run

    scale = rows / micro
    pieces = {
        "actor_fwd_bwd": median_ms(fwd_bwd(actor_logp), device, repeats) * scale,
        "actor_fwd": median_ms(no_grad(actor_logp), device, repeats) * scale,
        "critic_fwd_bwd": median_ms(fwd_bwd(critic_values), device, repeats) * scale,
        "critic_fwd": median_ms(no_grad(critic_values), device, repeats) * scale,
    }
    print(f"\n3. model passes, random-weight Qwen3 '{size}' ({n_params / 1e6:.0f}M parameters, {dtype}), "
          f"micro-batches of {micro} x {seq} scaled to {rows} rows; median of {repeats}")
    for k, v in pieces.items():
        print(f"  {k:<16}{v:>10.1f} ms per step")
    if device.startswith("cuda"):
        print(f"  peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    return pieces | {"parameters": float(n_params)}


def step_estimates(maths: dict[str, float], pieces: dict[str, float]) -> dict[str, dict[str, float]]:
    print("\n   step estimate = actor fwd/bwd + critic fwd/bwd x the preset's critic updates + critic fwd "
          "(if a critic) + old forward (if needed) + maths; one "
          "actor epoch (trainer.ppo_epochs=1), no recomputation")
    out = {}
    for name, ms in maths.items():
        method = get_method(name)
        step = pieces["actor_fwd_bwd"] + ms
        if method.critic is not None:
            step += pieces["critic_fwd_bwd"] * method.critic.updates_per_step + pieces["critic_fwd"]
        # trainer.old_forward_reuse=true: the first of k actor minibatches takes old from its own forward.
        reuse = step
        if method.needs_old_forward:
            step += pieces["actor_fwd"]
            reuse += pieces["actor_fwd"] * (1 - 1 / method.policy.minibatches)
        out[name] = {"step_ms": step, "step_ms_old_forward_reuse": reuse, "maths_ms": ms,
                     "old_forward": float(method.needs_old_forward)}
    base = out["async_ppo"]["step_ms"]
    for name, row in out.items():
        row["overhead_vs_3a"] = row["step_ms"] / base - 1
        row["overhead_vs_3a_old_forward_reuse"] = row["step_ms_old_forward_reuse"] / base - 1
        maths_only = (row["maths_ms"] - maths["async_ppo"]) / base
        row["maths_overhead_vs_3a"] = maths_only
        print(f"  {name:<22}{row['step_ms']:>10.1f} ms  {row['overhead_vs_3a']:>+7.1%} vs 3a"
              f"  (old_forward_reuse {row['overhead_vs_3a_old_forward_reuse']:+.1%}; maths alone "
              f"{maths_only:+.2%}; old forward: {'yes' if row['old_forward'] else 'no'})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--model", choices=sorted(MODELS), default="0.6b")
    ap.add_argument("--micro", type=int, default=2, help="rows per micro-batch of the model passes")
    ap.add_argument("--out", type=Path, help="write every figure to this JSON file")
    ap.add_argument("--estimates-from", type=Path, metavar="JSON",
                    help="recompute only the step estimates from a JSON this script wrote (no device needed)")
    args = ap.parse_args()
    if args.estimates_from is not None:
        saved = json.loads(args.estimates_from.read_text())
        estimates = step_estimates(saved["maths_ms"], saved["model_ms"])
        if args.out:
            args.out.write_text(json.dumps({"from": str(args.estimates_from), "step_estimates": estimates},
                                           indent=1))
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(
            "channels_gpu.py: no CUDA device visible (torch.cuda.is_available() is False); use --device cpu")
    torch.manual_seed(0)
    d_cpu = realistic_batch(0)
    d_cpu["values_new"] = d_cpu["values"] + 0.1 * torch.randn_like(d_cpu["values"])
    d_dev = on(d_cpu, args.device)
    names = method_names()
    info = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "batch": list(d_cpu["mask"].shape),
            "action_tokens": int(d_cpu["mask"].sum())}
    print(json.dumps(info))
    result: dict[str, object] = {"info": info}
    result["numerics_gamma1"] = numerics(args.device, d_cpu, d_dev, names, 1.0, 1.0)
    result["numerics_gamma099"] = numerics(args.device, d_cpu, d_dev, names, 0.99, 0.95)
    maths = maths_times(args.device, d_dev, names, args.repeats)
    result["maths_ms"] = maths
    pieces = model_times(args.device, args.model, args.micro, d_cpu, max(3, args.repeats // 4))
    result["model_ms"] = pieces
    result["step_estimates"] = step_estimates(maths, pieces)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
