"""One large ``Engine.generate`` call (an evaluation's) with and without row blocks and prefill chunks, and
with transformers' ``DynamicCache`` in place of the engine's growing KV cache.

    .venv/bin/python benchmarks/engine_blocks.py [--rows 400] [--prompt 120] [--new 48] [--repeats 3]

Times one call of ``--rows`` rows on the tiny model (one thread, sampling at temperature 1, EOS ignored
so every row decodes ``--new`` tokens) for each setting of ``Engine(max_rows=, prefill_tokens=)``,
settings interleaved over ``--repeats`` rounds so a drifting load hits them alike; prints the median
wall time, the time per row and decode step, the ratio to the unblocked call, and whether the sampled
tokens equal the unblocked call's (they may differ by float rounding: a matmul's rounding can depend on
how many rows it has). The last setting swaps the engine's caches (:mod:`copc.rollout.kv_cache`) for
``DynamicCache``, which appends each step with ``torch.cat``; its tokens and log-probs must equal the
growing cache's of the same blocks exactly (``--rows 128 --prompt 260 --repeats 5`` is the setting
``docs/results.md`` quotes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from transformers import DynamicCache

import copc.rollout.engine as engine_module
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine
from copc.rollout.kv_cache import plain_kv
from copc.rollout.sampling import SamplingConfig

DYNAMIC = "blocks of 128, DynamicCache"
SETTINGS = {  # label: (max_rows, prefill_tokens)
    "one batch (0, 0)": (0, 0),
    "prefill chunks (0, 8192)": (0, 8192),
    "prefill chunks (0, 4096)": (0, 4096),
    "blocks of 64 (64, 8192)": (64, 8192),
    "blocks of 128 (128, 8192)": (128, 8192),
    "blocks of 256 (256, 8192)": (256, 8192),
    DYNAMIC: (128, 8192),
}


def _dynamic(layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    return DynamicCache(ddp_cache_data=layers) if layers is not None else DynamicCache()


@contextmanager
def dynamic_caches() -> Iterator[None]:
    """The engine with transformers' DynamicCache everywhere it would make a growing cache."""
    saved = engine_module.growing_cache, engine_module.rows_of, engine_module.stacked
    engine_module.growing_cache = _dynamic  # type: ignore[assignment]
    engine_module.rows_of = lambda cache, rows: _dynamic([(k[rows], v[rows]) for k,
                                                          v in plain_kv(cache)])  # type: ignore[assignment]
    engine_module.stacked = lambda parts: _dynamic([  # type: ignore[assignment]
        (torch.cat([k for k, _ in group]), torch.cat([v for _, v in group]))
        for group in zip(*(plain_kv(p) for p in parts), strict=True)
    ])
    try:
        yield
    finally:
        engine_module.growing_cache, engine_module.rows_of, engine_module.stacked = saved


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
    outputs: dict[str, list[tuple[list[int], list[float]]]] = {}
    for _ in range(args.repeats):
        for name, (max_rows, prefill) in SETTINGS.items():
            engine = Engine(model, tok, max_rows=max_rows, prefill_tokens=prefill)
            with dynamic_caches() if name == DYNAMIC else nullcontext():
                start = time.perf_counter()
                out = engine.generate(prompts, config, seeds=seeds)
                times[name].append(time.perf_counter() - start)
            outputs[name] = [(x.token_ids.tolist(), x.logp.tolist()) for x in out]
    base = statistics.median(times["one batch (0, 0)"])
    print(f"{args.rows} rows, prompts {args.prompt // 2}-{args.prompt} tokens, {args.new} new tokens each; "
          f"median of {args.repeats} interleaved rounds, one thread")
    print(f"{'setting (max_rows, prefill_tokens)':36s} {'wall s':>8s} {'ms/row/step':>12s} "
          f"{'vs one batch':>13s} {'same tokens':>12s}")
    for name in SETTINGS:
        wall = statistics.median(times[name])
        same = sum(a[0] == b[0] for a, b in zip(outputs[name], outputs["one batch (0, 0)"], strict=True))
        print(f"{name:36s} {wall:8.2f} {1000 * wall / args.rows / args.new:12.3f} {base / wall:12.2f}x "
              f"{same:>6d}/{args.rows}")
    growing = statistics.median(times["blocks of 128 (128, 8192)"])
    identical = outputs[DYNAMIC] == outputs["blocks of 128 (128, 8192)"]
    print(
        f"DynamicCache / growing cache (blocks of 128): {statistics.median(times[DYNAMIC]) / growing:.2f}x; "
          f"tokens and log-probs identical: {identical}")


if __name__ == "__main__":
    main()
