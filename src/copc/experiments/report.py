"""What ``copc sweep FILE --report`` prints and, with ``--plot DIR``, draws, from the records alone
(those the file's cells made now, or accepts; any other record file is named as left out).

- the code behind the records (:func:`code_text`: their commits, or ``unknown`` for older records);
- the table of every report metric (copc.experiments.tables.report_text): seed means with their t
  intervals, and each group's paired difference from the baseline;
- with ``--contrasts FILE``: the pre-registered contrasts with their verdicts (copc.experiments.contrasts);
- with ``--collapse``: E4's collapse count per group (copc.experiments.tables.collapse_text);
- for a sweep with a ``heatmap:`` section (a joint sweep, E2): per panel and metric, the two-knob
  analysis (copc.experiments.interaction) with the lab's exact prediction beside it;
- figures: ``<experiment>_curves.png``, ``<experiment>_summary.png``, ``<experiment>_diagnostics.png``
  (the records' diagnostic curves: drift, what each channel did, ESS, critic, entropy, tool use) and, for
  a joint sweep, ``<experiment>_heatmaps.png`` (its first report metric).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from copc.experiments.contrasts import ContrastSet, check_terms, contrasts_text
from copc.experiments.sweep import Paths, report_records
from copc.experiments.sweep_spec import Cell, SweepSpec, expand
from copc.experiments.tables import collapse_text, record_evals, report_text
from copc.run.readers import run_progress

__all__ = ["DIAGNOSTIC_PANELS", "ORACLE_PANELS", "code_text", "print_report"]

#: The diagnostic curves drawn by ``--plot`` (record["curves"] names, copc.experiments.results).
DIAGNOSTIC_PANELS = ("drift", "mask_rate", "ppo_clip_low", "adv_clip_low", "adv_clip_high", "ess_seq",
                     "critic_explained_var", "entropy_mc", "tool_use_rate")
#: The Monte-Carlo oracle's curves (``oracle.every`` runs only), drawn as ``<experiment>_oracle.png``:
#: each advantage estimate's error against the oracle, the staleness it comes from and the critic's fit.
ORACLE_PANELS = ("oracle_gae_excess", "oracle_clipped_td_minus_gae", "oracle_vtrace_minus_gae",
                 "oracle_gae_mse", "oracle_lag0_gae_mse", "oracle_noise_var", "oracle_critic_value_corr",
                 "offpolicy_sum_abs_log_w", "offpolicy_trace_clip_median")


def code_text(records: Sequence[Mapping[str, object]]) -> str:
    """One line naming the code behind the records: each commit (12 hex digits, ``+dirty`` when its
    package differed from the commit) with its record count; records made before records named their
    code, or outside a git checkout, count as ``unknown``."""
    counts: dict[str, int] = {}
    for record in records:
        commit = record.get("commit")
        name = f"{str(commit)[:12]}{'+dirty' if record.get('commit_dirty') else ''}" if commit else "unknown"
        counts[name] = counts.get(name, 0) + 1
    return "code: " + ", ".join(f"{name} ({n} record{'s' if n != 1 else ''})" for name,
                                n in sorted(counts.items()))


def print_report(spec: SweepSpec, cells: Sequence[Cell], paths: Paths, *, baseline: Mapping[str, str] | None,
                 collapse: tuple[str, float, int] | None, plot_dir: Path | None,
                 contrasts: ContrastSet | None = None, markdown: bool = False) -> None:
    """Print the report of the cells' records (copc.experiments.sweep.report_records: only those the
    cells' configs made, the others named as left out) and draw its figures."""
    if contrasts is not None:
        check_terms(contrasts, spec.axes, [c.levels for c in expand(spec)])
    records, left_out = report_records(spec, cells, paths)
    if collapse is not None and records:  # a misspelt metric skipped every evaluation: "0 of n" collapses
        evals = [e for r in records for e in record_evals(r)]
        held = sorted({str(k) for e in evals for k in e if k != "step"})
        if not any(collapse[0] in e for e in evals):
            raise ValueError(
                f"--collapse: no record's evaluations hold {collapse[0]!r}; they hold: {', '.join(held)}")
    print(f"experiment {spec.experiment}: {len(records)} of {len(cells)} cells recorded")
    if records:
        print(code_text(records))
    for line in left_out:
        print(line)
    for cell in cells:  # a cell being trained, or stopped before its end, has a run but no record yet
        if not paths.record(spec.experiment, cell).is_file() and paths.run_dir(cell).is_dir():
            print(f"not recorded yet: {cell.cell_id}: {run_progress(paths.run_dir(cell))}")
    print(report_text(records, spec.report, baseline or None, markdown=markdown))
    if not records:
        return
    if contrasts is not None:
        print("\n" + contrasts_text(contrasts, records, markdown=markdown))
    if collapse is not None:
        metric, margin, patience = collapse
        print("\n" + collapse_text(records, metric, margin=margin, patience=patience))
    if spec.heatmap is not None:
        from copc.experiments.interaction import heatmap_text

        print("\n" + heatmap_text(records, spec))
    if plot_dir is None:
        return
    from copc.experiments.figures import plot_curves, plot_diagnostics, plot_heatmaps, plot_summary

    title = f"{spec.experiment}: seed mean (band: min-max over seeds)"
    drawn = [plot_curves(records, ["accuracy", "greedy_accuracy"], plot_dir / f"{spec.experiment}_curves.png",
                         title=title),
             plot_summary(records, list(spec.report), plot_dir / f"{spec.experiment}_summary.png",
                          title=f"{spec.experiment}: seed mean, 95% t interval over seeds")]
    for curves, name, what in ((DIAGNOSTIC_PANELS, "diagnostics", "diagnostic curves"),
                               (ORACLE_PANELS, "oracle", "advantage error against the Monte-Carlo oracle")):
        figure = plot_diagnostics(records, curves, plot_dir / f"{spec.experiment}_{name}.png",
                                  title=f"{spec.experiment}: {what}, seed mean per bin")
        if figure is not None:
            drawn.append(figure)
    if spec.heatmap is not None:
        from copc.experiments.interaction import heatmap_panels

        panels = heatmap_panels(records, spec, spec.report[0])
        if any(p.result is not None for p in panels):
            drawn.append(plot_heatmaps(panels, spec.heatmap.rows, spec.heatmap.cols, spec.heatmap.panels,
                                       plot_dir / f"{spec.experiment}_heatmaps.png",
                                       title=f"{spec.experiment}: seed means of the loop beside the lab's "
                                             "prediction"))
    for path in drawn:
        print(f"wrote {path}")
