"""``copc lab sweep``, ``copc lab analyse`` and ``copc lab explain``: the bias/variance lab from the command
line.

``explain`` names its correction with production's vocabulary: ``--policy`` is an objective of
``copc.channels.POLICY_OBJECTIVES`` and ``--advantage`` an estimator of ``ADVANTAGE_ESTIMATORS``; the
other options are the fields of ``PolicyChannelConfig`` / ``AdvantageChannelConfig`` of the same name.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping
from pathlib import Path

from copc.channels import POLICY_OBJECTIVES, AdvantageChannelConfig, PolicyChannelConfig
from copc.config import CommandParser
from copc.lab.corrections import LAB_ADVANTAGE_ESTIMATORS, Correction
from copc.lab.exact import CRITIC_BASES, Critic, Decomposition, decompose
from copc.lab.mdp import REWARD_FAMILIES, behaviour_at_kl, gradient_path, make_mdp, random_logits
from copc.lab.plots import draw_heatmaps
from copc.lab.sweep import SweepConfig, reanalyse, run_sweep


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _strs(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


# ``sweep``'s options that are SweepConfig fields (each option's dest is the field's name).
SWEEP_OPTIONS: tuple[str, ...] = (
    "families",
    "seeds",
    "staleness",
    "staleness_mode",
    "horizon",
    "vocab",
    "mask_bands",
    "adv_clips",
    "batch_size",
    "lam",
    "critic_base",
    "critic_noise",
    "critic_draws",
)

# ``explain``'s correction options: each sets the production config field of the same name
# (``--mask-low`` is ``PolicyChannelConfig.mask_low``). Defaults are production's, except the PPO clip:
# symmetric 0.2 (at cur = old it binds only in bypass_ppo) and lambda 1 (the sweep's).
POLICY_OPTIONS: dict[str, float | str] = {
    "mask_low": 0.5,
    "mask_high": 2.0,
    "weight_mode": "masked_is",
    "clip_low": 0.2,
    "clip_high": 0.2,
    "weight_cap": 5.0,
    "cap_mode": "mask",
}
ADVANTAGE_OPTIONS: dict[str, float | int] = {
    "lam_critic": 1.0,
    "lam_actor": 1.0,
    "ratio_low": 0.8,
    "ratio_high": 1.2,
    "rho_bar": 1.0,
    "c_bar": 1.0,
    "pg_rho_bar": 1.0,
    "brace_k": 100,
}


def _config_options(
    parser: argparse.ArgumentParser, owner: str, registry: tuple[str, str, tuple[str, ...], str],
    options: Mapping[str, object]
) -> None:
    """One option per config field; ``registry`` = (flag, field, registered names, default) of the name."""
    group = parser.add_argument_group(owner, f"fields of copc.channels.{owner} (checked by the config)")
    flag, field, names, chosen = registry
    group.add_argument(flag, dest=field, choices=names, default=chosen, help=f"{field} (default {chosen})")
    for name, default in options.items():
        flag = "--" + name.replace("_", "-")
        group.add_argument(flag, dest=name, type=type(default), default=default, help=f"default {default}")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="copc lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = SweepConfig()
    sw = sub.add_parser("sweep", help="exact bias/variance/MSE over a (mask band x advantage clip) grid")
    sw.add_argument("--out", type=Path, default=Path("docs/figures"),
                    help="folder for lab_*.png and lab_sweep.json")
    sw.add_argument("--tag", default="", help="name files lab_<tag>_<metric>.png and lab_sweep_<tag>.json")
    sw.add_argument("--families", type=_strs, default=d.families,
                    help="comma list of " + ",".join(REWARD_FAMILIES))
    sw.add_argument("--seeds", type=_ints, default=d.seeds)
    sw.add_argument("--staleness", type=_floats, default=d.staleness, help="steps (path) or KL targets (kl)")
    sw.add_argument("--staleness-mode", choices=("path", "kl"), default=d.staleness_mode)
    sw.add_argument("--horizon", type=int, default=d.horizon)
    sw.add_argument("--vocab", type=int, default=d.vocab)
    sw.add_argument("--mask-bands", type=_floats, default=d.mask_bands,
                    help="c values of the band [1/c, c]; inf allowed")
    sw.add_argument("--adv-clips", type=_floats, default=d.adv_clips, help="eps_A values; inf allowed")
    sw.add_argument("--batch-size", type=int, default=d.batch_size)
    sw.add_argument("--lam", type=float, default=d.lam)
    sw.add_argument("--critic", dest="critic_base", choices=CRITIC_BASES, default=d.critic_base)
    sw.add_argument("--critic-noise", type=float, default=d.critic_noise)
    sw.add_argument("--critic-draws", type=int, default=d.critic_draws)

    an = sub.add_parser("analyse", help="recompute the analysis block of sweep JSON files from their cells")
    an.add_argument("files", type=Path, nargs="+", help="lab_sweep*.json files written by `copc lab sweep`")

    ex = sub.add_parser("explain", help="print the decomposition of one correction as a table")
    ex.add_argument("--family", choices=REWARD_FAMILIES, default="dense")
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--horizon", type=int, default=6)
    ex.add_argument("--vocab", type=int, default=3)
    ex.add_argument("--staleness", type=int, default=4, help="mu = pi s normalised gradient steps earlier")
    ex.add_argument("--kl", type=float, default=None, help="instead of --staleness: mu at this KL(pi || mu)")
    policy = ("--policy", "objective", POLICY_OBJECTIVES.names(), "copc")
    _config_options(ex, "PolicyChannelConfig", policy, POLICY_OPTIONS)
    advantage = ("--advantage", "estimator", LAB_ADVANTAGE_ESTIMATORS, "clipped_td")
    _config_options(ex, "AdvantageChannelConfig", advantage, ADVANTAGE_OPTIONS)
    ex.add_argument("--critic", choices=CRITIC_BASES, default="mu")
    ex.add_argument("--critic-noise", type=float, default=0.0)
    ex.add_argument("--critic-draws", type=int, default=4)
    ex.add_argument("--batch-size", type=int, default=64)
    return parser


def explain_table(d: Decomposition, header: str) -> str:
    """The decomposition as a plain-text table (norms, share of ||g*||, cosine with g*)."""
    g = d.g_star
    gn = float(g.norm())

    def row(name: str, vec_norm: float, cos: float | None) -> str:
        rel = vec_norm / gn if gn > 0 else math.nan
        c = "" if cos is None else f"{cos:+.3f}"
        return f"  {name:<44}{vec_norm:>11.4g}{rel:>11.3f}{c:>10}"

    def cos(v: object) -> float:
        import torch

        assert isinstance(v, torch.Tensor)
        den = float(v.norm()) * gn
        return float((v * g).sum()) / den if den > 0 else 0.0

    s = d.summary()
    lines = [header, f"  {'':<44}{'norm':>11}{'/ ||g*||':>11}{'cos g*':>10}"]
    lines.append(row("g* = grad J(pi) (true gradient)", gn, 1.0))
    lines.append(row("E[ĝ] (expected update, one trajectory)", s["mean_update_norm"], d.cosine))
    lines.append(row("bias = E[ĝ] - g*", s["bias_norm"], cos(d.bias)))
    lines.append(row("  state distribution (d^mu vs d^pi)", s["state_norm"], cos(d.state_term)))
    lines.append(row("  policy channel  E[e^w A grad]", s["policy_norm"], cos(d.policy_term)))
    lines.append(row("  advantage channel  E[w e^A grad]", s["advantage_norm"], cos(d.advantage_term)))
    lines.append(row("  cross  E[e^w e^A grad]", s["cross_norm"], cos(d.cross_term)))
    g2 = gn**2 if gn > 0 else math.nan
    lines.append(f"  {'variance (trace, one trajectory)':<44}{'value':>11}{'/ ||g*||²':>11}")
    for name, v in [
        ("tr Cov[ĝ]", d.var_trace),
        ("  squared-weight  E[|grad|² Var(wÂ | h_t)]", d.var_amp),
        ("  token/weight sampling  Cov(w E[Â|h] grad)", d.var_tok),
        ("  (advantage uncertainty with w := 1)", d.var_amp_unweighted),
    ]:
        lines.append(f"  {name:<44}{v:>11.4g}{v / g2:>11.3f}")
    amp = d.var_amp / d.var_amp_unweighted if d.var_amp_unweighted > 0 else math.nan
    lines.append(f"  squared-weight amplification  amp / amp(w := 1) = {amp:.3f}; E[w²] per token = "
                 f"{d.mean_omega_sq:.3f}")
    lines.append(
        f"  MSE at N={d.batch_size}: {d.mse:.4g} (relative {s['relative_mse']:.3f}); "
        f"mask rate {d.mask_rate:.3f}; KL(pi||mu) {d.kl:.4f} nats"
    )
    return "\n".join(lines)


def _explain(args: argparse.Namespace) -> int:
    mdp = make_mdp(args.family, args.horizon, args.vocab, seed=args.seed)
    init = random_logits(mdp, scale=SweepConfig().init_scale, seed=args.seed + 100)
    # the same path as `copc lab sweep` (20 normalised steps of length 0.5) for s <= 20; a larger s needs a
    # longer path, so pi is then further along it than the sweep's
    cfg = SweepConfig()
    path = gradient_path(mdp, init, steps=max(cfg.path_steps, args.staleness), lr=cfg.step_size,
                         normalize=True)
    pi = path[-1]
    mu = behaviour_at_kl(mdp, pi, args.kl,
                         seed=args.seed) if args.kl is not None else path[-1 - args.staleness]
    corr = Correction(
        PolicyChannelConfig(objective=args.objective, **{name: getattr(args,
                                                                       name) for name in POLICY_OPTIONS}),
        AdvantageChannelConfig(
            estimator=args.estimator, whiten=False, **{name: getattr(args,
                                                                     name) for name in ADVANTAGE_OPTIONS}
        ),
    )
    noisy = args.critic_noise > 0
    critic = Critic(base=args.critic, noise_std=args.critic_noise, draws=args.critic_draws if noisy else 1)
    d = decompose(mdp, pi, mu, corr, critic, batch_size=args.batch_size)
    stale = f"KL target {args.kl}" if args.kl is not None else f"s={args.staleness} steps"
    crit = f"V^{args.critic}" + (f" + N(0, {args.critic_noise:g}²) x {args.critic_draws} draws" if noisy
                                 else "")
    header = (
        f"copc lab explain: {args.family} (seed {args.seed}), H={args.horizon} K={args.vocab}, {stale}\n"
        f"correction: {corr.label()}; critic {crit}"
    )
    print(explain_table(d, header))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    cfg = SweepConfig(**{name: getattr(args, name) for name in SWEEP_OPTIONS})
    start = time.perf_counter()
    result = run_sweep(cfg, args.out, tag=args.tag)
    cells = result["cells"]
    assert isinstance(cells, list)
    figures = draw_heatmaps(cells, cfg, args.out, tag=args.tag)
    print(f"copc lab sweep: {len(cells)} cells in {time.perf_counter() - start:.1f} s")
    for path in [result["json"], *figures]:
        print(f"  {path}")
    return 0


def lab_cli(argv: list[str]) -> int:
    """Entry point of ``copc lab ...`` (wired into ``copc.cli`` by the lead)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "analyse":
            for path in args.files:
                reanalyse(path)
                print(f"copc lab analyse: {path}")
            return 0
        return _explain(args) if args.command == "explain" else _sweep(args)
    except ValueError as err:
        print(f"copc lab: {err}")
        return 2
