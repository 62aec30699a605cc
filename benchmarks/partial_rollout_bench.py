"""Cost of interruptible decoding: recomputing the KV cache of running rows after a weight swap.

On the tiny model (one CPU thread), the same batch is generated (fixed lengths, EOS ignored) without
refreshes and with a weight swap every ``k`` decode steps (the worst case of partial rollouts: a new
version at every chunk). A swap costs ``load_weights`` plus one prefill of every running row's prompt
and tokens so far; keeping the stale cache instead would cost nothing but make the behaviour
distribution a mixture of two versions (docs/algorithms.md, "Partial rollouts"). Printed: median wall
and process-CPU time over repeats, and the overhead relative to no swaps, per ``k``.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/partial_rollout_bench.py [--batch 16] \
        [--prompt 64] [--new 96] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine
from copc.rollout.sampling import SamplingConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer()
    engine = Engine(build_tiny_model(tok, seed=0), tok)
    weights = [build_tiny_model(tok, seed=s).state_dict() for s in (1, 2)]
    gen = torch.Generator().manual_seed(0)
    vocab = torch.arange(4, len(tok))
    prompts = [[tok.bos_token_id, *vocab[torch.randint(len(vocab), (args.prompt - 1 - i % 8,),
                                                       generator=gen)].tolist()]
               for i in range(args.batch)]
    config = SamplingConfig(max_new_tokens=args.new, ignore_eos=True)
    state = {"calls": 0}

    def swap() -> bool:
        state["calls"] += 1
        if state["calls"] == 1:
            return False  # the refresh before the prefill: nothing new yet
        engine.load_weights(weights[state["calls"] % 2])
        return True

    def run(k: int | None) -> tuple[float, float]:
        state["calls"] = 0
        wall, cpu = time.perf_counter(), time.process_time()
        engine.generate(prompts, config, seeds=list(range(args.batch)),
                        refresh=swap if k is not None else None, chunk_tokens=k or 0)
        return time.perf_counter() - wall, time.process_time() - cpu

    chunks = [None, 32, 16, 8]
    times: dict[int | None, list[tuple[float, float]]] = {k: [] for k in chunks}
    for _ in range(args.repeats):
        for k in chunks:  # interleaved, so machine load hits every setting alike
            times[k].append(run(k))
    base_wall = statistics.median(w for w, _ in times[None])
    base_cpu = statistics.median(c for _, c in times[None])
    print(f"batch {args.batch}, prompt <= {args.prompt}, {args.new} new tokens, {args.repeats} repeats")
    for k in chunks:
        wall = statistics.median(w for w, _ in times[k])
        cpu = statistics.median(c for _, c in times[k])
        swaps = 0 if k is None else (args.new - 1) // k
        print(f"swap every {k!s:>4} tokens ({swaps:2d} swaps): wall {wall:.3f} s "
              f"({wall / base_wall - 1:+.1%}), "
              f"cpu {cpu:.3f} s ({cpu / base_cpu - 1:+.1%})")


if __name__ == "__main__":
    main()
