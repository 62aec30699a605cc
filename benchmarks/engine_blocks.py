"""One large ``Engine.generate`` call (an evaluation's) with and without row blocks and prefill chunks.

    .venv/bin/python benchmarks/engine_blocks.py [--rows 400] [--prompt 120] [--new 48] [--repeats 3]

Times one call of ``--rows`` rows on the tiny model (one thread, sampling at temperature 1, EOS ignored
so every row decodes ``--new`` tokens) for each setting of ``Engine(max_rows=, prefill_tokens=)``,
settings interleaved over ``--repeats`` rounds so a drifting load hits them alike; prints the median
wall time, the time per row and decode step, the ratio to the unblocked call, and whether the sampled
tokens equal the unblocked call's (they may differ by float rounding: a matmul's rounding can depend on
how many rows it has).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine
from copc.rollout.sampling import SamplingConfig

SETTINGS = {  # label: (max_rows, prefill_tokens)
    "one batch (0, 0)": (0, 0),
    "prefill chunks (0, 8192)": (0, 8192),
    "prefill chunks (0, 4096)": (0, 4096),
    "blocks of 64 (64, 8192)": (64, 8192),
    "blocks of 128 (128, 8192)": (128, 8192),
    "blocks of 256 (256, 8192)": (256, 8192),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--prompt", type=int, default=120, help="longest prompt (others shorter, ragged)")
    parser.add_argument("--new", type=int, default=48, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    lengths = torch.randint(args.prompt // 2, args.prompt + 1, (args.rows,), generator=g).tolist()
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]
    config = SamplingConfig(max_new_tokens=args.new, ignore_eos=True)
    seeds = list(range(args.rows))
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, (max_rows, prefill) in SETTINGS.items():
            engine = Engine(model, tok, max_rows=max_rows, prefill_tokens=prefill)
            start = time.perf_counter()
            out = engine.generate(prompts, config, seeds=seeds)
            times[name].append(time.perf_counter() - start)
            tokens[name] = [g.token_ids.tolist() for g in out]
    base = statistics.median(times["one batch (0, 0)"])
    print(f"{args.rows} rows, prompts {args.prompt // 2}-{args.prompt} tokens, {args.new} new tokens each; "
          f"median of {args.repeats} interleaved rounds, one thread")
    print(f"{'setting (max_rows, prefill_tokens)':36s} {'wall s':>8s} {'ms/row/step':>12s} {'vs one batch':>13s} "
          f"{'same tokens':>12s}")
    for name in SETTINGS:
        wall = statistics.median(times[name])
        same = sum(a == b for a, b in zip(tokens[name], tokens["one batch (0, 0)"], strict=True))
        print(f"{name:36s} {wall:8.2f} {1000 * wall / args.rows / args.new:12.3f} {base / wall:12.2f}x "
              f"{same:>6d}/{args.rows}")


if __name__ == "__main__":
    main()
