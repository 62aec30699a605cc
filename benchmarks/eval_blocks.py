"""A held-out evaluation of a hard testbed with the engine's row blocks (128 rows) against one block.

    .venv/bin/python benchmarks/eval_blocks.py [--task arith_tool] [--repeats 2]

``benchmarks/engine_blocks.py`` times one ``generate`` call whose rows all decode the same number of
tokens; there one block of hundreds of rows beats blocks of 128. A real evaluation is a multi-turn tool
loop whose rows finish at different times, and every finish compacts the block's keys/values. This runs
``copc.eval.evaluate.evaluate`` on the testbed's warm start (``copc testbed`` settings: 200 held-out
prompts, avg@1 and greedy) with the engine's default blocks and with ``max_rows=0`` (one block),
interleaved over ``--repeats`` rounds, and prints the median wall time of each and whether the two give
the same figures (a row's tokens do not depend on its block but for float rounding).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="arith_tool", choices=("arith_tool", "kv_search"))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import copc.eval.evaluate as evaluate_module
    from copc.experiments.testbed import base_overrides
    from copc.models.hf import load_policy
    from copc.rollout.engine import MAX_ROWS, Engine
    from copc.run.build import policy_path, quiet_transformers
    from copc.run.config import load_run_config
    from copc.tasks import get_task

    quiet_transformers()
    tmp = Path(tempfile.mkdtemp(prefix="copc-eval-blocks-"))
    cfg = load_run_config(None, [*base_overrides(args.task), f"run_dir={tmp}/run"])
    model, tokenizer = load_policy(policy_path(cfg, tmp))
    task = get_task(cfg.task, **cfg.task_options)
    settings: dict[str, Callable[..., Engine]] = {
        f"blocks of {MAX_ROWS} (default)": Engine, "one block (max_rows=0)": functools.partial(Engine,
                                                                                               max_rows=0)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    figures: dict[str, dict[str, float]] = {}
    for rep in range(args.repeats):
        for name in list(settings)[:: 1 if rep % 2 == 0 else -1]:
            evaluate_module.Engine = settings[name]  # type: ignore[assignment,misc]
            start = time.perf_counter()
            figures[name] = evaluate_module.evaluate(model, tokenizer, task, cfg.rollout, cfg.eval,
                                                     seed=cfg.seed)
            times[name].append(time.perf_counter() - start)
    evaluate_module.Engine = Engine  # type: ignore[misc]
    print(f"{args.task}: {cfg.eval.prompts} held-out prompts, avg@{cfg.eval.samples} + greedy; median of "
          f"{args.repeats}")
    for name in settings:
        print(f"{name:26s} {statistics.median(times[name]):7.2f} s")
    blocked, whole = (statistics.median(times[name]) for name in settings)
    print(f"one block / blocks: {whole / blocked:.2f}x; the same figures: "
          f"{len({str(f) for f in figures.values()}) == 1}")


if __name__ == "__main__":
    main()
