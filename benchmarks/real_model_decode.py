"""Where a real model's generation time goes: one decode step of copc's engine by batch size, against its
FLOP bound and its weight-streaming bound, and the share of a call spent outside the model's forwards.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model_decode.py --model smollm2-hf \
        [--rows 1 4 16 64] [--new 32] [--out decode.json]

Every time is this thread's CPU seconds (``time.thread_time``), not wall time: on a machine shared with
other jobs a wall clock counts the waits for a core, the CPU clock only the work. The prompt is a real
one (the first held-out word problem in the recipe's template), repeated ``rows`` times. For each row
count, two ``Engine.generate`` calls (EOS ignored): 1 new token (the prefill and one step) and ``1 + new``
tokens; their difference over ``new`` is the CPU seconds of one decode step of ``rows`` rows (median of
3 rounds). Its bounds on this thread: the matmul FLOPs of one step (``2 P`` per row for the
non-embedding weights, ``2 d V`` for the head, ``4 L t d`` for attention over ``t`` cached tokens) at the
measured ``torch.matmul`` rate for the step's own shapes (``[rows, d] @ [d, 4d]``: few rows, so far below
the big-matrix rate), and the bytes of the float32 weights read once per step at the measured copy
bandwidth of a large tensor. On the 16-row call: the CPU seconds inside the model's forwards and outside
them (the engine: sampling, stop strings, the KV cache's bookkeeping, Python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))



def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """GFLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` per CPU second of this thread (median of 5 blocks)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(2):
        a @ b
    start = time.thread_time()
    for _ in range(10):
        a @ b
    one = max((time.thread_time() - start) / 10, 1e-7)
    reps = max(1, int(seconds / 5 / one))
    rates = []
    for _ in range(5):
        start = time.thread_time()
        for _ in range(reps):
            a @ b
        rates.append(2 * m * k * n * reps / max(time.thread_time() - start, 1e-7) / 1e9)
    return statistics.median(rates)


def copy_gbps(mib: int = 512) -> float:
    """GB/s of reading and writing a ``mib`` MiB float32 tensor (``copy_``; both directions counted)."""
    a = torch.empty(mib * 2**18)
    b = torch.empty_like(a)
    b.copy_(a)
    rates = []
    for _ in range(5):
        start = time.thread_time()
        b.copy_(a)
        rates.append(2 * a.numel() * 4 / (time.thread_time() - start) / 1e9)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from real_model_recipe import RECIPE

    from copc.models.hf import load_policy
    from copc.rollout.engine import Engine
    from copc.rollout.sampling import SamplingConfig
    from copc.run.build import quiet_transformers
    from copc.run.config import load_run_config
    from copc.tasks import get_task

    quiet_transformers()
    cfg = load_run_config(None, [*RECIPE, f"model.policy={args.model}", "run_dir=/tmp/copc-decode-unused"])
    model, tokenizer = load_policy(args.model)
    prompt = tokenizer(get_task(cfg.task, **cfg.task_options).prompts("eval", 1)[0].text)["input_ids"]
    engine = Engine(model, tokenizer)
    conf = model.config
    hidden, layers, vocab = int(conf.hidden_size), int(conf.num_hidden_layers), int(conf.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    body = params - vocab * hidden  # the tied head is the embedding: counted once, as the head
    weight_bytes = params * 4
    bandwidth = copy_gbps()

    def call(rows: int, new: int) -> float:
        config = SamplingConfig(temperature=0.5, max_new_tokens=new, ignore_eos=True)
        start = time.thread_time()
        engine.generate([prompt] * rows, config, generator=torch.Generator().manual_seed(0))
        return time.thread_time() - start

    results = []
    for rows in args.rows:
        call(rows, 2)  # warm-up
        steps = [(call(rows, 1 + args.new) - call(rows, 1)) / args.new for _ in range(3)]
        step = statistics.median(steps)
        t = len(prompt) + args.new // 2
        gflop = (2 * body * rows + 2 * hidden * vocab * rows + 4 * layers * t * hidden * rows) / 1e9
        rate = matmul_gflops(rows, hidden, int(conf.intermediate_size), torch.float32, seconds=1.0)
        results.append({"rows": rows, "step_s": step, "tokens_per_s": rows / step, "gflop": gflop,
                        "matmul_gflops_at_rows": rate, "flop_bound_s": gflop / rate,
                        "weight_bound_s": weight_bytes / (bandwidth * 1e9 / 2)})
        r = results[-1]
        print(f"rows {rows:>3}: {step * 1e3:7.1f} ms a step, {r['tokens_per_s']:6.1f} tok/s; FLOP bound "
              f"{r['flop_bound_s'] * 1e3:6.1f} ms at {rate:.1f} GFLOP/s, weight bound "
              f"{r['weight_bound_s'] * 1e3:5.1f} ms", flush=True)

    # Inside the 16-row call: the model's forwards vs the engine around them (sampling, stop strings, caches).
    rows = 16 if 16 in args.rows else args.rows[0]
    forward_s = [0.0]
    inner = model.forward

    def timed_forward(*a: object, **k: object) -> object:
        begin = time.thread_time()
        try:
            return inner(*a, **k)
        finally:
            forward_s[0] += time.thread_time() - begin

    model.forward = timed_forward  # type: ignore[method-assign]
    total = call(rows, 1 + args.new)
    model.forward = inner  # type: ignore[method-assign]
    split = {"rows": rows, "new": 1 + args.new, "cpu_s": total, "forward_cpu_s": forward_s[0],
             "outside_forward_cpu_s": total - forward_s[0]}
    print(f"{rows} rows x {1 + args.new} tokens (prefill included): CPU {total:.2f} s, of which the model's "
          f"forwards {forward_s[0]:.2f} s and the engine around them {total - forward_s[0]:.2f} s")
    out = {"model": args.model, "prompt_tokens": len(prompt), "params": params, "copy_gbps": bandwidth,
           "load": os.getloadavg()[0], "steps": results, "profile": split}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
