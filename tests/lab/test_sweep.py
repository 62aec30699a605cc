"""`copc lab sweep` / `copc lab explain`: outputs exist, numbers are consistent, analysis finds reversals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from copc.lab.cli import lab_cli
from copc.lab.sweep import SweepConfig, coupling_analysis, mean_grid


def _tiny(**kw) -> SweepConfig:
    base = dict(
        families=("dense",),
        seeds=(0,),
        horizon=3,
        vocab=2,
        staleness=(1, 3),
        path_steps=4,
        mask_bands=(1.5, math.inf),
        adv_clips=(0.0, math.inf),
        batch_size=16,
    )
    base.update(kw)
    return SweepConfig(**base)


def test_sweep_cli_writes_json_and_heatmaps(tmp_path, capsys):
    out = tmp_path / "figs"
    argv = ["sweep", "--out", str(out), "--families", "dense,sparse", "--seeds", "0", "--staleness", "1,2"]
    argv += ["--horizon", "3", "--vocab", "2", "--mask-bands", "1.5,inf", "--adv-clips", "0,0.5,inf"]
    assert lab_cli(argv) == 0
    data = json.loads((out / "lab_sweep.json").read_text())
    assert len(data["cells"]) == 2 * 1 * 2 * 2 * 3
    for name in ("relative_mse", "relative_bias", "relative_var", "cosine"):
        assert (out / f"lab_{name}.png").stat().st_size > 10_000
    cell = data["cells"][0]
    # MSE = ||bias||² + tr Cov / N, stored consistently (the JSON keeps 6 significant digits: rel 1e-5)
    assert cell["mse"] == pytest.approx(cell["bias_norm"] ** 2 + cell["var_trace"] / cell["batch_size"],
                                        rel=1e-5)
    assert cell["var_trace"] == pytest.approx(cell["var_amp"] + cell["var_tok"], rel=1e-5)
    assert {"relative_mse@N=8", "relative_mse@N=64", "relative_mse@N=512",
            "one_minus_cosine"} <= set(data["analysis"])
    assert "cells in" in capsys.readouterr().out


def test_no_mask_and_no_clip_cell_is_stale_gae_with_masked_is():
    # eps_A = 0 and c = inf: the clipped-TD advantage is plain GAE and omega = w (copc, uncapped masked
    # IS); its mean grid entry must equal a direct decomposition of that correction.
    from copc.channels import AdvantageChannelConfig, PolicyChannelConfig
    from copc.lab.corrections import Correction
    from copc.lab.exact import decompose
    from copc.lab.mdp import gradient_path, make_mdp, random_logits
    from copc.lab.sweep import run_grid

    cfg = _tiny()
    cells = run_grid(cfg)
    grid = mean_grid(cells, cfg, "dense", 3, "relative_bias", cfg.batch_size)
    mdp = make_mdp("dense", 3, 2, seed=0)
    path = gradient_path(mdp, random_logits(mdp, scale=0.5, seed=100), steps=4, lr=0.5, normalize=True)
    corr = Correction(
        PolicyChannelConfig(objective="copc", mask_low=0.0, mask_high=math.inf),
        AdvantageChannelConfig(estimator="gae", whiten=False),
    )
    d = decompose(mdp, path[-1], path[-4], corr, batch_size=16)
    assert float(grid[1, 0]) == pytest.approx(float(d.bias.norm() / d.g_star.norm()), rel=1e-6)


def test_coupling_analysis_detects_a_sign_reversal():
    # Synthetic cells: loosening the clip (0 -> inf) lowers the MSE under band 1.5 (1.0 -> 0.5) and
    # raises it under band inf (1.0 -> 2.0): one reversal, and the best clip depends on the band.
    cfg = _tiny(staleness=(1,))
    cells = []
    for band, clip, bias in [(1.5, 0.0, 1.0), (1.5, "inf", 0.5**0.5), ("inf", 0.0, 1.0), ("inf", "inf",
                                                                                          2**0.5)]:
        cells.append(
            {"family": "dense", "staleness": 1, "mask_band": band, "adv_clip": clip, "g_star_norm": 1.0,
             "bias_norm": bias, "var_trace": 1e-30, "var_amp": 0.0, "cosine": 1.0, "kl": 0.1,
             "state_norm": 0.0, "policy_norm": 0.0, "advantage_norm": 0.0, "cross_norm": 0.0}
        )
    (res,) = coupling_analysis(cells, cfg, batch=16)
    assert res["best_clip_depends_on_band"] is True
    assert res["best_adv_clip_by_band"] == {"1.5": "inf", "inf": 0.0}
    (rev,) = res["sign_reversals"]
    assert rev["helps_under"] == [1.5] and rev["hurts_under"] == ["inf"]
    # f = [[1, .5], [1, 2]], grand mean 1.125, row means (.75, 1.5), column means (1, 1.25): additive
    # fit [[.625, .875], [1.375, 1.625]], residual ±0.375 everywhere: 4·0.140625 / sum((f - 1.125)²)
    # = 0.5625 / 1.1875.
    assert res["interaction_share"] == pytest.approx(0.5625 / 1.1875, rel=1e-12)


def test_scaled_mse_is_the_mse_at_the_best_step_size():
    """``scaled_mse = min_a E||a ĝ - g*||² / ||g*||²``, worked by hand for one cell and checked against a
    scan over a: ||g*|| = 2, E ĝ at 60° with norm 1, tr Cov/N = 3 -> 1 - (1/4) · 1 / (1 + 3) = 15/16.
    A short update (E ĝ = 0.1 g*, no noise) scores 0.81 in relative MSE but 0 at its best step size."""
    cfg = _tiny(staleness=(1,), mask_bands=(1.5,), adv_clips=(0.0,))
    cell = {"family": "dense", "staleness": 1, "mask_band": 1.5, "adv_clip": 0.0, "g_star_norm": 2.0,
            "mean_update_norm": 1.0, "cosine": 0.5, "bias_norm": math.sqrt(1 + 4 - 2 * 1 * 2 * 0.5),
            "var_trace": 3.0 * 16}
    assert float(mean_grid([cell], cfg, "dense", 1, "scaled_mse", 16)) == pytest.approx(15 / 16)
    g, m, var = 2.0, 1.0, 3.0  # brute force: E||a ĝ - g||² = a²(m² + var) - 2 a m g cos + g²
    best = min(a * a * (m * m + var) - 2 * a * m * g * 0.5 + g * g for a in [i / 10_000 for i in range(
        20_001)])
    assert best / (g * g) == pytest.approx(15 / 16, abs=1e-7)
    short = {**cell, "g_star_norm": 1.0, "mean_update_norm": 0.1, "cosine": 1.0, "bias_norm": 0.9,
             "var_trace": 0.0}
    assert float(mean_grid([short], cfg, "dense", 1, "relative_mse", 16)) == pytest.approx(0.81)
    assert float(mean_grid([short], cfg, "dense", 1, "scaled_mse", 16)) == pytest.approx(0.0, abs=1e-12)


def test_band_dependence_has_a_cost_and_no_update_is_the_bar():
    """The analysis says how much the band-dependence of the best clip is worth (using the most common
    best clip everywhere) and whether any cell beats not updating (relative MSE below 1)."""
    import torch

    from copc.lab.sweep import band_dependence_cost

    assert band_dependence_cost(torch.tensor([[1.0, 0.5], [1.0, 2.0], [1.0, 0.9]],
                                             dtype=torch.float64)) == pytest.approx(1.0)
    assert band_dependence_cost(torch.tensor([[1.0, 1.001], [2.0, 3.0]], dtype=torch.float64)) == 0.0
    cfg = _tiny(staleness=(1,))
    cells = [{"family": "dense", "staleness": 1, "mask_band": b, "adv_clip": c, "g_star_norm": 1.0,
              "bias_norm": 1.1,
              "mean_update_norm": 0.2, "var_trace": 1e-30, "var_amp": 0.0, "cosine": 0.1, "kl": 0.1,
              "state_norm": 0.0,
              "policy_norm": 0.0, "advantage_norm": 0.0, "cross_norm": 0.0}
             for b in (1.5, "inf") for c in (0.0, "inf")]
    (res,) = coupling_analysis(cells, cfg, batch=16)
    assert res["some_cell_beats_no_update"] is False and res["band_dependence_cost"] == 0.0
    (scaled,) = coupling_analysis(cells, cfg, batch=16, criterion="scaled_mse")
    assert "some_cell_beats_no_update" not in scaled and scaled["best_cell"]["scaled_mse"] == pytest.approx(
        0.99)


def _close(a: object, b: object) -> bool:
    """Equal up to the JSON's 6 significant digits carried through the analysis (rel 1e-3, abs 1e-6)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_analyse_rewrites_only_the_analysis_block(tmp_path, capsys):
    out = tmp_path / "figs"
    argv = ["sweep", "--out", str(out), "--families", "dense", "--seeds", "0", "--staleness", "1",
            "--horizon", "3", "--vocab", "2", "--mask-bands", "1.5,inf", "--adv-clips", "0,inf"]
    assert lab_cli(argv) == 0
    path = out / "lab_sweep.json"
    before = json.loads(path.read_text())
    stale = {**before, "analysis": {"relative_mse@N=64": []}}
    path.write_text(json.dumps(stale))
    assert lab_cli(["analyse", str(path)]) == 0
    after = json.loads(path.read_text())
    # the block run_sweep wrote, from the same cells (read back at the JSON's 6 significant digits)
    assert _close(after["analysis"], before["analysis"]) and after["cells"] == before["cells"]
    assert after["seconds"] == before["seconds"] and after["config"] == before["config"]
    assert {"scaled_mse@N=8", "scaled_mse@N=64", "scaled_mse@N=512"} <= set(after["analysis"])
    assert lab_cli(["analyse", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the lab sweep" in capsys.readouterr().out


def test_explain_prints_the_decomposition(capsys):
    argv = ["explain", "--family", "deceptive", "--horizon", "3", "--vocab", "2", "--staleness", "2"]
    assert lab_cli([*argv, "--critic-noise", "0.1"]) == 0
    text = capsys.readouterr().out
    for needle in ("policy channel", "advantage channel", "cross", "squared-weight", "MSE at N=64"):
        assert needle in text
    assert lab_cli(["explain", "--kl", "0.1", "--horizon", "3", "--vocab", "2", "--policy",
                    "bypass_ppo"]) == 0
    assert ("correction: bypass_ppo(clip_low=0.2, clip_high=0.2, mask_low=0.5, mask_high=2) x clipped_td("
            in capsys.readouterr().out)


def test_bad_grid_says_what_to_do(capsys):
    with pytest.raises(ValueError, match="unknown reward families"):
        _tiny(families=("dense", "nope"))
    assert lab_cli(["explain", "--horizon", "12", "--vocab", "4"]) == 2
    assert "too many" in capsys.readouterr().out


def test_kl_staleness_mode_hits_the_kl_targets():
    from copc.lab.sweep import run_grid

    cfg = _tiny(staleness_mode="kl", staleness=(0.05, 0.3), mask_bands=(2.0,), adv_clips=(0.2,))
    cells = run_grid(cfg)
    assert [round(float(c["kl"]), 4) for c in cells] == [0.05, 0.3]
    with pytest.raises(ValueError, match="whole steps"):
        _tiny(staleness=(1.5,))



def test_sweep_does_not_import_the_plots():
    # The sweep returns data and the CLI draws it: plots imports sweep, never the other way round (not
    # even inside a function, which is how the old circle hid).
    import ast

    import copc.lab.sweep as sweep

    tree = ast.parse(Path(sweep.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {"copc.lab.plots", "copc.lab.cli"} & imported
