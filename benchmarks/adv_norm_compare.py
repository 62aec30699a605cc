"""Advantage normalisation on the default run: whiten vs scale-with-floor (or any mode), per seed.

    python benchmarks/adv_norm_compare.py --modes whiten:0 scale:0.1 --seeds 0 1 --out /tmp/norm

Each (mode, floor, seed) is one embedded-default ``copc train`` run (method ``copc``, async driver,
bounded staleness 8) with only ``advantage.normalize`` / ``advantage.std_floor`` of the preset
replaced; runs go one at a time. Prints eval accuracy (avg@k) before and after, the gain, and the
smallest ``adv/raw_std`` seen during training (how close a batch came to "noise only").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import copc.run.train as train_module
from copc.channels.methods import MethodConfig
from copc.run.config import RunConfig, load_run_config
from copc.tracking import ADV_RAW_STD, read_metrics


def run_one(mode: str, floor: float, seed: int, out: Path, extra: list[str]) -> dict[str, object]:
    preset = train_module.resolve_method

    def with_norm(cfg: RunConfig) -> MethodConfig:
        method = preset(cfg)
        return replace(method, advantage=replace(method.advantage, normalize=mode, std_floor=floor))

    train_module.resolve_method = with_norm  # type: ignore[assignment]
    try:
        run_dir = out / f"{mode}-{floor:g}-s{seed}"
        cfg = load_run_config(None, [f"seed={seed}", f"run_dir={run_dir}", "plots=false", *extra])
        result = train_module.train(cfg, show_progress=False)
    finally:
        train_module.resolve_method = preset  # type: ignore[assignment]
    stds = [float(r[ADV_RAW_STD]) for r in read_metrics(run_dir) if ADV_RAW_STD in r]
    s = result.summary
    return {"mode": mode, "floor": floor, "seed": seed, "before": s.get("eval_accuracy_before"),
            "after": s.get("eval_accuracy_after"), "min_raw_std": min(stds) if stds else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["whiten:0", "scale:0.1"], help="mode:floor pairs")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="extra key.sub=value overrides of the run config")
    args = parser.parse_args()
    for seed in args.seeds:
        for spec in args.modes:
            mode, _, floor = spec.partition(":")
            row = run_one(mode, float(floor or 0.0), seed, args.out, args.overrides)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
