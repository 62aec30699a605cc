"""Figures of a sweep, drawn from its records alone (``copc sweep FILE --plot DIR``).

:func:`plot_curves` draws one panel per evaluation metric: for each group of cells (the axis levels
without the seed), the seed mean of the metric at every evaluation step, with a band from the lowest to
the highest seed. :func:`plot_summary` draws, per summary metric, each group's seed mean with its 95%
t interval over seeds (no bar where a group has one seed) and the seeds as dots. :func:`plot_diagnostics`
draws the records' binned diagnostic curves (drift, mask rate, ESS, ...) as seed means. :func:`plot_heatmaps`
draws a joint sweep's grid of seed means per panel (copc.experiments.interaction), with the lab's exact
prediction for the same cells beside it. Matplotlib (Agg backend) is imported when a figure is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from copc.experiments.interaction import Panel
from copc.experiments.stats import t_interval
from copc.experiments.tables import by_group, group_key, group_text

__all__ = ["diagnostic_curves", "eval_curves", "plot_curves", "plot_diagnostics", "plot_heatmaps",
           "plot_summary"]

Curve = dict[int, list[float]]  # evaluation step -> one value per seed


def eval_curves(records: Sequence[Mapping[str, object]], metric: str) -> dict[str, Curve]:
    """``{group text: {step: [value of each seed that has the step]}}`` for one evaluation metric."""
    out: dict[str, Curve] = {}
    for record in records:
        name = group_text(group_key(record))
        points = record.get("evals")
        for point in points if isinstance(points, list) else []:
            if isinstance(point, dict) and point.get(metric) is not None:
                out.setdefault(name, {}).setdefault(int(point["step"]), []).append(float(point[metric]))
    return out


def diagnostic_curves(records: Sequence[Mapping[str, object]], name: str) -> dict[str, Curve]:
    """``{group text: {bin step: [value of each seed that has the bin]}}`` for one of the records' binned
    diagnostic curves (``record["curves"][name]``: ``[[step, mean], ...]``, copc.experiments.results)."""
    out: dict[str, Curve] = {}
    for record in records:
        curves = record.get("curves")
        points = curves.get(name) if isinstance(curves, dict) else None
        for step, value in points if isinstance(points, list) else []:
            if value is not None:
                out.setdefault(group_text(group_key(record)), {}).setdefault(int(step),
                                                                             []).append(float(value))
    return out


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, n: int, width: float, height: float):  # type: ignore[no-untyped-def]
    """A figure of ``n`` panels wrapped three to a row (many stay readable); returns it and its ``n`` axes,
    the spare cells of the last row hidden."""
    cols = min(3, n)
    rows = -(-n // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _save(plt, fig, out: Path, title: str) -> Path:  # type: ignore[no-untyped-def]
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_curves(records: Sequence[Mapping[str, object]], metrics: Sequence[str], out: Path, *,
                title: str) -> Path:
    """Seed-mean evaluation curves (band: min to max over seeds), one panel per metric; returns the PNG."""
    plt = _pyplot()
    fig, axes = _panels(plt, len(metrics), 5.5, 4.2)
    for ax, metric in zip(axes, metrics, strict=True):
        for name, curve in sorted(eval_curves(records, metric).items()):
            steps = sorted(curve)
            mean = [sum(curve[s]) / len(curve[s]) for s in steps]
            line = ax.plot(steps, mean, marker="o", markersize=3,
                           label=f"{name} (n={max(map(len, curve.values()))})")
            ax.fill_between(steps, [min(curve[s]) for s in steps], [max(curve[s]) for s in steps],
                            color=line[0].get_color(), alpha=0.12, linewidth=0)
        ax.set_xlabel("training step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    return _save(plt, fig, out, title)


def plot_summary(records: Sequence[Mapping[str, object]], metrics: Sequence[str], out: Path, *,
                 title: str) -> Path:
    """Per summary metric: each group's seed mean with its 95% t interval over seeds, seeds as dots."""
    plt = _pyplot()
    fig, axes = _panels(plt, len(metrics), 5.5, 4.2)
    for ax, metric in zip(axes, metrics, strict=True):
        groups = sorted(by_group(records, metric).items(), key=lambda kv: group_text(kv[0]))
        for x, (_, seeds) in enumerate(groups):
            values = list(seeds.values())
            interval = t_interval(values)
            error = None
            if interval.high is not None and interval.low is not None:
                error = [[interval.mean - interval.low], [interval.high - interval.mean]]
            ax.errorbar([x], [interval.mean], yerr=error, fmt="s", capsize=4, color="black")
            ax.scatter([x] * len(values), values, s=12, alpha=0.6)
        ax.set_xticks(range(len(groups)), [group_text(k).split("=", 1)[-1] for k, _ in groups], rotation=30,
                      ha="right", fontsize=8)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, out, title)


def plot_diagnostics(records: Sequence[Mapping[str, object]], names: Sequence[str], out: Path, *,
                     title: str) -> Path | None:
    """Seed-mean diagnostic curves per group, one panel per curve that some record has (lines only: the
    bins are seed means of their own); None, and no file, when no record has any of ``names``."""
    present = [(name, curves) for name in names if (curves := diagnostic_curves(records, name))]
    if not present:
        return None
    plt = _pyplot()
    fig, axes = _panels(plt, len(present), 5.2, 3.6)
    for ax, (name, curves) in zip(axes, present, strict=True):
        for group, curve in sorted(curves.items()):
            steps = sorted(curve)
            ax.plot(steps, [sum(curve[s]) / len(curve[s]) for s in steps], linewidth=1.2, marker="o",
                    markersize=2.5, label=f"{group} (n={max(map(len, curve.values()))})")
        ax.set_xlabel("training step")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    return _save(plt, fig, out, title)


def _grid(  # type: ignore[no-untyped-def]
    ax, values: np.ndarray, rows: Sequence[str], cols: Sequence[str], cmap: str, title: str
) -> None:
    image = ax.imshow(values, cmap=cmap, aspect="auto")
    for (i, j), v in np.ndenumerate(values):
        red, green, blue, _ = image.cmap(image.norm(v))
        dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
        ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(cols)), cols, fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_title(title, fontsize=9)


def plot_heatmaps(panels: Sequence[Panel], row_axis: str, col_axis: str, panel_axis: str | None, out: Path, *,
                  title: str) -> Path:
    """One row per panel with a recorded grid: the loop's seed means (higher is better) and, when given,
    the lab's relative MSE for the same cells (reversed colours: lower is better). Returns the PNG."""
    plt = _pyplot()
    shown = [p for p in panels if p.result is not None]
    if not shown:
        raise ValueError("no panel has its full grid recorded yet; nothing to draw")
    columns = 2 if any(p.lab is not None for p in shown) else 1
    fig, axes = plt.subplots(len(shown), columns, figsize=(5.2 * columns, 3.4 * len(shown)), squeeze=False)
    for row, panel in zip(axes, shown, strict=True):
        result = panel.result
        assert result is not None
        p_text = "" if result.p is None else f", interaction p = {result.p:.2g}"
        where = f"{panel_axis}={panel.level}" if panel_axis else ""
        _grid(row[0], result.means, result.rows, result.cols, "viridis",
              f"loop {where}: {panel.metric} (n={len(result.seeds)}{p_text})")
        if panel.lab is not None:
            _grid(row[1], panel.lab, result.rows, result.cols, "viridis_r",
                  f"lab {where}: relative MSE (Spearman with loop {panel.rho:.2f})")
        for ax in row:
            ax.set_xlabel(col_axis)
            ax.set_ylabel(row_axis)
    return _save(plt, fig, out, title)
