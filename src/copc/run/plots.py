"""PNG plots of one or several runs, read from their ``metrics.jsonl`` (matplotlib, Agg backend).

Four figures, each a row of panels over training steps:

- ``reward.png``: ``reward/mean``, and ``eval/accuracy`` (avg@k) with ``eval/greedy_accuracy``;
- ``staleness.png``: realized staleness ``staleness/mean`` and ``staleness/max``;
- ``ratios.png``: ``policy/mask_frac`` (what the actor loss masked), ``ratio/clip_low_frac``,
  ``ratio/clip_high_frac``;
- ``critic.png``: ``critic/explained_var``.

Several runs are overlaid, one line each. With ``mean_seeds=True`` runs whose directory names differ
only by a ``seed<N>`` suffix (``ppo_s16_seed0``, ``ppo_s16_seed1`` ...; a leading time stamp as in
``20261129-201500-copc-arith_tool-s8-seed0`` is ignored too) are one curve: the mean over
seeds at the steps every seed logged, with a band from the lowest to the highest seed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from copc import tracking as m
from copc.tracking import read_metrics

#: figure file name -> (title, panels); a panel is (title, metric names drawn in it).
FIGURES: dict[str, tuple[str, tuple[tuple[str, tuple[str, ...]], ...]]] = {
    "reward.png": (
        "Reward and eval accuracy",
        (("mean reward (train batch)", (m.REWARD_MEAN,)), ("held-out accuracy (avg@k sampled, greedy)",
                                                           (m.EVAL_ACCURACY, m.EVAL_GREEDY_ACCURACY))),
    ),
    "staleness.png": (
        "Realized staleness per token [versions]",
        (("mean", (m.STALENESS_MEAN,)), ("max", (m.STALENESS_MAX,))),
    ),
    "ratios.png": (
        "Behaviour-ratio mask and clip rates",
        (
            ("policy mask rate (actor loss)", (m.POLICY_MASK_FRAC,)),
            ("advantage clip rate (low / high)", (m.RATIO_CLIP_FRAC_LOW, m.RATIO_CLIP_FRAC_HIGH)),
        ),
    ),
    "critic.png": ("Critic", (("explained variance", (m.CRITIC_EXPLAINED_VAR,)),)),
}

#: A run's own figures go to ``RUN_DIR/plots``.
PLOTS_DIR = "plots"

_SEED_RE = re.compile(r"[-_.]?seed[-_]?\d+$")
_STAMP_RE = re.compile(r"^\d{8}-\d{6}[-_]")  # copc train's default run names start with a time stamp


@dataclass(frozen=True)
class Curve:
    """One line to draw: ``steps [N]``, ``mean [N]`` and, for a seed group, ``low``/``high`` band."""

    label: str
    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray | None = None
    high: np.ndarray | None = None


def series(records: Sequence[dict[str, float]], name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of metric ``name`` (records without it are skipped; the last record of a
    step wins, as after a resume)."""
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_step[int(record["step"])] = float(value)
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps.tolist()], dtype=np.float64)


def seed_group(run_dir: str | os.PathLike[str]) -> str:
    """Label shared by seeds of one configuration: the directory name without its ``seed<N>`` suffix
    and without the leading ``YYYYmmdd-HHMMSS-`` stamp of default run names."""
    name = Path(run_dir).resolve().name
    return _STAMP_RE.sub("", _SEED_RE.sub("", name)) or name


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over ``window`` points (``window = 1``: unchanged)."""
    if window <= 1 or values.size == 0:
        return values
    cumsum = np.cumsum(np.insert(values, 0, 0.0))
    out = np.empty_like(values)
    for i in range(values.size):
        lo = max(0, i + 1 - window)
        out[i] = (cumsum[i + 1] - cumsum[lo]) / (i + 1 - lo)
    return out


def curves_for(
    runs: dict[str, list[dict[str, float]]], name: str, *, mean_seeds: bool, window: int = 1
) -> list[Curve]:
    """Curves of metric ``name`` for runs keyed by run directory (grouped by seed when asked)."""
    groups: dict[str, list[str]] = {}
    for run_dir in runs:
        label = seed_group(run_dir) if mean_seeds else Path(run_dir).resolve().name
        groups.setdefault(label, []).append(run_dir)
    curves = []
    for label, members in groups.items():
        per_run = [series(runs[r], name) for r in members]
        per_run = [(s, smooth(v, window)) for s, v in per_run if s.size]
        if not per_run:
            continue
        if len(per_run) == 1:
            steps, values = per_run[0]
            curves.append(Curve(label, steps, values))
            continue
        common, stack = align_runs(per_run)
        if not common.size:
            continue
        curves.append(Curve(f"{label} (n={len(per_run)})", common, stack.mean(0), stack.min(0), stack.max(0)))
    return curves


def align_runs(per_run: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values [runs, steps])``: each run's ``(steps, values)`` at the steps every run logged."""
    common = sorted(set.intersection(*(set(s.tolist()) for s, _ in per_run))) if per_run else []
    if not common:
        return np.zeros(0, dtype=np.int64), np.zeros((len(per_run), 0))
    return np.array(common), np.stack([v[np.searchsorted(s, common)] for s, v in per_run])


def plot_runs(
    run_dirs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    mean_seeds: bool = False,
    smooth_window: int = 1,
) -> list[Path]:
    """Draw the four figures for ``run_dirs`` into ``out_dir`` (default: ``RUN_DIR/plots`` of the single
    run); returns the PNG paths. Panels without data say so instead of failing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    if out_dir is None:
        if len(run_dirs) != 1:
            raise ValueError("several runs: say where the overlay goes (out_dir / --out)")
        out_dir = Path(run_dirs[0]) / PLOTS_DIR
    runs = {}
    for run_dir in run_dirs:
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {run_dir} a copc run directory?")
        runs[str(run_dir)] = read_metrics(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, (title, panels) in FIGURES.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
        for ax, (panel_title, names) in zip(axes[0], panels, strict=True):
            _draw_panel(ax, runs, panel_title, names, mean_seeds=mean_seeds, window=smooth_window)
        fig.suptitle(title)
        written.append(save_figure(fig, out / file_name))
    return written


def save_figure(fig: object, target: Path) -> Path:
    """Lay out, write ``target`` atomically (a temporary sibling, then a rename) and close ``fig``."""
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure)
    fig.tight_layout()
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, target)
    return target


def plot_run(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The figures of one run, into ``RUN_DIR/plots`` by default (what ``copc train`` calls at the end)."""
    return plot_runs([run_dir], out_dir)


def _draw_panel(
    ax: object,
    runs: dict[str, list[dict[str, float]]],
    title: str,
    names: tuple[str, ...],
    *,
    mean_seeds: bool,
    window: int,
) -> None:
    from matplotlib.axes import Axes

    assert isinstance(ax, Axes)
    drawn = 0
    colors: dict[str, str] = {}  # one colour per run (or seed group), one line style per metric
    for j, name in enumerate(names):
        for curve in curves_for(runs, name, mean_seeds=mean_seeds, window=window):
            label = curve.label if len(names) == 1 else f"{curve.label}: {name.split('/')[-1]}"
            color = colors.setdefault(curve.label, f"C{len(colors) % 10}")
            ax.plot(curve.steps, curve.mean, label=label, color=color, linestyle=("-", "--", ":")[j % 3])
            if curve.low is not None and curve.high is not None:
                ax.fill_between(curve.steps, curve.low, curve.high, color=color, alpha=0.2)
            drawn += 1
    ax.set_title(title)
    ax.set_xlabel("step")
    if drawn:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
