"""The engine's growing KV cache against transformers' DynamicCache (which appends with ``torch.cat``).

    .venv/bin/python benchmarks/kv_cache.py [--rows 128] [--prompt 260] [--new 48] [--repeats 5]

Times one ``Engine.generate`` call of ``--rows`` rows on the tiny model (one thread, temperature 1,
ragged prompts of ``--prompt``/2 .. ``--prompt`` tokens, EOS ignored so every row decodes ``--new``
tokens), once with the engine as it is (:mod:`copc.rollout.kv_cache`) and once with its caches swapped
for ``DynamicCache`` in this script, interleaved over ``--repeats`` rounds; prints the median wall time
of each, their ratio, and whether the sampled tokens and log-probs are identical.
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


def _dynamic(layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    return DynamicCache(ddp_cache_data=layers) if layers is not None else DynamicCache()


@contextmanager
def dynamic_caches() -> Iterator[None]:
    """The engine with transformers' DynamicCache everywhere it would make a growing cache."""
    saved = engine_module.growing_cache, engine_module.rows_of, engine_module.stacked
    engine_module.growing_cache = _dynamic  # type: ignore[assignment]
    engine_module.rows_of = lambda cache, rows: _dynamic([(k[rows], v[rows]) for k, v in plain_kv(cache)])  # type: ignore[assignment]
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
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=260, help="longest prompt (others shorter, ragged)")
    parser.add_argument("--new", type=int, default=48, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=5)
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
    engine = Engine(model, tok)
    times: dict[str, list[float]] = {"growing (copc)": [], "DynamicCache (torch.cat)": []}
    outputs: dict[str, list[tuple[list[int], list[float]]]] = {}
    for _ in range(args.repeats):
        for name in times:
            with dynamic_caches() if name.startswith("Dynamic") else nullcontext():
                start = time.perf_counter()
                out = engine.generate(prompts, config, seeds=seeds)
                times[name].append(time.perf_counter() - start)
            outputs[name] = [(x.token_ids.tolist(), x.logp.tolist()) for x in out]
    growing, dynamic = (statistics.median(t) for t in times.values())
    print(f"{args.rows} rows, prompts {args.prompt // 2}-{args.prompt} tokens, {args.new} new tokens each; "
          f"median of {args.repeats} interleaved rounds, one thread")
    for name, t in times.items():
        print(f"{name:26s} {statistics.median(t):7.3f} s  ({1000 * statistics.median(t) / args.new:.1f} ms per step)")
    same = outputs["growing (copc)"] == outputs["DynamicCache (torch.cat)"]
    print(f"DynamicCache / growing: {dynamic / growing:.2f}x; tokens and log-probs identical: {same}")


if __name__ == "__main__":
    main()
