"""The two-knob analysis of E2 (copc.experiments.interaction) and Fisher's F tail it uses."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from copc.experiments.interaction import (
    holm,
    lab_prediction,
    panel_values,
    rank_correlation,
    two_way,
    two_way_text,
)
from copc.experiments.stats import f_survival, student_t_quantile


def test_f_survival_matches_closed_forms():
    # df1 = 2: P(F > f) = (1 + 2 f / d2)^(-d2 / 2) exactly.
    for f, d2 in [(0.5, 3), (3.0, 11), (10.0, 1), (1.7, 40)]:
        assert f_survival(f, 2, d2) == pytest.approx((1 + 2 * f / d2) ** (-d2 / 2), rel=1e-10)
    # df1 = 1: F = t^2, so the 97.5% t quantile squared has a 5% two-sided tail.
    for d2 in (1, 3, 5, 11):
        assert f_survival(student_t_quantile(0.975, d2) ** 2, 1, d2) == pytest.approx(0.05, abs=1e-9)
    # The printed table value F_0.95(6, 11) = 3.0946.
    assert f_survival(3.0946, 6, 11) == pytest.approx(0.05, abs=2e-5)
    assert f_survival(0.0, 3, 4) == 1.0


def grid_values(y: np.ndarray, rows: list[str], cols: list[str]) -> dict[tuple[str, str], dict[int, float]]:
    """``y[s, i, j]`` as the analysis's input."""
    return {(r, c): {s: float(y[s, i, j]) for s in range(y.shape[0])} for i, r in enumerate(rows)
            for j, c in enumerate(cols)}


def test_two_way_golden_values_worked_by_hand():
    # Seeds 0 and 1 of a 2 x 2 grid; by hand: cell means [[1.5, 2], [3.5, 7]], grand 3.5, interaction
    # residuals +-0.75, SS_int = 2 * 4 * 0.5625 = 4.5, SS_total = 40, SS_seed = 2, SS_row = 24.5,
    # SS_col = 8, SS_err = 1 on (2 - 1)(4 - 1) = 3 df, so F(1, 3) = 4.5 / (1 / 3) = 13.5.
    y = np.array([[[1, 2], [3, 6]], [[2, 2], [4, 8]]], dtype=float)
    result = two_way(grid_values(y, ["a0", "a1"], ["b0", "b1"]), ["a0", "a1"], ["b0", "b1"])
    np.testing.assert_allclose(result.means, [[1.5, 2.0], [3.5, 7.0]], rtol=0, atol=1e-15)
    assert result.f == pytest.approx(13.5, rel=1e-12)
    assert result.df == (1, 3)
    # t with 3 df has a closed-form CDF: P(|T| > t) = 1 - (2/pi)(x / (1 + x^2) + atan x), x = t / sqrt 3.
    x = math.sqrt(13.5) / math.sqrt(3)
    assert result.p == pytest.approx(1 - 2 / math.pi * (x / (1 + x * x) + math.atan(x)), rel=1e-9)
    # Share of the cell means: 4 * 0.75^2 / ((-2)^2 + (-1.5)^2 + 0 + 3.5^2) = 2.25 / 18.5.
    assert result.share == pytest.approx(2.25 / 18.5, rel=1e-12)
    # The column step b0 -> b1 at a0 is 0.5, at a1 3.5, each -+ t sqrt(2 (1/3) / 2), t at the Bonferroni
    # level over the panel's 4 steps (two column steps, two row steps): 1 - 0.05 / (2 * 4).
    half = student_t_quantile(1 - 0.05 / 8, 3) * math.sqrt(1 / 3)
    at = {(s.axis, s.at): s.interval for s in result.steps}
    assert (at[("col", "a0")].mean, at[("col", "a0")].low) == pytest.approx((0.5, 0.5 - half), rel=1e-12)
    assert (at[("col", "a1")].mean, at[("col", "a1")].high) == pytest.approx((3.5, 3.5 + half), rel=1e-12)
    assert (at[("row", "b1")].mean) == pytest.approx(5.0, rel=1e-12)
    assert result.reversals() == []
    # One contrast: (7 - 3.5) - (2 - 1.5) = 3, -+ t_{0.975,3} sqrt(4 (1/3) / 2); its square over the
    # contrast's variance is the F: 9 / (2/3) = 13.5.
    (contrast,) = result.contrasts
    assert (contrast.col_src, contrast.col_dst, contrast.row_src, contrast.row_dst) == ("b0", "b1", "a0",
                                                                                        "a1")
    assert contrast.interval.mean == pytest.approx(3.0, rel=1e-12)
    assert contrast.interval.high - 3.0 == pytest.approx(student_t_quantile(0.975, 3) * math.sqrt(2 / 3),
                                                         rel=1e-12)
    assert contrast.interval.mean**2 / (2 / 3) == pytest.approx(result.f, rel=1e-12)


def slow_sums(y: np.ndarray) -> tuple[float, float]:
    """SS_int and SS_err of the randomized-block layout, one element at a time."""
    n, rows, cols = y.shape
    cell = [[sum(y[s][i][j] for s in range(n)) / n for j in range(cols)] for i in range(rows)]
    row = [sum(cell[i]) / cols for i in range(rows)]
    col = [sum(cell[i][j] for i in range(rows)) / rows for j in range(cols)]
    seed = [sum(y[s][i][j] for i in range(rows) for j in range(cols)) / (rows * cols) for s in range(n)]
    grand = sum(row) / rows
    ss_int = ss_err = 0.0
    for s in range(n):
        for i in range(rows):
            for j in range(cols):
                ss_int += (cell[i][j] - row[i] - col[j] + grand) ** 2
                ss_err += (y[s][i][j] - cell[i][j] - seed[s] + grand) ** 2
    return ss_int, ss_err


def test_two_way_matches_a_per_element_loop():
    rng = np.random.default_rng(3)
    y = rng.normal(size=(3, 3, 4)) + np.arange(4)[None, None, :] * 0.3
    rows, cols = ["r0", "r1", "r2"], ["c0", "c1", "c2", "c3"]
    result = two_way(grid_values(y, rows, cols), rows, cols)
    ss_int, ss_err = slow_sums(y)
    df_int, df_err = 6, 2 * 11
    assert result.df == (df_int, df_err)
    assert result.f == pytest.approx((ss_int / df_int) / (ss_err / df_err), rel=1e-10)


def test_reversal_is_held_only_when_both_intervals_exclude_zero():
    rows, cols = ["none", "band"], ["w1", "clip"]
    base = np.array([[0.2, 0.5], [0.5, 0.2]])  # the clip helps without the mask and hurts with it
    noise = np.array([[[0.01, -0.01], [0.0, 0.01]], [[-0.01, 0.0], [0.01, -0.01]], [[0.0, 0.01], [-0.01,
                                                                                                  0.0]]])
    result = two_way(grid_values(base[None] + noise, rows, cols), rows, cols, row_axis="mask",
                     col_axis="clip")
    reversals = result.reversals()
    assert {(up.axis, up.at, down.at) for up, down in reversals} == {("clip", "none", "band"), ("mask", "w1",
                                                                                                "clip")}
    assert result.p is not None and result.p < 1e-4
    text = two_way_text(result, "eval_last_half", "s=16: ")
    assert "simultaneous over the panel's 4 steps): clip w1 -> clip" in text
    assert "clip w1 -> clip, mask none -> band: -0.600" in text
    # The same means with noise far larger than the effect: nothing is held.
    loud = two_way(grid_values(base[None] + 30 * noise, rows, cols), rows, cols)
    assert loud.reversals() == []


def test_one_seed_gives_means_without_a_test():
    y = np.array([[[1.0, 2.0], [3.0, 5.0]]])
    result = two_way(grid_values(y, ["a", "b"], ["x", "y"]), ["a", "b"], ["x", "y"])
    assert result.f is None and result.p is None and result.df == (1, 0)
    assert all(s.interval.low is None for s in result.steps)
    assert "needs >= 2 complete seeds" in two_way_text(result, "m")


def test_no_seed_to_seed_variation_gives_no_test_and_non_finite_values_are_refused():
    # Seeds identical up to an offset: the seed block explains every difference, the error term is 0.
    y = np.array([[[1.0, 2.0], [3.0, 5.0]], [[2.0, 3.0], [4.0, 6.0]]])
    result = two_way(grid_values(y, ["a", "b"], ["x", "y"]), ["a", "b"], ["x", "y"])
    assert result.f is None and result.p is None and result.reversals() == []
    assert "no seed-to-seed variation" in two_way_text(result, "m")
    y[1, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="cell row=a col=y has a non-finite value"):
        two_way(grid_values(y, ["a", "b"], ["x", "y"]), ["a", "b"], ["x", "y"])
    one_row = two_way({("a", "x"): {0: 1.0, 1: 2.0}, ("a", "y"): {0: 1.5, 1: 2.0}}, ["a"], ["x", "y"])
    assert one_row.p is None and "no interaction to test" in one_row.note


def test_holm_adjusts_step_down_in_the_input_order():
    # Sorted 0.01, 0.03, 0.04: x3 = 0.03, x2 = 0.06, x1 = 0.04 -> kept monotone at 0.06.
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def test_missing_cells_and_seeds_are_named():
    values = {("a", "x"): {0: 1.0, 1: 2.0}, ("a", "y"): {0: 1.0}, ("b", "x"): {1: 1.0}}
    with pytest.raises(ValueError, match="cell row=b col=y has no record"):
        two_way(values, ["a", "b"], ["x", "y"])
    values[("b", "y")] = {1: 3.0}
    with pytest.raises(ValueError, match="no seed is recorded in every cell"):
        two_way(values, ["a", "b"], ["x", "y"])


def test_panel_values_groups_records_by_the_panel_axis():
    records = [{"levels": {"mask": m, "clip": c, "s": s}, "seed": seed, "summary": {"eval_last_half": v}}
               for (m, c, s, seed, v) in [("none", "w1", "8", 0, 0.1), ("none", "w1", "8", 1, 0.2),
                                          ("none", "w1", "16", 0, 0.3), ("band", "w1", "16", 0, 0.4)]]
    panels = panel_values(records, "eval_last_half", "mask", "clip", "s")
    assert panels == {"8": {("none", "w1"): {0: 0.1, 1: 0.2}}, "16": {("none", "w1"): {0: 0.3},
                                                                      ("band", "w1"): {0: 0.4}}}
    with pytest.raises(ValueError, match="records have no axis 'lag'"):
        panel_values(records, "eval_last_half", "mask", "clip", "lag")


def test_lab_prediction_maps_levels_and_averages_families(tmp_path):
    # relative_mse at N = (bias^2 + var_trace / N) / g*^2 (copc.lab.sweep.mean_grid), here g* = 1.
    config = {"families": ["sparse", "dense"], "seeds": [0], "staleness": [8.0, 16.0], "mask_bands": [1.25,
                                                                                                      "inf"],
              "adv_clips": [0.0, 1.0], "batch_size": 64}
    cells = [{"family": f, "seed": 0, "staleness": s, "mask_band": b, "adv_clip": e, "g_star_norm": 1.0,
              "bias_norm": bias, "var_trace": 64.0 * k}
             for f, k in (("sparse", 1.0), ("dense", 3.0)) for s in (8.0, 16.0)
             for b, bias in ((1.25, 1.0), ("inf", 2.0)) for e in (0.0, 1.0)]
    path = tmp_path / "lab_sweep_t.json"
    path.write_text(json.dumps({"config": config, "cells": cells}))
    grid = lab_prediction(path, {"none": math.inf, "0.8-1.25": 1.25}, {"w1": 0.0, "0.5-2": 1.0}, 16)
    # rows none (bias 2), 0.8-1.25 (bias 1); var/N = 1 (sparse) and 3 (dense): means 4 + 2 and 1 + 2.
    np.testing.assert_allclose(grid, [[6.0, 6.0], [3.0, 3.0]], rtol=1e-12)
    with pytest.raises(ValueError, match="has no staleness 12"):
        lab_prediction(path, {"none": math.inf}, {"w1": 0.0}, 12)
    with pytest.raises(ValueError, match=re.escape("has no advantage clip 0.2")):
        lab_prediction(path, {"none": math.inf}, {"w1": 0.2}, 8)


def test_rank_correlation():
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert rank_correlation(a, 10 * a + 1) == pytest.approx(1.0)
    assert rank_correlation(a, -a) == pytest.approx(-1.0)
    # Ties take their mean rank: ranks of [1, 1, 2, 3] are [0.5, 0.5, 2, 3].
    b = np.array([[1.0, 1.0], [2.0, 3.0]])
    ra, rb = np.array([0, 1, 2, 3.0]) - 1.5, np.array([0.5, 0.5, 2, 3]) - 1.5
    assert rank_correlation(a, b) == pytest.approx(float(ra @ rb / math.sqrt((ra @ ra) * (rb @ rb))),
                                                   rel=1e-12)


def joint_spec(tmp_path, lab: dict | None = None):
    from copc.experiments.sweep_spec import parse_spec

    data = {"experiment": "joint", "seeds": [0, 1, 2], "shared": ["steps=4"],
            "axes": {"mask": {"none": ["trainer.actor_lr=1e-4"], "band": ["trainer.actor_lr=2e-4"]},
                     "clip": {"w1": ["trainer.critic_lr=1e-3"], "clip": ["trainer.critic_lr=2e-3"]},
                     "s": {"key": "staleness.staleness", "values": [8, 16]}},
            "report": ["eval_last_half"], "heatmap": {"rows": "mask", "cols": "clip", "panels": "s"}}
    if lab is not None:
        data["heatmap"]["lab"] = lab
    return parse_spec(data, "joint.yaml")


def test_a_heatmap_refuses_an_axis_it_would_average_away():
    from copc.experiments.sweep_spec import SpecError, parse_spec

    data = {"experiment": "joint", "axes": {"mask": {"none": ["a=1"], "band": ["a=2"]},
                                            "clip": {"w1": ["b=1"], "clip": ["b=2"]},
                                            "lr": {"lo": ["c=1"], "hi": ["c=2"]}},
            "heatmap": {"rows": "mask", "cols": "clip"}}
    with pytest.raises(SpecError, match="axis 'lr' is neither rows, cols nor panels"):
        parse_spec(data, "joint.yaml")
    parse_spec({**data, "heatmap": {"rows": "mask", "cols": "clip", "panels": "lr"}}, "joint.yaml")


@pytest.mark.parametrize("heatmap, needle", [
    ({"rows": "mask"}, "expected {rows: AXIS, cols: AXIS"),
    ({"rows": "mask", "cols": "lag"}, "heatmap.cols: unknown axis 'lag'"),
    ({"rows": "mask", "cols": "clip", "lab": {"json": "x.json", "rows": {"none": 1.25, "band": 2},
                                              "cols": {"w1": 0, "clip": 1}}},
     "heatmap: a lab: section needs panels"),
    ({"rows": "mask", "cols": "clip", "panels": "s", "lab": {"json": "x.json", "rows": {"none": 1.25},
                                                             "cols": {"w1": 0, "clip": 1}}},
     "heatmap.lab.rows: map every level of axis 'mask' (none, band)"),
    ({"rows": "mask", "cols": "clip", "panels": "s",
      "lab": {"json": "x.json", "rows": {"none": "x", "band": 2}, "cols": {"w1": 0, "clip": 1}}},
     "heatmap.lab.rows: the values must be numbers"),
    ({"rows": "mask", "cols": "clip", "panels": "s", "lab": {"json": "x.json", "rows": {"none": 1, "band": 2},
                                                             "cols": {"w1": 0, "clip": 1}, "batch": 0}},
     "heatmap.lab.batch: the lab's batch size N must be an integer >= 1"),
])
def test_bad_heatmap_section_fails_in_one_line_naming_it(heatmap, needle):
    from copc.experiments.sweep_spec import SpecError, parse_spec

    data = {"experiment": "joint", "axes": {"mask": {"none": ["a=1"], "band": ["a=2"]},
                                            "clip": {"w1": ["b=1"], "clip": ["b=2"]},
                                            "s": {"key": "staleness.staleness", "values": [8]}},
            "heatmap": heatmap}
    with pytest.raises(SpecError, match=re.escape(needle)):
        parse_spec(data, "joint.yaml")


def test_report_of_a_joint_sweep_prints_each_panel_and_draws_the_heatmaps(tmp_path, capsys):
    from copc.config import to_dict
    from copc.experiments.interaction import heatmap_panels
    from copc.experiments.report import print_report
    from copc.experiments.results import config_hash, load_records, write_record
    from copc.experiments.sweep import Paths, resolve
    from copc.experiments.sweep_spec import expand

    config = {"families": ["sparse"], "seeds": [0], "staleness": [8.0, 16.0], "mask_bands": [1.25, "inf"],
              "adv_clips": [0.0, 1.0], "batch_size": 64}
    cells = [{"family": "sparse", "seed": 0, "staleness": s, "mask_band": b, "adv_clip": e,
              "g_star_norm": 1.0,
              "bias_norm": 1.0 + (b == "inf") + 0.5 * e, "var_trace": 0.0}
             for s in (8.0, 16.0) for b in (1.25, "inf") for e in (0.0, 1.0)]
    (tmp_path / "lab.json").write_text(json.dumps({"config": config, "cells": cells}))
    # The lab's rows are given in another order than the axis's: the grid must follow the axis.
    spec = joint_spec(tmp_path, {"json": str(tmp_path / "lab.json"), "rows": {"band": 1.25, "none": math.inf},
                                 "cols": {"clip": 1.0, "w1": 0.0}})
    means = {("none", "w1"): 0.2, ("none", "clip"): 0.5, ("band", "w1"): 0.5, ("band", "clip"): 0.2}
    cells, paths = expand(spec), Paths(tmp_path / "results", tmp_path / "runs")
    folder = paths.results / spec.experiment
    by_id = {c.cell_id: c for c in cells}

    def record(mask: str, clip: str, s: int, seed: int, value: float) -> None:
        cell = by_id[f"mask={mask}__clip={clip}__s={s}__seed{seed}"]
        digest = config_hash(to_dict(resolve(cell, paths.run_dir(cell))))
        write_record(paths.record(spec.experiment, cell), {"levels": dict(cell.levels), "seed": seed,
                                                           "config_hash": digest,
                                                           "summary": {"eval_last_half": value}})

    for seed, jitter in enumerate((0.01, -0.01, 0.0)):
        for (mask, clip), mean in means.items():
            record(mask, clip, 16, seed, mean + jitter * (1 if clip == "w1" else -1))
    record("none", "w1", 8, 0, 0.1)
    print_report(spec, cells, paths, baseline=None, collapse=None, plot_dir=tmp_path / "fig")
    out = capsys.readouterr().out
    assert "s=8: eval_last_half: 1 of 4 cells recorded" in out
    assert "s=16: eval_last_half, seed mean over seeds 0, 1, 2" in out
    assert "interaction F(1, 6)" in out
    assert "reversal (95% intervals simultaneous over the panel's 4 steps): clip w1 -> clip" in out
    assert (
        "interaction (primary metric, Holm over 1 panel(s)): adjusted p = " in out and ": held at 5%" in out)
    # Lab MSE = bias^2: none (bias 2, 2.5), band (1, 1.5), rows and columns in the axes' order.
    (panel16,) = [p for p in heatmap_panels(load_records(folder), spec, "eval_last_half") if p.level == "16"]
    np.testing.assert_allclose(panel16.lab, [[4.0, 6.25], [1.0, 2.25]], rtol=1e-12)
    assert ("lab, analogous cells (exact relative MSE at N=64 on tiny MDPs, lower is better): best mask=band "
            "clip=w1" in out)
    assert (tmp_path / "fig" / "joint_heatmaps.png").stat().st_size > 0


def test_a_missing_lab_json_fails_the_report_in_one_line(tmp_path, capsys):
    import yaml

    from copc.experiments.sweep_cli import sweep_cli
    from copc.experiments.sweep_spec import load_spec
    from reference.sweep_records import write_cell_record

    spec = {"experiment": "joint", "seeds": [0], "axes": {"mask": {"none": ["trainer.actor_lr=1e-4"]},
                                                        "clip": {"w1": ["trainer.critic_lr=1e-3"]},
                                                        "s": {"key": "staleness.staleness", "values": [8]}},
            "heatmap": {"rows": "mask", "cols": "clip", "panels": "s",
                        "lab": {"json": str(tmp_path / "absent.json"), "rows": {"none": 2},
                                "cols": {"w1": 0}}}}
    (tmp_path / "joint.yaml").write_text(yaml.safe_dump(spec))
    write_cell_record(load_spec(tmp_path / "joint.yaml"), tmp_path / "results",
                      "clip=w1__mask=none__s=8__seed0",
                      summary={"eval_last_half": 0.5})
    code = sweep_cli([str(tmp_path / "joint.yaml"), "--report", "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "cannot read the lab sweep" in err[0] and "absent.json: No such file or directory" in err[0]
