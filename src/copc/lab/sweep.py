"""Joint sweep of the two channels (mask band x advantage clip) at several staleness levels
(docs/formulas.md#hyper-parameters).

For each reward family, seed and staleness ``s`` the lab builds an exact policy-gradient path
(normalised steps of length ``step_size`` from random logits), takes ``pi = path[-1]`` and
``mu = path[-1 - s]`` (pi as it was s updates earlier; ``staleness_mode = "path"``) or ``mu`` at
``KL(pi || mu) = s`` along a random logit direction (``staleness_mode = "kl"``), and decomposes the COPC
update (production's ``copc`` objective, ``weight_mode = masked_is``, with band ``[1/c, c]`` x the
``clipped_td`` estimator with ratio clip ``[max(0, 1 - eps_A), 1 + eps_A]``) for every grid cell. Figures are
relative to the true gradient: ``relative_mse = E||ĝ_N - g*||² / ||g*||²``, ``relative_bias = ||E ĝ - g*|| /
||g*||``, ``relative_var = tr Cov[ĝ]/(N ||g*||²)`` and ``cosine = cos(E ĝ, g*)``.

``relative_mse`` rewards a short update: a zero update scores exactly 1, and a tight mask shrinks
``E ĝ`` (masked tokens stay in the denominator), so a cell can win by nearly not updating. A trainer
tunes its step size, so the analysis also ranks cells by the **step-size-free MSE**
``scaled_mse = min_a E||a ĝ_N - g*||² / ||g*||² = 1 - cos² ||E ĝ||² / (||E ĝ||² + tr Cov[ĝ]/N)``
(direction and noise, not length; 0 is exact, 1 is no better than not updating). Each analysis entry
also says whether any cell beats a zero update (``relative_mse`` only) and what choosing the most
common best ``eps_A`` under every band would cost (``band_dependence_cost``, relative): a best clip
that "depends on the band" by 0.1% is not a coupling.

Coupling analysis (per family and staleness, seeds averaged): the best ``eps_A`` for every band (does
it depend on the band?), and sign reversals (moving ``eps_A`` between two adjacent grid values lowers
the MSE under one band and raises it under another, by more than ``REVERSAL_TOL`` relative).

:func:`run_sweep` writes the JSON and returns the data; the heatmaps are :func:`copc.lab.plots.draw_heatmaps`
(the CLI calls both), so this module imports no plotting.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from copc.channels import AdvantageChannelConfig, PolicyChannelConfig
from copc.lab.corrections import Correction
from copc.lab.exact import CRITIC_BASES, Critic, decompose
from copc.lab.mdp import REWARD_FAMILIES, behaviour_at_kl, gradient_path, make_mdp, random_logits

INF = math.inf
REVERSAL_TOL = 0.02
METRICS: tuple[str, ...] = ("relative_mse", "relative_bias", "relative_var", "cosine")
#: Lower-is-better criteria the coupling analysis ranks cells by (module docstring).
CRITERIA: tuple[str, ...] = ("relative_mse", "scaled_mse", "one_minus_cosine")


@dataclass(frozen=True)
class SweepConfig:
    """The grid and the MDPs of ``copc lab sweep``; defaults run in about a minute on one core."""

    families: tuple[str, ...] = REWARD_FAMILIES
    """Reward families (see :func:`copc.lab.mdp.make_mdp`)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds of the reward and of the initial logits."""
    horizon: int = 6
    """H tokens per sequence."""
    vocab: int = 3
    """K symbols."""
    staleness: tuple[float, ...] = (2, 4, 8)
    """s: gradient steps between mu and pi (``path``), or KL(pi || mu) targets in nats (``kl``)."""
    staleness_mode: str = "path"
    """``path`` (mu = pi s exact gradient steps earlier) or ``kl`` (random direction at a KL target)."""
    path_steps: int = 20
    """Length of the exact gradient path; pi is its last point."""
    step_size: float = 0.5
    """Euclidean length of each (normalised) gradient step in logit space."""
    init_scale: float = 0.5
    """Std of the random initial logits."""
    mask_bands: tuple[float, ...] = (1.1, 1.25, 1.5, 2.0, 3.0, 5.0, INF)
    """c of the mask band [1/c, c] (inf = no mask)."""
    adv_clips: tuple[float, ...] = (0.0, 0.1, 0.2, 0.5, 1.0, INF)
    """eps_A of the advantage clip [max(0, 1 - eps_A), 1 + eps_A] (0 = stale GAE, inf = full ratio)."""
    batch_size: int = 64
    """N trajectories per update (MSE = bias² + tr Cov / N)."""
    lam: float = 1.0
    """lambda of the advantage channel."""
    critic_base: str = "mu"
    """Critic: ``mu`` (exact V^mu, what a critic fit on stale data converges to), ``pi``, or ``fitted``
    (the fixed point of each cell's own clipped-TD target, as COPC trains its critic)."""
    critic_noise: float = 0.0
    """Std of the per-state critic error around the base critic (0 = exact)."""
    critic_draws: int = 1
    """Enumerated critic-noise draws (>= 2 with noise)."""

    def __post_init__(self) -> None:
        bad = [f for f in self.families if f not in REWARD_FAMILIES]
        if bad:
            raise ValueError(f"unknown reward families {bad}; valid: {', '.join(REWARD_FAMILIES)}")
        if self.staleness_mode not in ("path", "kl"):
            raise ValueError(f"staleness_mode must be 'path' or 'kl', got {self.staleness_mode!r}")
        if not self.staleness or min(self.staleness) < 0:
            raise ValueError("give at least one staleness level, all >= 0")
        if self.staleness_mode == "path" and (
            max(self.staleness) > self.path_steps or any(s != int(s) for s in self.staleness)
        ):
            raise ValueError("path staleness levels must be whole steps in "
                             f"[0, path_steps={self.path_steps}]")
        if any(c <= 1 for c in self.mask_bands) or any(e < 0 for e in self.adv_clips):
            raise ValueError("mask bands need c > 1 (the band [1/c, c] must not be empty) and advantage "
                             "clips eps_A >= 0")
        if self.batch_size < 1 or self.step_size <= 0:
            raise ValueError("batch_size must be >= 1 and step_size > 0")
        if self.critic_base not in CRITIC_BASES:
            raise ValueError(f"unknown critic {self.critic_base!r}; valid: {', '.join(CRITIC_BASES)}")
        if self.critic_noise > 0 and self.critic_draws < 2:
            raise ValueError("a noisy critic needs critic_draws >= 2 (e.g. 4)")

    def correction(self, band: float, clip: float) -> Correction:
        """copc (masked IS) on ``[1/c, c]`` x clipped_td on ``[max(0, 1 - eps), 1 + eps]``, unwhitened."""
        low = 0.0 if band == INF else 1.0 / band
        policy = PolicyChannelConfig(objective="copc", mask_low=low, mask_high=band, weight_mode="masked_is")
        adv = AdvantageChannelConfig(
            estimator="clipped_td",
            lam_critic=self.lam,
            lam_actor=self.lam,
            ratio_low=max(0.0, 1.0 - clip),
            ratio_high=1.0 + clip,
            whiten=False,
        )
        return Correction(policy, adv)

    def critic(self) -> Critic:
        if self.critic_noise == 0:
            return Critic(base=self.critic_base)
        return Critic(base=self.critic_base, noise_std=self.critic_noise, draws=self.critic_draws)


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def run_grid(cfg: SweepConfig) -> list[dict[str, float | str | int]]:
    """Every (family, seed, staleness, band, clip) cell with its exact figures."""
    cells: list[dict[str, float | str | int]] = []
    for family in cfg.families:
        for seed in cfg.seeds:
            mdp = make_mdp(family, cfg.horizon, cfg.vocab, seed=seed)
            init = random_logits(mdp, scale=cfg.init_scale, seed=seed + 100)
            path = gradient_path(mdp, init, steps=cfg.path_steps, lr=cfg.step_size, normalize=True)
            pi = path[-1]
            for s in cfg.staleness:
                mu = path[-1 - int(s)] if cfg.staleness_mode == "path" else behaviour_at_kl(mdp, pi, s,
                                                                                            seed=seed)
                for band in cfg.mask_bands:
                    for clip in cfg.adv_clips:
                        d = decompose(mdp, pi, mu, cfg.correction(band, clip), cfg.critic(),
                                      batch_size=cfg.batch_size)
                        summ = d.summary()
                        g2 = summ["g_star_norm"] ** 2
                        cell: dict[str, float | str | int] = {
                            "family": family,
                            "seed": seed,
                            "staleness": s,
                            "mask_band": _json_float(band),
                            "adv_clip": _json_float(clip),
                            "relative_bias": summ["bias_norm"] / summ["g_star_norm"],
                            "relative_var": summ["var_trace"] / (cfg.batch_size * g2),
                        }
                        cell.update({k: _json_float(v) for k, v in summ.items()})
                        cells.append(cell)
    return cells


def _as_float(x: float | str | int) -> float:
    return float(x)


def mean_grid(
    cells: list[dict[str, float | str | int]], cfg: SweepConfig, family: str, staleness: float, metric: str,
    batch: int
) -> torch.Tensor:
    """Seed-mean of ``metric`` as a ``[bands, clips]`` grid; ``relative_mse``, ``scaled_mse`` and
    ``relative_var`` at ``batch``."""
    grid = torch.zeros(len(cfg.mask_bands), len(cfg.adv_clips), dtype=torch.float64)
    count = torch.zeros_like(grid)
    bands = [_json_float(c) for c in cfg.mask_bands]
    clips = [_json_float(e) for e in cfg.adv_clips]
    for cell in cells:
        if cell["family"] != family or cell["staleness"] != staleness:
            continue
        i, j = bands.index(cell["mask_band"]), clips.index(cell["adv_clip"])
        g2 = _as_float(cell["g_star_norm"]) ** 2
        var = _as_float(cell["var_trace"]) / batch
        if metric == "relative_mse":
            value = (_as_float(cell["bias_norm"]) ** 2 + var) / g2
        elif metric == "scaled_mse":  # 1 - cos² m² / (m² + var): the MSE at the best step size
            m2 = _as_float(cell["mean_update_norm"]) ** 2
            value = 1.0 - _as_float(cell["cosine"]) ** 2 * m2 / (m2 + var) if m2 + var > 0 else 1.0
        elif metric == "relative_var":
            value = var / g2
        else:
            value = _as_float(cell[metric])
        grid[i, j] += value
        count[i, j] += 1
    return grid / count.clamp(min=1)


def _reversals(grid: torch.Tensor, rows: tuple[float, ...],
               cols: tuple[float, ...]) -> list[dict[str, object]]:
    """Adjacent column steps that lower ``grid`` in some rows and raise it in others (> REVERSAL_TOL)."""
    found: list[dict[str, object]] = []
    for j in range(len(cols) - 1):
        delta = (grid[:, j + 1] - grid[:, j]) / grid[:, j]
        up = [_json_float(rows[i]) for i in range(len(rows)) if delta[i] > REVERSAL_TOL]
        down = [_json_float(rows[i]) for i in range(len(rows)) if delta[i] < -REVERSAL_TOL]
        if up and down:
            found.append(
                {
                    "from": _json_float(cols[j]),
                    "to": _json_float(cols[j + 1]),
                    "helps_under": down,
                    "hurts_under": up,
                    "largest_relative_change": [float(delta.min()), float(delta.max())],
                }
            )
    return found


def interaction_share(grid: torch.Tensor) -> float:
    """Share of the grid's variation that an additive model ``a_i + b_j`` cannot explain.

    ``||f - (row mean + column mean - grand mean)||² / ||f - grand mean||²``: 0 when the two knobs act
    separately (the best clip is then the same under every band), 1 when only their interaction matters.
    """
    centred = grid - grid.mean()
    additive = grid.mean(dim=1, keepdim=True) + grid.mean(dim=0, keepdim=True) - grid.mean()
    total = float(centred.pow(2).sum())
    return float((grid - additive).pow(2).sum()) / total if total > 0 else 0.0


def band_dependence_cost(grid: torch.Tensor) -> float:
    """What using the most common best column (``eps_A``) under every row (band) would cost: the largest
    relative increase of the loss over a row's own best. 0 when every band has the same best clip."""
    best = grid.argmin(dim=1)
    common = int(torch.mode(best).values)  # ties: the smallest column
    own = grid.gather(1, best[:, None]).squeeze(1)
    return float(((grid[:, common] - own) / own.clamp(min=1e-300)).max())


def _term_shares(cells: list[dict[str, float | str | int]], family: str, s: float) -> dict[str, float]:
    """Grid-and-seed means of the bias terms relative to ||g*|| and of the squared-weight variance share."""
    chosen = [c for c in cells if c["family"] == family and c["staleness"] == s]
    out: dict[str, float] = {}
    for key in ("state_norm", "policy_norm", "advantage_norm", "cross_norm", "bias_norm"):
        out[f"mean_{key}_over_g"] = sum(_as_float(c[key]) / _as_float(c["g_star_norm"])
                                        for c in chosen) / len(chosen)
    out["mean_var_amp_share"] = sum(_as_float(c["var_amp"]) / _as_float(c["var_trace"])
                                    for c in chosen) / len(chosen)
    return out


def loss_grid(
    cells: list[dict[str, float | str | int]], cfg: SweepConfig, family: str, staleness: float,
    criterion: str, batch: int
) -> torch.Tensor:
    """Lower-is-better ``[bands, clips]`` grid: ``relative_mse`` or ``scaled_mse`` at ``batch``, or ``1 -
    cosine``."""
    if criterion in ("relative_mse", "scaled_mse"):
        return mean_grid(cells, cfg, family, staleness, criterion, batch)
    if criterion == "one_minus_cosine":
        return 1.0 - mean_grid(cells, cfg, family, staleness, "cosine", batch)
    raise ValueError(f"unknown criterion {criterion!r}; valid: {', '.join(CRITERIA)}")


def coupling_analysis(
    cells: list[dict[str, float | str | int]], cfg: SweepConfig, batch: int, criterion: str = "relative_mse"
) -> list[dict[str, object]]:
    """Per family and staleness (seed means of ``criterion``, lower is better): best eps_A per band,
    sign reversals of the eps_A effect across bands and of the band effect across clips, the
    interaction share of the surface, and the average bias/variance split."""
    out: list[dict[str, object]] = []
    for family in cfg.families:
        for s in cfg.staleness:
            grid = loss_grid(cells, cfg, family, s, criterion, batch)
            best = [cfg.adv_clips[int(j)] for j in grid.argmin(dim=1)]
            best_band = [cfg.mask_bands[int(i)] for i in grid.argmin(dim=0)]
            entry: dict[str, object] = {
                "family": family,
                "staleness": s,
                "criterion": criterion,
                "batch_size": batch,
                "best_adv_clip_by_band": {
                    str(_json_float(c)): _json_float(e) for c, e in zip(cfg.mask_bands, best, strict=True)
                },
                "best_clip_depends_on_band": len(set(best)) > 1,
                "best_band_by_adv_clip": {
                    str(_json_float(e)): _json_float(c) for e, c in zip(cfg.adv_clips, best_band, strict=True)
                },
                "sign_reversals": _reversals(grid, cfg.mask_bands, cfg.adv_clips),
                "band_sign_reversals": _reversals(grid.T.contiguous(), cfg.adv_clips, cfg.mask_bands),
                "band_dependence_cost": band_dependence_cost(grid),
                "interaction_share": interaction_share(grid),
                "best_cell": _best_cell(grid, cfg, criterion),
            }
            if criterion == "relative_mse":
                entry["some_cell_beats_no_update"] = bool(float(grid.min()) < 1.0)
            entry.update(_term_shares(cells, family, s))
            out.append(entry)
    return out


def _best_cell(grid: torch.Tensor, cfg: SweepConfig, criterion: str) -> dict[str, float | str]:
    flat = int(grid.argmin())
    i, j = divmod(flat, grid.shape[1])
    return {
        "mask_band": _json_float(cfg.mask_bands[i]),
        "adv_clip": _json_float(cfg.adv_clips[j]),
        criterion: float(grid[i, j]),
    }


def _rounded(x: object) -> object:
    """Floats to 6 significant digits (keeps the JSON small; the figures are far coarser)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def run_sweep(
    cfg: SweepConfig, out_dir: Path, *, tag: str = "", analysis_batches: tuple[int, ...] = (8, 64, 512)
) -> dict[str, object]:
    """Run the grid, write ``lab_sweep[_tag].json`` into ``out_dir`` and return its dict (its path under
    ``"json"``); :func:`copc.lab.plots.draw_heatmaps` draws the heatmaps from ``result["cells"]``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cells = run_grid(cfg)
    elapsed = time.perf_counter() - start
    config = {k: ([_json_float(x) for x in v] if isinstance(v, tuple) and k in ("mask_bands",
                                                                                "adv_clips") else v) for k,
                                                                                v in asdict(cfg).items()}
    result: dict[str, object] = {
        "config": config,
        "seconds": elapsed,
        "cells": cells,
        "analysis": analyse(cells, cfg, analysis_batches),
    }
    result["json"] = str(out_dir / (f"lab_sweep_{tag}.json" if tag else "lab_sweep.json"))
    Path(str(result["json"])).write_text(json.dumps(_rounded(result)))
    return result


def analyse(
    cells: list[dict[str, float | str | int]], cfg: SweepConfig, analysis_batches: tuple[int, ...] = (8, 64,
                                                                                                      512)
) -> dict[str, object]:
    """The analysis block of a sweep: ``relative_mse@N`` and ``scaled_mse@N`` at every batch size, and
    ``one_minus_cosine``."""
    batches = sorted({*analysis_batches, cfg.batch_size})
    return {
        **{f"relative_mse@N={n}": coupling_analysis(cells, cfg, n) for n in batches},
        **{f"scaled_mse@N={n}": coupling_analysis(cells, cfg, n, "scaled_mse") for n in batches},
        "one_minus_cosine": coupling_analysis(cells, cfg, cfg.batch_size, "one_minus_cosine"),
    }


def reanalyse(path: Path) -> dict[str, object]:
    """Recompute the analysis block of a sweep JSON from its cells (nothing is recomputed exactly) and
    write the file back; the cells, config and timing are kept as they were. The cells are read at the
    JSON's 6 significant digits, so figures near 0 (an interaction share of 1e-6, ``1 - cos`` near 0)
    can move in their third digit against the block the sweep itself wrote."""
    cfg, _ = read_sweep(path)
    data = json.loads(Path(path).read_text())
    data["analysis"] = _rounded(analyse(data["cells"], cfg))
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return data


def read_sweep(path: Path) -> tuple[SweepConfig, list[dict[str, float | str | int]]]:
    """The config and cells of a ``lab_sweep*.json`` that :func:`run_sweep` wrote (to draw or compare
    again)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"cannot read the lab sweep {path}: {err.strerror} (run `copc lab sweep` to write "
                         "it; a relative path is from the working directory)") from None
    try:
        data = json.loads(text)
        config = dict(data["config"])
        cells = list(data["cells"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a lab sweep JSON written by `copc lab sweep` ({err})") from None
    for key in ("families", "seeds"):
        config[key] = tuple(config[key])
    for key in ("staleness", "mask_bands", "adv_clips"):  # "inf" was written as a string
        config[key] = tuple(float(x) for x in config[key])
    return SweepConfig(**config), cells
