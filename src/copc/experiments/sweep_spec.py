"""The sweep file of ``copc sweep`` (format: copc.experiments.sweep) and its expansion into cells.

A :class:`SweepSpec` names the experiment, its seeds, the overrides every cell shares, the axes (axis ->
level -> the overrides of that level) and the grids (which levels of which axes are crossed); a
:class:`Cell` is one grid point and one seed. Bad input fails with a :class:`SpecError` that names the
file, the entry and the fix.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import product
from pathlib import Path

from copc.config import ConfigError, parse_override
from copc.experiments.results import known_metric, metric_names

__all__ = ["Cell", "Heatmap", "SpecError", "SweepSpec", "expand", "load_spec", "parse_spec", "read_yaml_file"]

#: Characters allowed in axis and level names (they become file names).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class Heatmap:
    """The two-knob analysis of a joint sweep (``heatmap:``; copc.experiments.interaction): the row and
    column axes, an optional panel axis (one analysis per level) and, optionally, the lab's exact
    prediction to set beside it: its JSON, each row level's mask band ``c``, each column level's ``eps_A``
    (the panel levels are then the staleness the lab was run at) and the lab's batch size N."""

    rows: str
    cols: str
    panels: str | None = None
    lab_json: str | None = None
    lab_rows: dict[str, float] | None = None
    lab_cols: dict[str, float] | None = None
    lab_batch: int = 64


@dataclass(frozen=True)
class SweepSpec:
    experiment: str
    description: str
    seeds: tuple[int, ...]
    shared: tuple[str, ...]
    axes: dict[str, dict[str, tuple[str, ...]]]
    grids: tuple[dict[str, tuple[str, ...]], ...]
    baseline: dict[str, str]
    report: tuple[str, ...]
    heatmap: Heatmap | None = None
    #: cell id -> (config hash, why): a record made by an earlier spelling of the cell's config that
    #: computes the same thing, accepted as the cell's (``accepted_records:``; the reason is printed).
    accepted: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Cell:
    """One grid point and one seed: its id, its levels (axis -> level) and every override it runs with."""

    cell_id: str
    levels: tuple[tuple[str, str], ...]
    seed: int
    overrides: tuple[str, ...]


class SpecError(ConfigError):
    """A sweep file that cannot be expanded (the message names the file, the entry and the fix)."""


def _overrides(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        return tuple(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in value.items())
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise SpecError(f"{where}: expected a list of key=value overrides, got {value!r}")
    return tuple(value)


def _name(value: object, where: str) -> str:
    text = str(value)
    if not _NAME.match(text):
        raise SpecError(f"{where}: {text!r} must be letters, digits and . _ + - (it becomes a file name)")
    return text


def _parse_axis(name: str, value: object, where: str) -> dict[str, tuple[str, ...]]:
    if isinstance(value, Mapping) and set(value) == {"key", "values"}:
        key, values = value["key"], value["values"]
        if not isinstance(values, list) or not values:
            raise SpecError(f"{where}: 'values' must be a non-empty list")
        return {_name(v, f"{where}.values"): (f"{key}={v}",) for v in values}
    if not isinstance(value, Mapping) or not value:
        raise SpecError(f"{where}: expected level -> overrides, or {{key: K, values: [...]}}")
    return {_name(level, where): _overrides(ov, f"{where}.{level}") for level, ov in value.items()}


def parse_spec(data: Mapping[str, object], source: str = "sweep file") -> SweepSpec:
    """A :class:`SweepSpec` from the YAML mapping (module docstring); :class:`SpecError` on bad input."""
    known = {"experiment", "description", "seeds", "shared", "axes", "grids", "baseline", "report", "heatmap",
             "accepted_records"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(
            f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")
    if "experiment" not in data or "axes" not in data:
        raise SpecError(f"{source}: needs 'experiment' (a name) and 'axes' (axis -> level -> overrides)")
    experiment = _name(data["experiment"], f"{source}: experiment")
    seeds_value = data.get("seeds", 1)
    if isinstance(seeds_value, int) and seeds_value >= 1:
        seeds = tuple(range(seeds_value))
    elif isinstance(seeds_value, list) and seeds_value and all(isinstance(s, int) for s in seeds_value):
        seeds = tuple(seeds_value)
    else:
        raise SpecError(f"{source}: seeds must be a count >= 1 or a list of integers, got {seeds_value!r}")
    axes_value = data["axes"]
    if not isinstance(axes_value, Mapping) or not axes_value:
        raise SpecError(f"{source}: axes must map axis names to their levels")
    axes = {_name(a, f"{source}: axes"): _parse_axis(str(a), v, f"{source}: axes.{a}") for a,
            v in axes_value.items()}
    grids_value = data.get("grids") or [{a: "all" for a in axes}]
    if not isinstance(grids_value, list):
        raise SpecError(f"{source}: grids must be a list of {{axis: [levels] | all}}")
    grids = []
    for i, grid in enumerate(grids_value):
        where = f"{source}: grids[{i}]"
        if not isinstance(grid, Mapping) or not grid:
            raise SpecError(f"{where}: expected {{axis: [levels] | all}}")
        parsed = {}
        for axis, levels in grid.items():
            if axis not in axes:
                raise SpecError(f"{where}: unknown axis {axis!r}; axes: {', '.join(axes)}")
            chosen = list(axes[axis]) if levels == "all" else [str(v) for v in (levels if isinstance(
                levels, list) else [levels])]
            missing = [lv for lv in chosen if lv not in axes[axis]]
            if missing:
                raise SpecError(
                    f"{where}: axis {axis!r} has no level {missing[0]!r}; levels: {', '.join(axes[axis])}")
            parsed[axis] = tuple(chosen)
        grids.append(parsed)
    baseline_value = data.get("baseline") or {}
    if not isinstance(baseline_value, Mapping):
        raise SpecError(f"{source}: baseline must map axes to levels, e.g. {{method: ppo_sync}}")
    baseline = {str(a): str(lv) for a, lv in baseline_value.items()}
    for axis, level in baseline.items():
        if axis not in axes or level not in axes[axis]:
            raise SpecError(f"{source}: baseline {axis}={level} is not a level of the axes")
    report_value = data.get("report") or ["eval_last_half", "eval_final", "greedy_last_half"]
    if not isinstance(report_value, list):
        raise SpecError(f"{source}: report must be a list of metric names; valid: {metric_names()}")
    report = tuple(str(r) for r in report_value)
    bad = [r for r in report if not known_metric(r)]
    if bad:
        raise SpecError(f"{source}: report metric {bad[0]!r} unknown; valid: {metric_names()}")
    heatmap = _parse_heatmap(data["heatmap"], axes, f"{source}: heatmap") if data.get("heatmap") else None
    shared = _overrides(data.get("shared", []), f"{source}: shared")
    _check_keys(shared, axes, grids, source)
    spec = SweepSpec(experiment=experiment, description=str(data.get("description", "")), seeds=seeds,
                     shared=shared, axes=axes,
                     grids=tuple(grids), baseline=baseline, report=report, heatmap=heatmap)
    if data.get("accepted_records"):
        spec = replace(spec, accepted=_parse_accepted(data["accepted_records"], spec,
                                                      f"{source}: accepted_records"))
    return spec


def _keys(overrides: Sequence[str]) -> set[str]:
    return {".".join(parse_override(o)[0]) for o in overrides}


def _check_keys(shared: Sequence[str], axes: Mapping[str, Mapping[str, tuple[str, ...]]],
                grids: Sequence[Mapping[str, tuple[str, ...]]], source: str) -> None:
    """A key the sweep sets itself (seed, run_dir), or one that two axes of a grid both set, is an error:
    the later override would win silently and a cell would run other than its name says."""
    for where, overrides in [("shared", shared), *((f"axes.{a}.{lv}", o) for a, lv_map in axes.items()
                                                   for lv, o in lv_map.items())]:
        own = sorted(_keys(overrides) & {"seed", "run_dir"})
        if own:
            raise SpecError(f"{source}: {where} sets {own[0]}, which the sweep sets per cell; use seeds: "
                            "for seeds and --runs for run directories")
    for grid in grids:
        names = list(grid)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                for la in grid[a]:
                    for lb in grid[b]:
                        both = _keys(axes[a][la]) & _keys(axes[b][lb])
                        if both:
                            raise SpecError(
                                f"{source}: axes {a}={la} and {b}={lb} both set {sorted(both)[0]}; "
                                            "a cell would run the later one: set it in one axis")


_HASH = re.compile(r"^[0-9a-f]{16}$")


def _parse_accepted(value: object, spec: SweepSpec, where: str) -> dict[str, tuple[str, str]]:
    """``accepted_records: {CELL_ID: {config_hash: H, why: TEXT}}``: each names a cell of the file, the
    16-hex-digit hash its record was made by, and why that record computes what the cell does now."""
    form = "{cell id: {config_hash: <16 hex digits>, why: <why that record computes what the cell does now>}}"
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: expected {form}")
    cells = {c.cell_id for c in expand(spec)}
    accepted = {}
    for cell_id, entry in value.items():
        if str(cell_id) not in cells:
            raise SpecError(
                f"{where}: {cell_id!r} is no cell of this file (cell ids: axis=level__...__seedN)")
        if not isinstance(entry, Mapping) or set(entry) != {"config_hash", "why"}:
            raise SpecError(f"{where}.{cell_id}: expected {form}")
        digest, why = str(entry["config_hash"]), " ".join(str(entry["why"]).split())
        if not _HASH.match(digest) or not why:
            raise SpecError(
                f"{where}.{cell_id}: config_hash must be the record's 16 hex digits and why a reason; "
                            f"got {digest!r}, {why!r}")
        accepted[str(cell_id)] = (digest, why)
    return accepted


def _parse_heatmap(value: object, axes: Mapping[str, Mapping[str, object]], where: str) -> Heatmap:
    if not isinstance(value, Mapping) or not {"rows", "cols"} <= set(value) or not set(
        value) <= {"rows", "cols", "panels", "lab"}:
        raise SpecError(f"{where}: expected {{rows: AXIS, cols: AXIS, panels: AXIS, lab: {{...}}}} (panels, "
                        "lab optional)")
    names = {key: str(value[key]) for key in ("rows", "cols", "panels") if value.get(key) is not None}
    for key, axis in names.items():
        if axis not in axes:
            raise SpecError(f"{where}.{key}: unknown axis {axis!r}; axes: {', '.join(axes)}")
    lab = value.get("lab")
    if lab is not None and "panels" not in names:
        raise SpecError(
            f"{where}: a lab: section needs panels: the axis whose levels are the lab's staleness")
    others = [a for a in axes if a not in names.values()]
    if others:  # a cell of the grid would hold several groups, and the analysis would keep one of them
        raise SpecError(
            f"{where}: axis {others[0]!r} is neither rows, cols nor panels; each heatmap cell must be "
                        "one group: make it the panels axis, or run the other levels as another sweep file")
    if lab is None:
        return Heatmap(names["rows"], names["cols"], names.get("panels"))
    if not isinstance(lab, Mapping) or set(lab) - {"json", "rows", "cols",
                                                   "batch"} or not {"json", "rows", "cols"} <= set(lab):
        raise SpecError(f"{where}.lab: expected "
                        f"{{json: PATH, rows: {{level: mask band c}}, cols: {{level: eps_A}}, batch: N}}")
    maps = {}
    for key in ("rows", "cols"):
        levels, mapping = axes[names[key]], lab[key]
        if not isinstance(mapping, Mapping) or {str(k) for k in mapping} != set(levels):
            raise SpecError(f"{where}.lab.{key}: map every level of axis {names[key]!r} "
                            f"({', '.join(levels)}) to a number")
        try:
            maps[key] = {str(k): float(mapping[k]) for k in mapping}
        except (TypeError, ValueError):
            raise SpecError(f"{where}.lab.{key}: the values must be numbers (.inf for no band)") from None
    batch = lab.get("batch", 64)
    if not isinstance(batch, int) or batch < 1:
        raise SpecError(f"{where}.lab.batch: the lab's batch size N must be an integer >= 1, got {batch!r}")
    return Heatmap(names["rows"], names["cols"], names.get("panels"), str(lab["json"]), maps["rows"],
                   maps["cols"], batch)


def read_yaml_file(path: str | os.PathLike[str], what: str) -> object:
    """The YAML document in ``path`` (a key given twice is an error); SpecError naming the file when it cannot
    be read or parsed."""
    import yaml

    from copc.config import UniqueKeyLoader

    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=UniqueKeyLoader)  # a SafeLoader
    except OSError as err:
        raise SpecError(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError(
            f"{what} {path} is not UTF-8 text (byte {err.start}); save it as UTF-8 YAML") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None


def load_spec(path: str | os.PathLike[str]) -> SweepSpec:
    data = read_yaml_file(path, "sweep file")
    if not isinstance(data, Mapping):
        raise SpecError(f"{path}: expected a mapping with experiment, axes, ...")
    return parse_spec(data, str(path))


def expand(spec: SweepSpec) -> list[Cell]:
    """Every cell of every grid, seed outermost (a partial sweep holds complete seed pairs); duplicates
    once."""
    cells: dict[str, Cell] = {}
    for seed in spec.seeds:
        for grid in spec.grids:
            axes = [a for a in spec.axes if a in grid]  # the spec's axis order, whatever the grid's
            for combo in product(*(grid[a] for a in axes)):
                levels = tuple(zip(axes, combo, strict=True))
                level_overrides = tuple(o for a, lv in levels for o in spec.axes[a][lv])
                cell_id = "__".join([*(f"{a}={lv}" for a, lv in levels), f"seed{seed}"])
                cells.setdefault(cell_id, Cell(cell_id, levels, seed, (*spec.shared, *level_overrides)))
    return list(cells.values())
