"""``copc sweep`` and its results store: grid expansion, cell states, the record format, the interval
maths on golden values, and (tiny, 2 steps) an interrupted cell resumed, recorded, then skipped."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from copc import tracking as m
from copc.config import dump_yaml, to_dict
from copc.experiments import testbed
from copc.experiments.results import (
    build_record,
    config_hash,
    curve_mean,
    load_records,
    read_record,
    subsample_curve,
    write_record,
)
from copc.experiments.stats import student_t_quantile, t_interval
from copc.experiments.step_times import estimate_seconds, evaluations, timing_key
from copc.experiments.sweep import cell_state, resolve
from copc.experiments.sweep_cli import sweep_cli
from copc.experiments.sweep_spec import SpecError, expand, load_spec, parse_spec
from copc.experiments.tables import (
    collapse_step,
    collapse_text,
    paired_differences,
    report_text,
    start_mismatches,
)
from copc.run.config import load_run_config
from copc.run.tracker import Tracker

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

TINY = [
    "model.policy=tiny", "task_options={train_size: 100, eval_size: 8}", "steps=2", "checkpoint_every=1",
    "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8",
    "rollout.max_total_tokens=12", "eval.prompts=4", "eval.samples=2", "driver.kind=sync",
    "trainer.critic_warmup_steps=0", "plots=false",
]

GRID = {
    "experiment": "demo",
    "seeds": 2,
    "shared": ["steps=5"],
    "axes": {
        "method": {"ppo_sync": ["method=ppo", "driver.kind=sync"], "copc": ["method=copc"]},
        "s": {"key": "staleness.staleness", "values": [8, 16]},
    },
    "grids": [{"method": ["ppo_sync"]}, {"method": ["copc"], "s": "all"}, {"s": [16], "method": "copc"}],
    "baseline": {"method": "ppo_sync"},
}


# --------------------------------------------------------------------------------------------- grids
def test_grid_expands_to_every_cell_seed_outermost_without_duplicates():
    cells = expand(parse_spec(GRID))
    ids = [c.cell_id for c in cells]
    per_seed = ["method=ppo_sync", "method=copc__s=8", "method=copc__s=16"]  # the 3rd grid repeats a cell
    assert ids == [f"{c}__seed{s}" for s in (0, 1) for c in per_seed]
    copc16 = cells[2]
    assert copc16.levels == (("method", "copc"), ("s", "16")) and copc16.seed == 0
    assert copc16.overrides == ("steps=5", "method=copc", "staleness.staleness=16")
    assert cells[0].overrides == ("steps=5", "method=ppo", "driver.kind=sync")


def test_no_grids_crosses_every_axis():
    spec = parse_spec({**GRID, "grids": None, "seeds": [7]})
    assert [c.cell_id for c in expand(spec)] == [
        "method=ppo_sync__s=8__seed7", "method=ppo_sync__s=16__seed7",
        "method=copc__s=8__seed7", "method=copc__s=16__seed7",
    ]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"grids": [{"lr": "all"}]}, "unknown axis 'lr'"),
        ({"grids": [{"method": ["dapo"]}]}, "no level 'dapo'"),
        ({"seeds": 0}, "seeds must be"),
        ({"shared": ["steps"]}, "key=value"),
        ({"axes": {"method": {"a b": ["method=ppo"]}}}, "file name"),
        ({"baseline": {"method": "sao"}}, "baseline method=sao"),
        ({"report": ["accuracy"]}, "report metric"),
        ({"seed": 1}, "unknown key(s) seed"),
        ({"accepted_records": {"method=dapo__seed0": {"config_hash": "0123456789abcdef", "why": "w"}}},
         "'method=dapo__seed0' is no cell of this file"),
        ({"accepted_records": {"method=ppo_sync__seed0": {"config_hash": "0123"}}},
         "expected {cell id: {config_hash:"),
        ({"accepted_records": {"method=ppo_sync__seed0": {"config_hash": "0123", "why": "w"}}},
         "16 hex digits"),
        ({"accepted_records": {"method=ppo_sync__seed0": {"config_hash": "0123456789abcdef", "why": " "}}},
         "and why a reason"),
    ],
)
def test_bad_sweep_file_fails_in_one_line_naming_it(change, needle):
    with pytest.raises(SpecError) as err:
        parse_spec({**GRID, **change}, "demo.yaml")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_cell_config_names_the_cell(tmp_path):
    cell = expand(parse_spec({**GRID, "shared": ["trainer.actor_lrr=1"]}))[0]
    with pytest.raises(Exception, match=r"cell method=ppo_sync__seed0: .*actor_lr"):
        resolve(cell, tmp_path)


# ------------------------------------------------------------------------------------ interval maths
def test_student_t_quantiles_match_the_tables():
    # two-sided 95% critical values (any t table): df 1, 2, 4, 10, 30; and the 0.95 quantile at df 3
    for df, value in [(1, 12.7062047), (2, 4.30265273), (4, 2.77644511), (10, 2.22813885), (30, 2.04227246)]:
        assert student_t_quantile(0.975, df) == pytest.approx(value, abs=1e-6)
    assert student_t_quantile(0.95, 3) == pytest.approx(2.35336343, abs=1e-6)
    assert student_t_quantile(0.025, 2) == pytest.approx(-4.30265273, abs=1e-6)
    assert student_t_quantile(0.975, 1e6) == pytest.approx(1.959964, abs=1e-4)  # the normal limit


def test_t_interval_golden():
    # mean 2, s = 1, n = 3: half width 4.30265273 / sqrt(3) = 2.48413771
    interval = t_interval([1.0, 2.0, 3.0])
    assert (interval.mean, interval.n) == (2.0, 3)
    assert interval.low == pytest.approx(2.0 - 2.48413771, abs=1e-7)
    assert interval.high == pytest.approx(2.0 + 2.48413771, abs=1e-7)
    assert not interval.excludes_zero()
    one = t_interval([0.4])
    assert (one.mean, one.low, one.high) == (0.4, None, None)
    with pytest.raises(ValueError):
        t_interval([])
    # identical paired differences: the interval is a point, and the report says so beside it (audit of
    # 2026-12-04: [0.05, 0.05] read as a tight interval; the verdict rule is unchanged)
    point = t_interval([0.05, 0.05])
    assert point.low == point.high == pytest.approx(0.05) and "no spread" in point.text()
    assert "no spread" not in interval.text()


def fake_record(levels: dict[str, str], seed: int, value: float) -> dict[str, object]:
    return {"levels": levels, "seed": seed, "summary": {"eval_last_half": value}}


def test_paired_differences_pair_seeds_with_the_baseline_of_the_same_other_levels():
    records = [
        fake_record({"method": "ppo_sync"}, 0, 0.30), fake_record({"method": "ppo_sync"}, 1, 0.40),
        fake_record({"method": "ppo_sync"}, 2, 0.50),
        # copc at s=16: +0.10, +0.12, +0.14 over the baseline seed by seed (the baseline has no s axis)
        fake_record({"method": "copc", "s": "16"}, 0, 0.40), fake_record({"method": "copc", "s": "16"}, 1,
                                                                         0.52),
        fake_record({"method": "copc", "s": "16"}, 2, 0.64),
        fake_record({"method": "copc", "s": "8"}, 0, 0.35), fake_record({"method": "copc", "s": "8"}, 5, 0.9),
    ]
    diffs = paired_differences(records, "eval_last_half", {"method": "ppo_sync"})
    interval, seeds = diffs[(("method", "copc"), ("s", "16"))]
    assert seeds == [0, 1, 2]
    # differences 0.10, 0.12, 0.14: mean 0.12, s = 0.02, half width 4.30265273 * 0.02 / sqrt(3)
    assert interval.mean == pytest.approx(0.12)
    assert interval.high - interval.mean == pytest.approx(4.30265273 * 0.02 / math.sqrt(3), abs=1e-9)
    assert interval.excludes_zero()
    interval8, seeds8 = diffs[(("method", "copc"), ("s", "8"))]  # seed 5 has no baseline partner
    assert seeds8 == [0] and interval8.mean == pytest.approx(0.05) and interval8.low is None
    text = report_text(records, ["eval_last_half"], {"method": "ppo_sync"})
    assert "method=copc s=16" in text and "0.120 [" in text and " *" in text
    # --markdown: the same figures, one table; copc s=16 is 0.40, 0.52, 0.64 (sd 0.12, half width 0.298)
    md = report_text(records, ["eval_last_half"], {"method": "ppo_sync"}, markdown=True).splitlines()
    assert "| eval_last_half | mean [95% t interval] | n | minus method=ppo_sync [95% t interval] | n |" in md
    assert "| method=ppo_sync | 0.400 [0.152, 0.648] | 3 | | |" in md
    assert "| method=copc s=16 | 0.520 [0.222, 0.818] | 3 | **0.120 [0.070, 0.170]** | 3 |" in md
    # one shared seed: no interval, not bold
    assert "| method=copc s=8 | 0.625 [-2.869, 4.119] | 2 | 0.050 | 1 |" in md


def test_records_of_one_seed_from_different_warm_starts_are_flagged():
    """Step-0 evaluations are made before any update: two records of one seed that differ there started
    from different policies (a warm start rebuilt on another CPU), so the report warns and leaves them out of
    every pair."""
    def rec(cell: str, seed: int, acc: float, greedy: float) -> dict[str, object]:
        return {"cell": cell, "seed": seed, "levels": {"method": cell.split("__")[0]},
                "summary": {"eval_final": acc},
                "evals": [{"step": 0, "accuracy": acc, "greedy_accuracy": greedy}, {"step": 9,
                                                                                    "accuracy": 0.5,
                                                                                    "greedy_accuracy": 0.5}]}
    same = [rec("a__seed0", 0, 0.385, 0.82), rec("b__seed0", 0, 0.385, 0.82), rec("a__seed1", 1, 0.42, 0.82)]
    assert start_mismatches(same) == []
    mixed = [*same, rec("b__seed1", 1, 0.21, 0.435)]
    assert start_mismatches(mixed) == [
        "seed 1: step-0 accuracy 0.21 / greedy 0.435: b__seed1; step-0 accuracy 0.42 / greedy 0.82: a__seed1"]
    assert report_text(mixed, ["eval_final"]).startswith(
        "warning: records of one seed start from different policies")
    assert "warning" not in report_text(same, ["eval_final"])
    # ... and they are not paired: seed 1 is left out of b - a, in the table and in a contrast
    _, seeds = paired_differences(mixed, "eval_final", {"method": "a"})[(("method", "b"),)]
    assert seeds == [0]
    from copc.experiments.contrasts import evaluate, parse_claim

    verdict = evaluate(parse_claim("b - a > 0"), mixed, "eval_final")
    assert verdict.seeds == (0,) and verdict.unpaired == (1,) and verdict.interval.n == 1
    # records of different tasks start from different warm starts by design and are never paired
    tasks = [{**rec("a__seed0", 0, 0.385, 0.82), "config": {"task": "arith_tool"}},
             {**rec("b__seed0", 0, 0.21, 0.435), "config": {"task": "kv_search"}}]
    assert start_mismatches(tasks) == []
    assert start_mismatches([*tasks, {**rec("c__seed0", 0, 0.2, 0.4), "config": {"task": "kv_search"}}]) == [
        "kv_search seed 0: step-0 accuracy 0.2 / greedy 0.4: "
        "c__seed0; step-0 accuracy 0.21 / greedy 0.435: b__seed0"]


def test_records_that_start_apart_by_design_are_paired_and_not_flagged():
    """An axis over what the start is made of (the warm start's model, the task's options, the evaluation)
    gives different step-0 evaluations by design: no warning, and the seeds stay paired. Before, records
    were keyed by task and seed alone, so such a sweep warned of every seed and paired none."""
    def rec(cell: str, seed: int, acc: float, **config: object) -> dict[str, object]:
        warm, method = cell.split("__")[0].split("_")
        return {"cell": cell, "seed": seed, "levels": {"warm": warm, "method": method},
                "summary": {"eval_final": acc + 0.1 * (method == "b")},
                "config": {"task": "arith_tool", "model": {"policy": "warmstart",
                                                           "warmstart_seed": int(warm)},
                           "method": method, **config},
                "evals": [{"step": 0, "accuracy": acc, "greedy_accuracy": acc}]}
    records = [rec(f"{w}_{m}__seed{s}", s,
                   0.3 + 0.1 * w + 0.01 * s) for w in (0, 1) for m in "ab" for s in (0, 1)]
    assert start_mismatches(records) == []
    assert "warning" not in report_text(records, ["eval_final"])
    diffs = paired_differences(records, "eval_final", {"method": "a"})
    assert {k: v[1] for k, v in diffs.items()} == {(("warm", "0"), ("method", "b")): [0, 1],
                                                   (("warm", "1"), ("method", "b")): [0, 1]}
    from copc.experiments.contrasts import evaluate, parse_claim

    verdict = evaluate(parse_claim("'warm=1,method=a' - 'warm=0,method=a' > 0"), records, "eval_final")
    assert verdict.seeds == (0, 1) and verdict.unpaired == ()
    # what only trains (the method, the learning rate) does not change the start: a difference there is
    # flagged
    broken = [*records[:-1], {**records[-1], "evals": [{"step": 0, "accuracy": 0.9, "greedy_accuracy": 0.9}]}]
    assert start_mismatches(broken) == [
        "arith_tool seed 1: step-0 accuracy 0.41 / greedy 0.41: "
        "1_a__seed1; step-0 accuracy 0.9 / greedy 0.9: 1_b__seed1"]
    # ... nor do the critic's model and the evaluation schedule, nor a key a record written before it existed
    # lacks (it had its default): those records are compared at step 0 too (found by a review, 2026-12-04)
    full = to_dict(load_run_config(None, ["task=arith_tool"]))
    older = json.loads(json.dumps(full))
    del older["rollout"]["dtype"]
    for changed in ({**full, "model": {**full["model"], "critic": "some-critic"}},
                    {**full, "eval": {**full["eval"], "every": 7}},
                    older):
        pair = [{"cell": "a__seed0", "seed": 0, "levels": {"method": "a"}, "config": full,
                 "summary": {"eval_final": 0.5}, "evals": [{"step": 0, "accuracy": 0.3,
                                                            "greedy_accuracy": 0.3}]},
                {"cell": "b__seed0", "seed": 0, "levels": {"method": "b"}, "config": changed,
                 "summary": {"eval_final": 0.6}, "evals": [{"step": 0, "accuracy": 0.2,
                                                            "greedy_accuracy": 0.2}]}]
        assert len(start_mismatches(pair)) == 1
        assert paired_differences(pair, "eval_final", {"method": "a"}) == {}


def test_collapse_detector_golden():
    def run(values):
        return {"evals": [{"step": 25 * i, "greedy_accuracy": v} for i, v in enumerate(values)]}

    # best 0.5 at step 50; 0.35, 0.3, 0.2 are all > 0.1 below it from step 75: a collapse at 75
    assert collapse_step(run([0.2, 0.4, 0.5, 0.35, 0.3, 0.2])) == 75
    # a dip of two evaluations that recovers is not a collapse (patience 3), nor a drop of exactly 0.1
    assert collapse_step(run([0.2, 0.5, 0.3, 0.3, 0.5, 0.4, 0.4, 0.4])) is None
    # ... however the subtraction rounds: 0.555 - 0.1 is 0.45500000000000007 in floating point, so 0.455 (of
    # 200 prompts) is exactly 0.1 below 0.555 and starts no drop (found by an audit, 2026-12-04: it did, and
    # 3b's seed 204 of the confirmation was reported collapsing at step 24 instead of 49)
    assert collapse_step(run([0.555, 0.455, 0.195, 0.045, 0.0])) == 50
    assert collapse_step(run([0.565, 0.465, 0.465, 0.465])) is None
    # the running best counts only earlier evaluations: a new best restarts the count
    assert collapse_step(run([0.5, 0.3, 0.3, 0.7, 0.5, 0.5, 0.5]), patience=3) == 100
    assert collapse_step(run([0.5, 0.3]), patience=1) == 25
    with pytest.raises(ValueError):
        collapse_step(run([0.1]), margin=0.0)


def test_collapse_counts_per_group_golden():
    def run(method, seed, values):
        return {"levels": {"method": method}, "seed": seed,
                "evals": [{"step": 25 * i, "greedy_accuracy": v} for i, v in enumerate(values)]}

    records = [run("copc", 0, [0.2, 0.5, 0.5, 0.5]), run("copc", 1, [0.2, 0.6, 0.4, 0.45, 0.3]),
               run("vtrace", 0, [0.5, 0.2, 0.2, 0.2, 0.6])]
    assert collapse_text(records).splitlines() == [
        "collapses (3 consecutive evaluations more than 0.1 below the run's best greedy_accuracy):",
        "  method=copc    1 of 2  (seed 1 at step 50)",
        "  method=vtrace  1 of 1  (seed 0 at step 25)",
    ]
    assert "0 of 2" in collapse_text(records[:2], margin=0.5)


# -------------------------------------------------------------------------------------------- records
def fake_run(run_dir: Path, steps: int, cfg_overrides: list[str]) -> dict[str, object]:
    """A finished run directory written by hand: config.yaml, metrics.jsonl (reward = step / 100, eval
    accuracy 0.1 + step / 1000 every 25 steps and at the end, step time 2 s) and summary.json."""
    cfg = load_run_config(None, [*cfg_overrides, f"steps={steps}", f"run_dir={run_dir}"])
    run_dir.mkdir(parents=True)
    dump_yaml(cfg, run_dir / "config.yaml")
    with Tracker(run_dir, tensorboard=False, strict=True) as tracker:
        tracker.log(0, {m.EVAL_ACCURACY: 0.1, m.EVAL_GREEDY_ACCURACY: 0.2})
        for step in range(steps):
            metrics = {m.REWARD_MEAN: step / 100, m.TIME_STEP: 2.0, m.TIME_GENERATE: 1.5, m.TIME_TRAIN: 0.5,
                       m.RATIO_MEAN_ABS_LOG_W: step / 1000, m.STALENESS_MEAN: 4.0}
            if step >= 5:  # the actor starts after a warm-up: no mask rate before it
                metrics[m.POLICY_MASK_FRAC] = 0.25
            if (step + 1) % 25 == 0 and step + 1 < steps:
                metrics.update({m.EVAL_ACCURACY: 0.1 + step / 1000, m.EVAL_GREEDY_ACCURACY: 0.2})
            tracker.log(step, metrics)
        tracker.log(steps, {m.EVAL_ACCURACY: 0.1 + steps / 1000, m.EVAL_GREEDY_ACCURACY: 0.3})
    (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "wall_seconds": 2.0 * steps + 30.0}))
    return to_dict(cfg)  # type: ignore[return-value]


def _run_process(run_dir: Path, start: int, steps: int, every: int) -> None:
    """One training process as copc train logs it: the evaluation after k updates at step k - 1, the
    last one alone at ``steps``; accuracy = updates / 1000, so each evaluation says which policy it saw."""
    def acc(updates: int) -> dict[str, float]:
        return {m.EVAL_ACCURACY: updates / 1000, m.EVAL_GREEDY_ACCURACY: updates / 1000}

    with Tracker(run_dir, tensorboard=False, strict=True, resume_step=start if start else None,
                 keep_resume_evaluation=0 < start < steps) as tracker:
        if start == 0:
            tracker.log(0, acc(0))
        for step in range(start, steps):
            metrics = {m.REWARD_MEAN: 0.5, m.TIME_STEP: 1.0}
            if (step + 1) % every == 0 and step + 1 < steps:
                metrics.update(acc(step + 1))
            tracker.log(step, metrics)
        tracker.log(steps, acc(steps))
    (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "wall_seconds": 1.0}))


@pytest.mark.parametrize("every, first, steps", [(50, 300, 600), (40, 300, 400)])
def test_a_run_extended_from_a_shorter_one_gets_the_record_of_a_direct_run(tmp_path, every, first, steps):
    """`copc sweep` extends a cell whose file asks for more steps (resume, larger steps). The shorter
    run's last evaluation (after `first` updates, alone at step `first`) is kept in metrics.jsonl; in the
    record it is the evaluation a direct run logs at `first - 1` when `every` divides `first`, and set
    apart otherwise (a direct run has none there), so the figures match a direct run's."""
    config = {"seed": 0, "eval": {"every": every}}
    _run_process(tmp_path / "direct", 0, steps, every)
    _run_process(tmp_path / "extended", 0, first, every)
    _run_process(tmp_path / "extended", first, steps, every)
    direct, extended = (build_record(tmp_path / d, experiment="x", cell_id=d, levels={}, config=config,
                                     machine={})
                        for d in ("direct", "extended"))
    assert extended["evals"] == direct["evals"] and extended["summary"] == direct["summary"]
    assert extended["extended_from"] == [first] and "extended_from" not in direct
    kept = [{"step": first, "accuracy": first / 1000, "greedy_accuracy": first / 1000}]
    assert extended["evals_off_schedule"] == ([] if first % every == 0 else kept)


@pytest.mark.parametrize("every", [1, 2])
def test_after_start_leaves_out_only_the_evaluation_before_any_update(tmp_path, every):
    """``eval_after_start`` is the mean over the evaluations of trained policies. With ``eval.every = 1``
    the one after the first update is logged at step 0 too (the training row's step), beside the initial
    one; it counts (it was dropped as 'step 0' before)."""
    _run_process(tmp_path / "run", 0, 6, every)
    record = build_record(tmp_path / "run", experiment="x", cell_id="c", levels={},
                          config={"seed": 0, "eval": {"every": every}},
                          machine={})
    updates = [*range(every, 6, every), 6]  # accuracy = updates / 1000 (_run_process)
    assert [e["accuracy"] for e in record["evals"]] == pytest.approx([0.0] + [u / 1000 for u in updates])
    assert record["summary"]["eval_after_start"] == pytest.approx(sum(updates) / len(updates) / 1000)


def test_subsample_curve_golden():
    assert subsample_curve([0, 1, 2, 3, 4], [0.0, 1.0, 2.0, 3.0, 4.0], points=2) == [[2, 1.0], [4, 3.5]]
    assert subsample_curve([0, 1], [5.0, 6.0], points=60) == [[0, 5.0], [1, 6.0]]
    assert subsample_curve([], []) == []


def test_curve_mean_weighs_every_step_the_same():
    """150 steps cut into 60 bins give 30 bins of 3 steps and 30 of 2: the plain mean of the bins of the
    curve y = step is 82.0, the run mean 74.5. A record keeps the exact mean; for an older record without
    it the bins' counts are recovered from their last steps."""
    steps = list(range(150))
    curve = subsample_curve(steps, [float(s) for s in steps])
    assert sum(v for _, v in curve) / len(curve) == pytest.approx(82.0)  # what the bins alone say
    assert curve_mean({"curves": {"drift": curve}}, "drift") == pytest.approx(74.5)
    assert curve_mean({"curves": {"drift": curve}, "curve_means": {"drift": 70.0}}, "drift") == 70.0
    late = list(range(5, 150))  # a curve that starts after a 5-step warm-up: 145 points, 25 bins of 3
    assert curve_mean({"curves": {"x": subsample_curve(late, [float(s) for s in late])}},
                      "x") == pytest.approx(77.0)
    assert curve_mean({"curves": {"x": [[0, 1.0], [2, 2.0], [4, 3.0]]}}, "x") is None  # gaps: counts unknown
    assert curve_mean({"curves": {"x": [[0, math.nan], [1, 2.0]]}}, "x") == 2.0
    assert curve_mean({"curves": {}}, "x") is None and curve_mean({}, "x") is None


def test_record_round_trips_and_is_small(tmp_path):
    config = fake_run(tmp_path / "run", 100, ["method=ppo"])
    record = build_record(tmp_path / "run", experiment="demo", cell_id="method=ppo__seed0",
                          levels={"method": "ppo"}, config=config, wall_seconds=300.0)
    path = write_record(tmp_path / "results" / "demo" / "method=ppo__seed0.json", record)
    assert read_record(path) == json.loads(json.dumps(record))
    assert path.stat().st_size < 24_000
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    assert record["config_hash"] == config_hash(config) and record["seed"] == 0 and record["steps"] == 100
    assert [e["step"] for e in record["evals"]] == [0, 24, 49, 74, 100]
    summary = record["summary"]
    assert summary["eval_last_half"] == pytest.approx((0.174 + 0.2) / 2)  # steps 74 and 100 are >= 50
    assert summary["eval_after_start"] == pytest.approx((0.124 + 0.149 + 0.174 + 0.2) / 4)
    assert summary["greedy_after_start"] == pytest.approx((0.2 + 0.2 + 0.2 + 0.3) / 4)
    assert summary["eval_final"] == pytest.approx(0.2) and summary["greedy_final"] == pytest.approx(0.3)
    assert summary["train_reward_last"] == pytest.approx(sum(range(80, 100)) / 20 / 100)
    assert len(record["train_reward"]) == 50 or len(record["train_reward"]) <= 60
    # the diagnostic curves, binned like the reward; a metric the run never logged has no curve
    curves = record["curves"]
    assert set(curves) == {"drift", "mask_rate", "lag_mean"}
    assert curves["drift"][0] == [1, pytest.approx(0.0005)] and curves["drift"][-1][0] == 99
    assert 0.098 <= curves["drift"][-1][1] <= 0.099
    assert curves["mask_rate"][0][0] == 6 and {v for _, v in curves["mask_rate"]} == {0.25}
    assert all(v == 4.0 for _, v in curves["lag_mean"]) and len(curves["lag_mean"]) == 60
    assert record["curve_means"] == {"drift": pytest.approx(0.0495), "mask_rate": 0.25, "lag_mean": 4.0}
    assert curve_mean({"curves": curves}, "drift") == pytest.approx(0.0495)  # recovered from the bins alone
    assert record["step_seconds"]["median"] == 2.0 and record["wall_seconds"] == 300.0
    assert {"cpu", "cpus", "python", "torch"} <= set(record["machine"])
    assert load_records(path.parent) == [read_record(path)]


def test_config_hash_ignores_where_the_run_lives_only():
    cfg = to_dict(load_run_config(None, ["run_dir=a", "resume=true"]))
    assert config_hash(cfg) == config_hash(to_dict(load_run_config(None, ["run_dir=b"])))
    assert config_hash(cfg) != config_hash(to_dict(load_run_config(None, ["seed=1"])))


def test_cell_states(tmp_path):
    cfg = fake_run(tmp_path / "run", 10, [])
    record_path = tmp_path / "rec.json"
    assert cell_state(cfg, tmp_path / "run", record_path)[0] == "finished"
    assert cell_state({**cfg, "steps": 20}, tmp_path / "run", record_path)[0] == "fresh"  # no checkpoint
    (tmp_path / "run" / "checkpoints" / "step_00000010").mkdir(parents=True)
    assert cell_state({**cfg, "steps": 20}, tmp_path / "run", record_path) == ("resume", "from step 10")
    state, detail = cell_state({**cfg, "seed": 3}, tmp_path / "run", record_path)
    assert state == "conflict" and "another config" in detail
    assert cell_state(cfg, tmp_path / "empty", record_path)[0] == "fresh"
    write_record(record_path, {"version": 1, "config_hash": config_hash(cfg)})
    assert cell_state(cfg, tmp_path / "run", record_path)[0] == "recorded"
    state, detail = cell_state({**cfg, "seed": 3}, tmp_path / "run", record_path)
    assert state == "conflict" and "move the record away" in detail
    # a record of the same config with fewer steps is extended from the run's checkpoint
    write_record(record_path, {"version": 1, "config_hash": config_hash(cfg), "config": cfg, "steps": 10})
    assert cell_state({**cfg, "steps": 20}, tmp_path / "run", record_path) == ("resume", "from step 10")
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # ... but not without one
    assert cell_state({**cfg, "steps": 20}, tmp_path / "run", record_path)[0] == "conflict"


def test_report_uses_only_records_the_cells_made_and_names_every_other(tmp_path, capsys):
    """Nothing --report prints comes from a record the file's cells did not make: a record of another
    config, or of no cell of the file, is left out and named in one line each; ``accepted_records`` (a
    hash and a reason) takes an earlier spelling of a cell's config back, and --dry-run says why."""
    data = {"experiment": "grid", "seeds": [0, 1], "shared": TINY, "report": ["eval_last_half"],
            "axes": {"method": {"ppo": ["method=ppo"], "copc": ["method=copc"]}}}
    spec_file = tmp_path / "grid.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    results, runs = tmp_path / "results", tmp_path / "runs"
    by_id = {c.cell_id: c for c in expand(load_spec(spec_file))}

    def record(cell_id: str, value: float, *extra: str) -> str:
        cell = by_id[cell_id]
        cfg = to_dict(load_run_config(None, [*cell.overrides, *extra, f"seed={cell.seed}",
                                             f"run_dir={runs / cell_id}"]))
        digest = config_hash(cfg)
        write_record(results / "grid" / f"{cell_id}.json", {"version": 1, "levels": dict(cell.levels),
                                                            "seed": cell.seed,
                                                            "config_hash": digest,
                                                            "summary": {"eval_last_half": value}})
        return digest

    for cell_id, value in [("method=ppo__seed0", 0.40), ("method=ppo__seed1", 0.42), ("method=copc__seed0",
                                                                                      0.30)]:
        record(cell_id, value)
    other = record("method=copc__seed1", 0.99, "trainer.actor_lr=3e-4")  # made by another config
    write_record(results / "grid" / "method=vtrace__seed0.json", {"levels": {"method": "vtrace"}, "seed": 0,
                                                                  "summary": {"eval_last_half": 0.77}})
    args = [str(spec_file), "--results", str(results), "--runs", str(runs)]
    capsys.readouterr()
    assert sweep_cli([*args, "--report"]) == 0
    out = capsys.readouterr().out
    assert "experiment grid: 3 of 4 cells recorded" in out
    assert (f"left out: method=copc__seed1: {results / 'grid' / 'method=copc__seed1.json'} was made by "
            f"config {other}" in out)
    assert "left out: 1 record(s) of no cell of the file: method=vtrace__seed0.json" in out
    table = out.split("records; mean")[1]
    assert "0.99" not in table and "0.77" not in table and "vtrace" not in table
    assert "method=copc  0.300" in out and "(n=1)" in out
    assert sweep_cli([*args, "--report", "--only", "seed0"]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 cells recorded" in out and "left out: 3 record(s) of no cell selected: " in out

    data["accepted_records"] = {"method=copc__seed1": {"config_hash": other,
                                                       "why": "the same computation, say why"}}
    spec_file.write_text(yaml.safe_dump(data))
    assert sweep_cli([*args, "--report"]) == 0
    out = capsys.readouterr().out
    assert "4 of 4 cells recorded" in out and "left out: method=copc" not in out and "0.645" in out
    assert sweep_cli([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "method=copc__seed1" in x)
    assert "recorded" in line and f"accepted: made by config {other} (the same computation, say why)" in line


def test_every_committed_record_is_the_record_of_a_cell_of_its_file():
    """The records under results/ are what docs/results.md reports: each must be a cell's own (made by
    the config its experiment file gives now, or accepted with a reason), and none may be no cell's."""
    from copc.experiments.sweep import Paths, report_records

    results = EXPERIMENTS.parent / "results"
    # results/ also holds what is not a sweep's: pinned warm starts, the kill-torture logs, the real-model
    # runs, the step-time sittings of the wall-clock figure (benchmarks/step_time.py --json)
    not_sweeps = {"warmstarts", "kill_torture", "real_model", "wallclock"}
    folders = {p.name for p in results.iterdir() if p.is_dir() and p.name not in not_sweeps}
    again = {"e1_e4_kv_search_warmstart_b": "e1_e4_kv_search"}  # run with --experiment (docs/reproduce.md)
    checked = set()
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        spec = load_spec(path)
        for name in [spec.experiment, *(k for k, v in again.items() if v == spec.experiment)]:
            if name not in folders:
                continue
            named = replace(spec, experiment=name)
            _, left_out = report_records(named, expand(named), Paths(results, Path("runs") / "sweep" / name))
            assert not left_out, f"{path.name} ({name}): {left_out}"
            checked.add(name)
    assert checked == folders, f"results folders of no experiment file: {sorted(folders - checked)}"


def test_estimates_count_steps_and_evaluations():
    cfg = load_run_config(None, ["steps=300", "eval.every=25", "task=kv_search", "task_options={hard: true}"])
    assert evaluations(cfg) == 13  # before, 11 during (25 .. 275), after
    assert evaluations(cfg, start=100) == 8  # 125 .. 275, after
    assert evaluations(replace(cfg, eval=replace(cfg.eval, prompts=0))) == 0
    cfg = replace(cfg, rollout=replace(cfg.rollout, prompts_per_batch=8))
    table: dict[str, dict[str, object]] = {timing_key(cfg): {"step_seconds": 2.0, "eval_seconds": 10.0}}
    assert estimate_seconds(cfg, table) == (300 * 2.0 + 13 * 10.0, "measured")
    other = load_run_config(None, ["steps=10", "task=kv_search", "task_options={hard: true}",
                                   "method=vtrace"])
    seconds, note = estimate_seconds(other, table)
    assert seconds == 10 * 2.0 + 2 * 10.0 and note.startswith("borrowed")
    assert estimate_seconds(load_run_config(None, []), table) == (None, "no measurement for this task")
    # a borrowed entry that records its episodes is scaled: 16 x 4 episodes per batch against 8 x 4, and
    # 200 x (8 samples + greedy) per evaluation against 200 x (1 + greedy)
    table[timing_key(cfg)].update({"batch_episodes": 32, "eval_episodes": 400})
    bigger = load_run_config(None, ["steps=10", "task=kv_search", "task_options={hard: true}",
                                    "rollout.prompts_per_batch=16", "eval.samples=8"])
    seconds, note = estimate_seconds(bigger, table)
    assert seconds == pytest.approx(10 * 2.0 * 2 + 2 * 10.0 * 4.5) and note.endswith("scaled by episodes")


# ------------------------------------------------------------------------------- committed YAML files
#: Experiments whose cells need what copc train cannot do yet (the file's BLOCKED comment says what).
BLOCKED = {"e2_joint_sweep.yaml"}


@pytest.mark.parametrize("name", sorted(p.name for p in EXPERIMENTS.glob("*.yaml") if p.name not in BLOCKED))
def test_committed_experiments_parse_and_every_cell_resolves(name, tmp_path):
    spec = load_spec(EXPERIMENTS / name)
    cells = expand(spec)
    assert cells and all(c.overrides for c in cells)
    for cell in cells:
        resolve(cell, tmp_path / cell.cell_id)  # fails naming the cell


def test_e2_joint_sweep_resolves_once_run_config_takes_method_overrides(tmp_path):
    spec = load_spec(EXPERIMENTS / "e2_joint_sweep.yaml")
    assert len(expand(spec)) == 3 * 4 * 3 * 2
    for cell in expand(spec):
        resolve(cell, tmp_path / cell.cell_id)


def test_kv_search_testbed_file_shares_the_testbed_settings():
    data = yaml.safe_load((EXPERIMENTS / "kv_search_testbed.yaml").read_text())
    assert set(testbed.base_overrides("kv_search")) <= set(data["shared"])
    sync, lagged = testbed.arms_for(16)
    arms = data["axes"]["arm"]
    assert set(sync.overrides) <= set(arms[sync.name]) and set(lagged.overrides) <= set(arms[lagged.name])
    # copc testbed --layout sweep --analyse-only reads the sweep's run directories
    ids = {c.cell_id for c in expand(load_spec(EXPERIMENTS / "kv_search_testbed.yaml"))}
    assert ids == {testbed.run_dir_for(Path("r"), a, s, "sweep").name for a in (sync, lagged) for s in (0, 1,
                                                                                                        2)}
    cfg = load_run_config(None, list(testbed.base_overrides("kv_search")))
    assert (cfg.task, cfg.task_options) == ("kv_search", {"hard": True})
    assert testbed.base_overrides("arith_tool") == testbed.BASE_OVERRIDES
    with pytest.raises(ValueError, match="--task must be one of"):
        testbed.base_overrides("math")


# ------------------------------------------------------------------------------------- end to end
def test_interrupted_cell_resumes_then_is_recorded_and_skipped(tmp_path, capsys):
    """A run stopped after its step-1 checkpoint (as a killed 2-step run leaves it) is resumed by the
    sweep (step 0's metrics are kept, not re-run), recorded, and skipped by the next invocation."""
    from copc.run.train import train

    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump({
        "experiment": "tiny", "seeds": [0], "shared": TINY, "axes": {"method": {"ppo": ["method=ppo"]}},
    }))
    cell = expand(load_spec(spec_file))[0]
    runs, results = tmp_path / "runs", tmp_path / "results"
    run_dir = runs / cell.cell_id
    cfg = resolve(cell, run_dir)
    train(replace(cfg, steps=1), show_progress=False)  # the first step and its checkpoint ...
    dump_yaml(cfg, run_dir / "config.yaml")  # ... of the 2-step run, killed before it ended
    (run_dir / "summary.json").unlink()
    step0 = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"step": 0' in line]
    args = [str(spec_file), "--jobs", "1", "--nice", "0", "--results", str(results), "--runs", str(runs)]
    capsys.readouterr()
    assert sweep_cli([*args, "--dry-run"]) == 0
    assert "resume   arith_tool" in capsys.readouterr().out
    assert sweep_cli(args) == 0, (runs / f"{cell.cell_id}.log").read_text()[-2000:]
    out = capsys.readouterr().out
    assert f"start {cell.cell_id} (resume)" in out and f"done  {cell.cell_id}" in out
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [line for line in rows if '"step": 0' in line] == step0  # resumed, not re-run
    assert sum(m.REWARD_MEAN in line for line in rows) == 2
    record = read_record(results / "tiny" / f"{cell.cell_id}.json")
    assert record["steps"] == 2 and record["config_hash"] == config_hash(to_dict(cfg))
    assert record["wall_seconds"] > 0 and (results / "step_times.json").is_file()
    # the next invocation skips the recorded cell, even with its run directory gone
    shutil.rmtree(run_dir)
    assert sweep_cli(args) == 0
    out = capsys.readouterr().out
    assert "start" not in out and not run_dir.exists()
    assert sweep_cli([*args, "--report", "--plot", str(tmp_path / "fig")]) == 0
    assert "1 of 1 cells recorded" in capsys.readouterr().out
    assert all((tmp_path / "fig" / f"tiny_{name}.png").stat().st_size > 0 for name in ("curves", "summary",
                                                                                       "diagnostics"))
    assert not (tmp_path / "fig" / "tiny_oracle.png").exists()  # no oracle diagnostic in this run: no figure
    assert sweep_cli([*args, "--dry-run"]) == 0
    assert "recorded" in capsys.readouterr().out


def test_commit_records_each_record_alone_and_keeps_what_else_is_staged(tmp_path, capsys):
    """--commit: a finished run's record (and the step-time table) is committed on its own; a file the
    user staged stays staged and out of the commit; without a repository the sweep still records."""
    import subprocess

    from copc.run.train import train

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump({
        "experiment": "tiny", "seeds": [0], "shared": TINY, "axes": {"method": {"ppo": ["method=ppo"]}},
    }))
    cell = expand(load_spec(spec_file))[0]
    runs, results = tmp_path / "runs", tmp_path / "results"
    train(resolve(cell, runs / cell.cell_id), show_progress=False)  # finished, no record yet
    args = [str(spec_file), "--jobs", "1", "--nice", "0", "--results", str(results), "--runs", str(runs),
            "--commit"]
    assert sweep_cli(args) == 0  # not a repository: recorded, the commit only warned
    assert "records not committed" in capsys.readouterr().out
    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "notes.txt").write_text("work in progress\n")
    git("add", "notes.txt")
    (results / "tiny" / f"{cell.cell_id}.json").unlink()  # recorded again from the finished run
    assert sweep_cli(args) == 0
    assert "committed: results: tiny records (1 so far)" in capsys.readouterr().out
    committed = git("show", "--name-only", "--format=%s", "HEAD").split()
    assert f"results/tiny/{cell.cell_id}.json" in committed and "results/step_times.json" in committed
    assert "notes.txt" not in committed and git("diff", "--cached", "--name-only").split() == ["notes.txt"]


def test_eval_curves_collect_each_seed_per_step_and_the_figures_are_drawn(tmp_path):
    from copc.experiments.figures import eval_curves, plot_curves, plot_summary

    records = [
        {"levels": {"method": "copc"}, "seed": s, "summary": {"eval_last_half": 0.3 + 0.1 * s},
         "evals": [{"step": 0, "accuracy": 0.1}, {"step": 25, "accuracy": 0.2 + 0.1 * s}]}
        for s in range(3)
    ] + [{"levels": {"method": "ppo"}, "seed": 0, "summary": {"eval_last_half": 0.5},
          "evals": [{"step": 0, "accuracy": 0.1, "greedy_accuracy": 0.4}]}]
    curves = eval_curves(records, "accuracy")
    assert curves["method=copc"] == {0: [0.1, 0.1, 0.1], 25: pytest.approx([0.2, 0.3, 0.4])}
    assert curves["method=ppo"] == {0: [0.1]}
    assert eval_curves(records, "greedy_accuracy") == {"method=ppo": {0: [0.4]}}
    assert plot_curves(records, ["accuracy"], tmp_path / "c.png", title="t").stat().st_size > 0
    assert plot_summary(records, ["eval_last_half"], tmp_path / "s.png", title="t").stat().st_size > 0


def test_diagnostic_curves_are_seed_means_per_bin_and_drawn(tmp_path):
    """The records' binned diagnostic curves (drift, mask rate, ...) as seed means per bin: a record
    without a curve adds nothing to it, and a bin only some seeds have is the mean of those."""
    from copc.experiments.figures import diagnostic_curves, plot_diagnostics

    def rec(method, seed, drift, mask=None):
        curves = {"drift": drift} if mask is None else {"drift": drift, "mask_rate": mask}
        return {"levels": {"method": method}, "seed": seed, "curves": curves}

    records = [rec("copc", 0, [[2, 0.1], [5, 0.3]], [[7, 0.01]]), rec("copc", 1, [[2, 0.3], [5, 0.5], [8,
                                                                                                       0.9]]),
               rec("ppo", 0, [[2, 0.0]])]
    drift = diagnostic_curves(records, "drift")
    assert drift == {"method=copc": {2: pytest.approx([0.1, 0.3]), 5: pytest.approx([0.3, 0.5]), 8: [0.9]},
                     "method=ppo": {2: [0.0]}}
    assert diagnostic_curves(records, "mask_rate") == {"method=copc": {7: [0.01]}}
    out = plot_diagnostics(records, ["drift", "mask_rate", "ess_seq"], tmp_path / "d.png", title="t")
    assert out is not None and out.stat().st_size > 0
    # no data: no figure
    assert plot_diagnostics(records, ["ess_seq"], tmp_path / "none.png", title="t") is None


def test_the_oracle_figure_draws_curves_that_records_carry(tmp_path):
    """Every oracle panel names a curve the records keep, and a record with oracle curves draws them."""
    from copc.experiments.figures import plot_diagnostics
    from copc.experiments.report import ORACLE_PANELS
    from copc.experiments.results import DIAGNOSTIC_CURVES

    assert set(ORACLE_PANELS) <= set(DIAGNOSTIC_CURVES)
    records = [{"levels": {"arm": "async_ppo"}, "seed": 0,
                "curves": {"oracle_gae_excess": [[25, 0.2], [50, 0.1]],
                           "oracle_clipped_td_minus_gae": [[25, -0.01]]}}]
    out = plot_diagnostics(records, ORACLE_PANELS, tmp_path / "o.png", title="t")
    assert out is not None and out.stat().st_size > 0


def test_a_record_made_before_a_config_field_existed_still_counts(tmp_path):
    """A field added to the config later, at its default, does not change what an earlier run computed:
    its record (whose config lacks the key, and whose hash was taken without it) is still the cell's."""
    cfg = to_dict(load_run_config(None, ["method=copc", "seed=2"]))
    old = json.loads(json.dumps(cfg))
    del old["trainer"]["old_forward_reuse"]  # as written by code before the field existed
    write_record(tmp_path / "rec.json", {"version": 1, "config_hash": config_hash(old), "config": old,
                                         "steps": cfg["steps"]})
    assert cell_state(cfg, tmp_path / "run", tmp_path / "rec.json")[0] == "recorded"
    changed = json.loads(json.dumps(cfg))
    changed["trainer"]["old_forward_reuse"] = True  # the same key at another value is another config
    assert cell_state(changed, tmp_path / "run", tmp_path / "rec.json")[0] == "conflict"
    broken = {**old, "no_such_section": {}}  # a record no current config can read is a conflict, not a crash
    write_record(tmp_path / "rec.json", {"version": 1, "config_hash": config_hash(broken), "config": broken,
                                         "steps": 1})
    assert cell_state(cfg, tmp_path / "run", tmp_path / "rec.json")[0] == "conflict"


def test_fields_that_act_only_on_faults_leave_the_config_hash_unchanged(tmp_path):
    """Issue 34, item 3: driver.silent_worker_warn_s and silent_worker_restart_s (they act only on a
    stopped worker) are not hashed: a record made before they existed (its config lacks them) has
    today's hash, whatever values today's config gives them; a hashed field still changes it."""
    from copc.experiments.results import UNHASHED_NESTED_KEYS

    cfg = to_dict(load_run_config(None, ["method=copc", "seed=2"]))
    old = json.loads(json.dumps(cfg))
    for dotted in UNHASHED_NESTED_KEYS:
        section, field = dotted.split(".")
        del old[section][field]  # as written by code before the fields existed
    assert config_hash(old) == config_hash(cfg)
    other = to_dict(load_run_config(None, ["method=copc", "seed=2", "driver.silent_worker_warn_s=5",
                                           "driver.silent_worker_restart_s=0",
                                           "trainer.gradient_checkpointing=always"]))
    assert config_hash(other) == config_hash(cfg)
    assert config_hash(to_dict(load_run_config(None, ["method=copc", "seed=2",
                                                      "driver.batch_timeout_s=5"]))) \
        != config_hash(cfg)
    write_record(tmp_path / "rec.json", {"version": 1, "config_hash": config_hash(old), "config": old,
                                         "steps": cfg["steps"]})
    assert read_record(tmp_path / "rec.json")["config_hash"] == config_hash(other)
    assert cell_state(other, tmp_path / "run", tmp_path / "rec.json")[0] == "recorded"


def test_only_takes_several_substrings(tmp_path, capsys):
    spec_file = tmp_path / "grid.yaml"
    spec_file.write_text(yaml.safe_dump({
        "experiment": "grid", "seeds": [0, 1], "shared": TINY,
        "axes": {"method": {"ppo": ["method=ppo"], "copc": ["method=copc"], "vtrace": ["method=vtrace"]}},
    }))
    args = [str(spec_file), "--dry-run", "--results", str(tmp_path / "results"), "--runs",
            str(tmp_path / "runs")]
    capsys.readouterr()
    assert sweep_cli([*args, "--only", "method=copc,method=vtrace"]) == 0
    out = capsys.readouterr().out
    assert "method=copc__seed1" in out and "method=vtrace__seed0" in out and "method=ppo__seed" not in out
    assert sweep_cli([*args, "--only", "method=dapo,seed7"]) == 2
    assert "no cell id contains any of 'method=dapo', 'seed7'" in capsys.readouterr().err


def test_experiment_runs_the_grid_again_under_another_name(tmp_path, capsys):
    """--experiment keeps the cells and configs and moves the records (a grid run again from another warm
    start)."""
    spec_file = tmp_path / "grid.yaml"
    spec_file.write_text(yaml.safe_dump({"experiment": "grid", "seeds": [0], "shared": TINY,
                                         "axes": {"method": {"ppo": ["method=ppo"]}}}))
    results = tmp_path / "results"
    (results / "grid").mkdir(parents=True)
    (results / "grid" / "method=ppo__seed0.json").write_text("{}")  # the first run's record: not this one's
    capsys.readouterr()
    assert sweep_cli([str(spec_file), "--dry-run", "--results", str(results), "--experiment", "grid_b"]) == 0
    out = capsys.readouterr().out
    assert f"records in {results / 'grid_b'}" in out and "fresh" in out and "recorded" not in out


def _sweep_training_one_cell(tmp_path: Path):
    """A ``copc sweep`` subprocess over one long tiny cell, returned once the cell has logged two steps:
    ``(sweep process, spec file, runs folder, the cell's run dir)``."""
    import subprocess
    import sys
    import time

    spec_file = tmp_path / "long.yaml"
    spec_file.write_text(yaml.safe_dump({
        "experiment": "long", "seeds": [0], "shared": [*TINY, "steps=100000"],
        "axes": {"method": {"ppo": ["method=ppo"]}},
    }))
    runs = tmp_path / "runs"
    cell = expand(load_spec(spec_file))[0]
    code = ("import sys; from copc.experiments.sweep_cli import sweep_cli; "
            f"sys.exit(sweep_cli([{str(spec_file)!r}, '--jobs', '1', '--nice', '0', '--runs', {str(runs)!r}, "
            f"'--results', {str(tmp_path / 'results')!r}]))")
    sweep = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    metrics = runs / cell.cell_id / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count('"step"') >= 2):  # the cell is training
        if sweep.poll() is not None or time.monotonic() > deadline:
            sweep.kill()
            raise AssertionError("the cell never started training")
        time.sleep(0.2)
    return sweep, spec_file, runs, runs / cell.cell_id


def test_a_sweep_stopped_with_sigterm_stops_its_cell_and_counts_its_wall_time(tmp_path):
    """A queue stopped with ``kill`` (SIGTERM) ends like Ctrl-C: the running cell is stopped with its
    checkpoints kept, and the seconds it ran are added to the cell's wall time (by default SIGTERM ended
    the sweep with neither, and a resumed cell's record under-counted its machine time)."""
    import signal
    import subprocess

    sweep, _, _, run_dir = _sweep_training_one_cell(tmp_path)
    try:
        sweep.send_signal(signal.SIGTERM)
        sweep.wait(timeout=90)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 128 + signal.SIGTERM
    wall = json.loads((run_dir / "sweep_wall.json").read_text())["wall_seconds"]
    assert wall > 0
    holder = subprocess.run(["pgrep", "-f", f"run_dir={run_dir}"], capture_output=True, text=True)
    assert holder.stdout.strip() == "", "the cell's train process outlived the sweep"


def test_a_cell_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    """A cell stuck where no signal handler runs (2026-12-02: a grader inside one big-integer power) does
    not outlive its stopped sweep: after the grace it is killed (before, the sweep died of the timeout
    and left the cell running alone)."""
    import signal
    import subprocess
    import sys
    import time

    spec_file = tmp_path / "stuck.yaml"
    spec_file.write_text(yaml.safe_dump({"experiment": "stuck", "seeds": [0], "shared": TINY,
                                         "axes": {"method": {"ppo": ["method=ppo"]}}}))
    ready = tmp_path / "ready"
    stuck = (f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"open({str(ready)!r}, 'w').close(); time.sleep(600)")
    code = ("import sys; import copc.experiments.sweep as sweep; from copc.experiments.sweep_cli import "
            "sweep_cli; sweep.STOP_GRACE_SECONDS = 1.0; "
            f"sweep.train_command = lambda cell, run_dir, resume, nice: [sys.executable, '-c', {stuck!r}]; "
            f"sys.exit(sweep_cli([{str(spec_file)!r}, '--jobs', '1', '--nice', '0', "
            f"'--runs', {str(tmp_path / 'runs')!r}, '--results', {str(tmp_path / 'results')!r}]))")
    sweep = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert sweep.poll() is None and time.monotonic() < deadline, "the cell never started"
            time.sleep(0.1)
        sweep.send_signal(signal.SIGTERM)
        out, _ = sweep.communicate(timeout=60)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 128 + signal.SIGTERM
    assert "still running 1 s after SIGTERM, killed" in out
    left = subprocess.run(["pgrep", "-f", str(ready)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "the stuck cell outlived the sweep"


def test_a_sweep_killed_with_sigkill_takes_its_cell_along_and_a_new_sweep_resumes_it(tmp_path):
    """Issue 34 (14): ``copc sweep`` killed with SIGKILL left its running cell training as an orphan; a
    restarted sweep said "skipped, pid N is training" and exited 0 with the record missing. The cell now
    gets SIGTERM when its sweep dies (it stops at a checkpoint) and the next sweep resumes it."""
    import subprocess
    import sys
    import time

    from copc.run.build import run_dir_holder

    sweep, spec_file, runs, run_dir = _sweep_training_one_cell(tmp_path)
    try:
        sweep.kill()
        sweep.wait(timeout=30)
        deadline = time.monotonic() + 90
        while run_dir_holder(run_dir) is not None:
            assert time.monotonic() < deadline, "the cell's train process outlived its SIGKILLed sweep"
            time.sleep(0.2)
    finally:
        if sweep.poll() is None:
            sweep.kill()
        subprocess.run(["pkill", "-f", f"run_dir={run_dir}"], check=False)
    assert (run_dir / "checkpoints").is_dir()
    dry = subprocess.run([sys.executable, "-m", "copc.cli", "sweep", str(spec_file), "--dry-run", "--runs",
                          str(runs),
                          "--results", str(tmp_path / "results")], capture_output=True, text=True,
                          timeout=120)
    assert "resume" in dry.stdout and "skipped" not in dry.stdout, dry.stdout


def test_a_sweep_file_with_a_key_given_twice_is_refused_not_read_as_its_last(tmp_path):
    """PyYAML keeps the last of two equal keys, so a doubled arm used to drop the first silently."""
    path = tmp_path / "dup.yaml"
    path.write_text(
        "experiment: dup\nseeds: [0]\naxes:\n  arm:\n    a: [method=ppo]\n    a: "
        "[method=async_ppo]\nbaseline: {arm: a}\n"
    )
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert "'a'" in str(err.value) and "twice" in str(err.value) and "\n" not in str(err.value)
    path.write_bytes(b"experiment: \xff\n")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec(path)
    path.write_text("experiment: e\nseeds: [0]\naxes:\n  lr:\n    1e-4: [trainer.actor_lr=1e-4]\n")
    assert [c.levels for c in expand(load_spec(path))] == [(("lr", "1e-4"),)]  # a level reads as written


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"axes": {"arm": {"a": ["method=ppo"]}, "arm2": {"x": ["method=async_ppo"]}}},
         "axes arm=a and arm2=x both set method"),
        ({"shared": ["seed=5"], "axes": {"arm": {"a": ["method=ppo"]}}}, "shared sets seed"),
        ({"axes": {"arm": {"a": ["method=ppo", "run_dir=/tmp/x"]}}}, "axes.arm.a sets run_dir"),
    ],
)
def test_an_override_the_cell_would_lose_silently_is_refused(data, match):
    """Two axes setting one key ran the later (cell arm=a__arm2=x trained async_ppo), and a shared seed or
    run_dir was replaced by the sweep's own."""
    with pytest.raises(SpecError, match=match):
        parse_spec({"experiment": "e", "seeds": [0], **data}, "e.yaml")
    # an axis may refine shared
    parse_spec({"experiment": "e", "seeds": [0], "shared": ["trainer.actor_lr=1e-4"],
                "axes": {"lr": {"small": ["trainer.actor_lr=2.5e-5"]}}}, "e.yaml")
