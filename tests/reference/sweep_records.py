"""Sweep records written as a finished cell's would be (its config hash included), for report tests."""

from __future__ import annotations

from pathlib import Path

from copc.config import to_dict
from copc.experiments.results import config_hash, write_record
from copc.experiments.sweep import Paths, resolve
from copc.experiments.sweep_spec import SweepSpec, expand


def write_cell_record(spec: SweepSpec, results: Path, cell_id: str, **fields: object) -> Path:
    """Write ``results/<experiment>/<cell_id>.json`` as the cell's own record (made by the config the
    spec gives the cell) with ``fields`` (``summary``, ``evals``, ``curves`` ...) added."""
    cell = {c.cell_id: c for c in expand(spec)}[cell_id]
    paths = Paths(results, results / "runs")  # where the run lives is not part of the config hash
    digest = config_hash(to_dict(resolve(cell, paths.run_dir(cell))))
    return write_record(paths.record(spec.experiment, cell),
                        {"version": 1, "experiment": spec.experiment, "cell": cell_id,
                         "levels": dict(cell.levels),
                         "seed": cell.seed, "config_hash": digest, **fields})
