"""Two-knob analysis of a joint sweep (E2, claim C2): does the effect of one knob depend on the other?

In one panel of a sweep (one staleness level, say) a row axis (COPC's mask band) crosses a column axis
(the clip of the TD weights), and every seed gives a full grid ``y[s, i, j]`` of one summary figure.
Seeds are paired (the same prompts and warm start in every cell), so the seed is a block, and the model
is the randomized-block two-way layout

    y[s, i, j] = mu + seed_s + row_i + col_j + (row x col)_ij + e[s, i, j]

with sums of squares over the ``n`` complete seeds (``R`` rows, ``C`` columns, bars are means):

- ``SS_int = n * sum_ij (ybar_ij - ybar_i. - ybar_.j + ybar)^2``, df ``(R - 1)(C - 1)``;
- ``SS_err = SS_total - SS_seed - SS_row - SS_col - SS_int``, df ``(n - 1)(RC - 1)``;
- the interaction test ``F = (SS_int / df_int) / (SS_err / df_err)`` and its p value; over the panels
  of a sweep (:func:`heatmap_text`) the first report metric is the primary one, and its p values are
  Holm-adjusted across the panels (the other metrics are printed unadjusted, as secondary);
- the interaction share of the cell means (:func:`copc.lab.sweep.interaction_share`, the lab's figure:
  0 when the knobs act separately);
- the interaction contrasts, one per 2 x 2 block of adjacent levels (the column step under the next row
  minus under this one), ``d -+ t sqrt(4 MS_err / n)``;
- the simple effects: every step between adjacent levels of one knob, at each level of the other, the
  difference of two cell means, ``d -+ t sqrt(2 MS_err / n)``;
- reversals: a step whose interval lies above 0 at one level of the other knob and below 0 at another.
  That is the paper's "the effect of one reverses with the other", and it is called held only then.

Every ``t`` is on ``df_err`` degrees of freedom at the Bonferroni level for its family (the panel's
contrasts, or the panel's steps), so "held" means held simultaneously, not one comparison among 17
picked after the fact. The pooled ``MS_err`` assumes the cells share one seed-to-seed variance; a cell
that collapses in one seed only breaks that, so read the grid of means beside the test.

With fewer than two complete seeds, or no seed-to-seed variation at all, there is no error term: the
means and the share are given, the test and the intervals are not. :func:`lab_prediction` reads the
lab's exact relative MSE (``copc lab sweep``'s JSON) for the analogous cells, to set beside the loop's
grid. Analogous, not the same: the lab's staleness is exact-gradient steps on a tiny MDP, it has no PPO
clip and no advantage whitening, and its clip ``eps_A`` = 1 is ``[0, 2]``; the rank correlation of the
two grids is descriptive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from copc.experiments.stats import Interval, f_survival, student_t_quantile
from copc.experiments.sweep_spec import SweepSpec
from copc.experiments.tables import by_group

if TYPE_CHECKING:
    from copc.lab.sweep import SweepConfig

__all__ = [
    "Contrast",
    "Panel",
    "Step",
    "TwoWay",
    "heatmap_panels",
    "heatmap_text",
    "holm",
    "lab_prediction",
    "panel_values",
    "rank_correlation",
    "two_way",
    "two_way_text",
]

Values = Mapping[tuple[str, str], Mapping[int, float]]  # (row level, column level) -> {seed: value}
LabSweep = tuple["SweepConfig", list[dict[str, float | str | int]]]  # copc.lab.sweep.read_sweep's result


@dataclass(frozen=True)
class Step:
    """Moving ``axis`` from ``src`` to ``dst`` while the other knob (``at_axis``) stays at ``at``."""

    axis: str
    src: str
    dst: str
    at_axis: str
    at: str
    interval: Interval


@dataclass(frozen=True)
class Contrast:
    """The interaction of one 2 x 2 block of adjacent levels: the column step ``col_src -> col_dst``
    under ``row_dst`` minus the same step under ``row_src``."""

    col_src: str
    col_dst: str
    row_src: str
    row_dst: str
    interval: Interval


@dataclass(frozen=True)
class TwoWay:
    """The analysis of one panel (module docstring). ``means[i, j]`` is the seed mean of cell (row i, col j);
    the step and contrast intervals are simultaneous (Bonferroni) over the panel's steps and contrasts."""

    row_axis: str
    col_axis: str
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    seeds: tuple[int, ...]
    means: np.ndarray
    share: float
    f: float | None
    df: tuple[int, int]
    p: float | None
    steps: tuple[Step, ...]
    contrasts: tuple[Contrast, ...]
    note: str
    """Why there is no test (empty when there is one)."""
    confidence: float

    def reversals(self) -> list[tuple[Step, Step]]:
        """Pairs of the same step, held above 0 at one level of the other knob and held below 0 at another."""
        found = []
        for i, a in enumerate(self.steps):
            for b in self.steps[i + 1:]:
                if (a.axis, a.src, a.dst) != (b.axis, b.src, b.dst) or None in (a.interval.low,
                                                                                b.interval.low):
                    continue
                up, down = (a, b) if a.interval.mean > b.interval.mean else (b, a)
                if up.interval.low > 0 and down.interval.high < 0:  # type: ignore[operator]
                    found.append((up, down))
        return found


def panel_values(records: Sequence[Mapping[str, object]], metric: str, row_axis: str, col_axis: str,
                 panel_axis: str | None = None) -> dict[str, dict[tuple[str, str], dict[int, float]]]:
    """``{panel level: {(row level, column level): {seed: value}}}`` of the records' ``metric``
    (one panel ``""`` without a panel axis). Records must have the row and column axes."""
    panels: dict[str, dict[tuple[str, str], dict[int, float]]] = {}
    for key, seeds in by_group(records, metric).items():
        levels = dict(key)
        missing = [a for a in (row_axis, col_axis, panel_axis) if a is not None and a not in levels]
        if missing:
            raise ValueError(f"records have no axis {missing[0]!r}; their axes: {', '.join(levels)}")
        panel = levels[panel_axis] if panel_axis else ""
        panels.setdefault(panel, {})[(levels[row_axis], levels[col_axis])] = dict(seeds)
    return panels


def two_way(values: Values, rows: Sequence[str], cols: Sequence[str], *, row_axis: str = "row",
            col_axis: str = "col", confidence: float = 0.95) -> TwoWay:
    """The two-way analysis of one panel over the seeds that every cell of ``rows`` x ``cols`` has."""
    import torch

    from copc.lab.sweep import interaction_share  # one home for the share (the lab's coupling figure)

    missing = [(r, c) for r in rows for c in cols if (r, c) not in values]
    if missing:
        raise ValueError(f"cell {row_axis}={missing[0][0]} {col_axis}={missing[0][1]} has no record; "
                         "the analysis needs the full grid")
    bad = [(r, c) for r in rows for c in cols if not all(math.isfinite(v) for v in values[(r, c)].values())]
    if bad:
        raise ValueError(
            f"cell {row_axis}={bad[0][0]} {col_axis}={bad[0][1]} has a non-finite value; fix its record")
    seeds = sorted(set.intersection(*(set(values[(r, c)]) for r in rows for c in cols)))
    if not seeds:
        raise ValueError("no seed is recorded in every cell of the grid")
    y = np.array([[[values[(r, c)][s] for c in cols] for r in rows] for s in seeds], dtype=float)  # [n, R, C]
    n, n_rows, n_cols = y.shape
    means = y.mean(axis=0)
    share = interaction_share(torch.from_numpy(means))
    grand = means.mean()
    residual = means - means.mean(axis=1, keepdims=True) - means.mean(axis=0, keepdims=True) + grand
    ss_int = n * float((residual**2).sum())
    ss_total = float(((y - grand) ** 2).sum())
    ss_seed = n_rows * n_cols * float(((y.mean(axis=(1, 2)) - grand) ** 2).sum())
    ss_row = n * n_cols * float(((means.mean(axis=1) - grand) ** 2).sum())
    ss_col = n * n_rows * float(((means.mean(axis=0) - grand) ** 2).sum())
    df_int, df_err = (n_rows - 1) * (n_cols - 1), (n - 1) * (n_rows * n_cols - 1)
    ss_err = max(ss_total - ss_seed - ss_row - ss_col - ss_int, 0.0)
    if df_int == 0:
        note = f"one level on an axis ({n_rows} x {n_cols}): there is no interaction to test"
    elif df_err == 0:
        note = "needs >= 2 complete seeds (no error term)"
    elif ss_err <= 1e-12 * max(ss_total, 1e-300):
        note = "no seed-to-seed variation is left beside the cell means (error term 0): no test"
    else:
        note = ""
    ms_err = ss_err / df_err if not note else None
    f = p = None
    if ms_err is not None:
        f = (ss_int / df_int) / ms_err
        p = f_survival(f, df_int, df_err)
    n_steps = (n_cols - 1) * n_rows + (n_rows - 1) * n_cols

    def interval(diff: float, var_factor: float, family: int) -> Interval:
        """``diff`` with its interval, simultaneous over ``family`` such intervals (Bonferroni)."""
        if ms_err is None:
            return Interval(diff, None, None, n)
        half = student_t_quantile(1.0 - (1.0 - confidence) / (2.0 * family),
                                  df_err) * math.sqrt(var_factor * ms_err / n)
        return Interval(diff, diff - half, diff + half, n)

    steps = [Step(col_axis, cols[j], cols[j + 1], row_axis, rows[i],
                  interval(float(means[i, j + 1] - means[i, j]), 2.0, n_steps))
             for j in range(n_cols - 1) for i in range(n_rows)]
    steps += [Step(row_axis, rows[i], rows[i + 1], col_axis, cols[j],
                   interval(float(means[i + 1, j] - means[i, j]), 2.0, n_steps))
              for i in range(n_rows - 1) for j in range(n_cols)]
    contrasts = [Contrast(cols[j], cols[j + 1], rows[i], rows[i + 1], interval(float(
        means[i + 1, j + 1] - means[i, j + 1] - means[i + 1, j] + means[i, j]), 4.0, max(df_int, 1)))
        for i in range(n_rows - 1) for j in range(n_cols - 1)]
    return TwoWay(row_axis, col_axis, tuple(rows), tuple(cols), tuple(seeds), means, share, f, (df_int,
                                                                                                df_err), p,
                  tuple(steps), tuple(contrasts), note, confidence)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p values, in the input order (reject where adjusted p < alpha)."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def two_way_text(result: TwoWay, metric: str, title: str = "") -> str:
    """The grid of seed means, the interaction test, the interaction contrasts and every held reversal."""
    width = max(len(c) for c in result.cols) + 2
    head = f"{title}{metric}, seed mean over seeds {', '.join(map(str, result.seeds))} " \
           f"(rows {result.row_axis}, columns {result.col_axis}):"
    lines = [head, " " * 12 + "".join(f"{c:>{width}}" for c in result.cols)]
    for name, row in zip(result.rows, result.means, strict=True):
        lines.append(f"{name:>12}" + "".join(f"{v:>{width}.3f}" for v in row))
    lines.append(f"interaction share of the cell means: {result.share:.3f}")
    if result.f is None or result.p is None:
        lines.append(f"interaction test: {result.note}")
        return "\n".join(lines)
    pct = f"{100 * result.confidence:g}%"
    lines.append(f"interaction F({result.df[0]}, {result.df[1]}) = {result.f:.3f}, p = {result.p:.3g}")
    lines.append(
        f"interaction contrasts (step of {result.col_axis} under the next {result.row_axis} minus under "
                 f"this one; {pct} intervals simultaneous over the {len(result.contrasts)}):")
    for c in result.contrasts:
        mark = " *" if c.interval.excludes_zero() else ""
        lines.append(
            f"  {result.col_axis} {c.col_src} -> {c.col_dst}, {result.row_axis} {c.row_src} -> {c.row_dst}: "
                     f"{c.interval.text()}{mark}")
    reversals = result.reversals()
    simultaneous = f"{pct} intervals simultaneous over the panel's {len(result.steps)} steps"
    if not reversals:
        lines.append(
            f"reversals: none held ({simultaneous}: no step is held above 0 at one level of the other knob "
                     "and below 0 at another)")
    for up, down in reversals:
        lines.append(
            f"reversal ({simultaneous}): {up.axis} {up.src} -> {up.dst} gives {up.interval.text()} at "
                     f"{up.at_axis}={up.at} and {down.interval.text()} at {down.at_axis}={down.at}")
    return "\n".join(lines)


def lab_prediction(path: Path, rows: Mapping[str, float], cols: Mapping[str, float], staleness: float,
                   batch: int = 64, *, lab: LabSweep | None = None) -> np.ndarray:
    """The lab's exact relative MSE (lower is better) for the sweep's cells: ``[len(rows), len(cols)]``,
    averaged over the lab's reward families and seeds. ``rows`` maps each row level to the lab's mask band
    ``c`` and ``cols`` each column level to its advantage clip ``eps_A``; ``lab`` is ``path`` already read
    (:func:`copc.lab.sweep.read_sweep`), to read it once for several panels."""
    from copc.lab.sweep import mean_grid, read_sweep

    cfg, cells = lab if lab is not None else read_sweep(path)
    if float(staleness) not in cfg.staleness:
        raise ValueError(
            f"{path} has no staleness {staleness}; it has {', '.join(f'{s:g}' for s in cfg.staleness)}")
    for name, mapping, known in (("mask band", rows, cfg.mask_bands), ("advantage clip", cols,
                                                                       cfg.adv_clips)):
        bad = [v for v in mapping.values() if float(v) not in known]
        if bad:
            raise ValueError(f"{path} has no {name} {bad[0]}; it has {', '.join(f'{k:g}' for k in known)}")
    grids = [mean_grid(cells, cfg, family, float(staleness), "relative_mse",
                       batch).numpy() for family in cfg.families]
    grid = np.mean(grids, axis=0)
    r_index = [cfg.mask_bands.index(float(v)) for v in rows.values()]
    c_index = [cfg.adv_clips.index(float(v)) for v in cols.values()]
    return grid[np.ix_(r_index, c_index)]


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two equal-shape grids (average ranks for ties)."""
    def ranks(x: np.ndarray) -> np.ndarray:
        flat = x.ravel()
        order = np.argsort(flat, kind="stable")
        out = np.empty(flat.size)
        out[order] = np.arange(flat.size, dtype=float)
        for value in np.unique(flat):  # ties share their mean rank
            tied = flat == value
            out[tied] = out[tied].mean()
        return out

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


@dataclass(frozen=True)
class Panel:
    """One panel of a sweep's ``heatmap:`` for one metric: the analysis (None while cells are missing,
    ``missing`` says which), the lab's relative MSE for the same cells and Spearman's correlation of the
    loop's cell means with the lab's ``-MSE`` (both higher-is-better)."""

    level: str
    metric: str
    result: TwoWay | None
    missing: str
    lab: np.ndarray | None
    rho: float | None


def heatmap_panels(records: Sequence[Mapping[str, object]], spec: SweepSpec, metric: str) -> list[Panel]:
    """The ``heatmap:`` analysis of ``spec`` for ``metric``, one :class:`Panel` per level of its panel
    axis."""
    heat = spec.heatmap
    if heat is None:
        raise ValueError(f"sweep {spec.experiment} has no heatmap: section")
    rows, cols = list(spec.axes[heat.rows]), list(spec.axes[heat.cols])
    values = panel_values(records, metric, heat.rows, heat.cols, heat.panels)
    lab_sweep = None
    if heat.lab_json and heat.lab_rows and heat.lab_cols:
        from copc.lab.sweep import read_sweep

        lab_sweep = read_sweep(Path(heat.lab_json))
    out = []
    for level in list(spec.axes[heat.panels]) if heat.panels else [""]:
        cells = values.get(level, {})
        try:
            result, missing = two_way(cells, rows, cols, row_axis=heat.rows, col_axis=heat.cols), ""
        except ValueError as err:
            recorded = sum(1 for k in cells if k[0] in rows and k[1] in cols)
            result, missing = None, f"{recorded} of {len(rows) * len(cols)} cells recorded ({err})"
        lab = rho = None
        if lab_sweep is not None and heat.lab_json and heat.lab_rows and heat.lab_cols:
            lab = lab_prediction(Path(heat.lab_json), {lv: heat.lab_rows[lv] for lv in rows},
                                 {lv: heat.lab_cols[lv] for lv in cols}, float(level), heat.lab_batch,
                                 lab=lab_sweep)
            rho = rank_correlation(result.means, -lab) if result is not None else None
        out.append(Panel(level, metric, result, missing, lab, rho))
    return out


def heatmap_text(records: Sequence[Mapping[str, object]], spec: SweepSpec) -> str:
    """Every panel's analysis for every report metric (the first one primary: its interaction tests
    Holm-adjusted across the panels), with the lab's figure for the analogous cells beside it."""
    heat = spec.heatmap
    assert heat is not None
    lines = []
    for rank, metric in enumerate(spec.report):
        panels = heatmap_panels(records, spec, metric)
        tested = [p for p in panels if p.result is not None and p.result.p is not None]
        adjusted = dict(zip((p.level for p in tested),
                            holm([p.result.p for p in tested]), strict=True))  # type: ignore[union-attr,misc]
        for panel in panels:
            title = f"{heat.panels}={panel.level}: " if heat.panels else ""
            if panel.result is None:
                lines.append(f"\n{title}{metric}: {panel.missing}")
                continue
            lines.append("\n" + two_way_text(panel.result, metric, title))
            if panel.level in adjusted and rank == 0:
                alpha = 1.0 - panel.result.confidence
                verdict = "held" if adjusted[panel.level] < alpha else "not held"
                lines.append(f"interaction (primary metric, Holm over {len(tested)} panel(s)): adjusted p = "
                             f"{adjusted[panel.level]:.3g}: {verdict} at {100 * alpha:g}%")
            elif panel.level in adjusted:
                lines.append("(secondary metric: p unadjusted, for description)")
            if panel.lab is not None:
                best = np.unravel_index(int(np.argmin(panel.lab)), panel.lab.shape)
                lines.append(
                    f"lab, analogous cells (exact relative MSE at N={heat.lab_batch} on tiny MDPs, lower is "
                             f"better): best {heat.rows}={panel.result.rows[best[0]]} "
                             f"{heat.cols}={panel.result.cols[best[1]]}; Spearman of the loop's means with "
                             f"the lab's -MSE {panel.rho:.2f} (descriptive)")
    return "\n".join(lines).lstrip("\n")
