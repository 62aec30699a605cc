"""Heatmaps of the lab sweep (matplotlib, Agg backend: no display needed), drawn from its cells.

Reads :mod:`copc.lab.sweep`'s data (never the other way round): the CLI runs the sweep, then draws.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from copc.lab.sweep import METRICS, SweepConfig, mean_grid

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.image import AxesImage

TITLES = {
    "relative_mse": "relative MSE  E||ĝ_N − g*||² / ||g*||²  (lower is better; dot = best clip per band)",
    "relative_bias": "relative bias  ||E ĝ − g*|| / ||g*||  (dot = lowest per band)",
    "relative_var": "relative variance  tr Cov[ĝ] / (N ||g*||²)  (dot = lowest per band)",
    "cosine": "cos(E ĝ, g*)  (higher is better; dot = best clip per band)",
}


def _label(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:g}"


def _critic_label(cfg: SweepConfig) -> str:
    base = {"mu": "V^mu", "pi": "V^pi", "fitted": "fitted to the cell's clipped-TD target"}[cfg.critic_base]
    if cfg.critic_noise == 0:
        return f"{base} (exact)"
    return f"{base} + N(0, {cfg.critic_noise:g}²) ({cfg.critic_draws} draws)"


def _mean_kl(cells: list[dict[str, float | str | int]], family: str, s: float) -> float:
    kls = [float(c["kl"]) for c in cells if c["family"] == family and c["staleness"] == s]
    return sum(kls) / max(len(kls), 1)


def _panel(ax: Axes, grid: torch.Tensor, cfg: SweepConfig, metric: str) -> AxesImage:
    from matplotlib.colors import LogNorm

    data = grid.numpy()
    log_scale = metric != "cosine" and bool((grid > 0).all())
    norm = LogNorm(vmin=float(grid.min()), vmax=float(grid.max())) if log_scale else None
    image = ax.imshow(data, origin="lower", aspect="auto",
                      cmap="viridis_r" if metric != "cosine" else "viridis", norm=norm)
    best = grid.argmax(dim=1) if metric == "cosine" else grid.argmin(dim=1)
    ax.scatter(best.numpy(), range(len(best)), c="white", s=14, edgecolors="black", linewidths=0.5)
    flat = int(grid.argmax() if metric == "cosine" else grid.argmin())
    i, j = divmod(flat, grid.shape[1])
    ax.scatter([j], [i], marker="*", c="red", s=70, edgecolors="white", linewidths=0.5)
    ax.set_xticks(range(len(cfg.adv_clips)), [_label(e) for e in cfg.adv_clips], fontsize=7)
    ax.set_yticks(range(len(cfg.mask_bands)), [_label(c) for c in cfg.mask_bands], fontsize=7)
    return image


def draw_heatmaps(
    cells: list[dict[str, float | str | int]], cfg: SweepConfig, out_dir: Path, *, tag: str = ""
) -> list[Path]:
    """One PNG per metric: rows = reward families, columns = staleness; x = eps_A, y = band c."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    nrows, ncols = len(cfg.families), len(cfg.staleness)
    swept = cfg.correction(cfg.mask_bands[0], cfg.adv_clips[0])
    channels = (f"{swept.policy.objective}({swept.policy.weight_mode}) x "
                f"{swept.advantage.estimator}(λ={cfg.lam:g})")
    for metric in METRICS:
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.9 * nrows), squeeze=False)
        for r, family in enumerate(cfg.families):
            for c, s in enumerate(cfg.staleness):
                ax = axes[r][c]
                grid = mean_grid(cells, cfg, family, s, metric, cfg.batch_size)
                image = _panel(ax, grid, cfg, metric)
                fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03).ax.tick_params(labelsize=6)
                level = f"s={s:g}" if cfg.staleness_mode == "path" else "KL target"
                ax.set_title(f"{family}, {level} (KL {_mean_kl(cells, family, s):.2f})", fontsize=8)
                if c == 0:
                    ax.set_ylabel("mask band c: [1/c, c]", fontsize=7)
                if r == nrows - 1:
                    ax.set_xlabel("advantage clip ε_A: [1−ε_A, 1+ε_A]", fontsize=7)
        fig.suptitle(
            f"{TITLES[metric]}\nstaleness {cfg.staleness_mode}, H={cfg.horizon}, K={cfg.vocab}, "
            f"N={cfg.batch_size}, seeds {list(cfg.seeds)}; "
            f"{channels}, critic {_critic_label(cfg)}",
            fontsize=9,
        )
        fig.tight_layout()
        path = out_dir / (f"lab_{tag}_{metric}.png" if tag else f"lab_{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
