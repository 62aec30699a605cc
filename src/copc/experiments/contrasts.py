"""Pre-registered contrasts of a sweep's records, each with its verdict (``copc sweep FILE --report
--contrasts CONTRASTS.yaml``).

A contrast is a claim about a per-seed combination of group means, written as an expression over the
sweep's levels and compared with 0::

    copc_behaviour - async_ppo > 0
    (copc_behaviour - async_ppo_mask) - (async_ppo_advantage - async_ppo) != 0
    copc_behaviour - max(async_ppo_mask, async_ppo_advantage) > 0
    'method=copc_proximal,lr=1e-4,mb=4' - 'method=copc_proximal,lr=2.5e-5,mb=1' > 0

A bare name is a level of any axis; a quoted ``axis=level[,axis=level]`` selector names levels where a
bare name is not enough (a level that is not an identifier, or one shared by several groups). Each term
must select exactly one grid point of the sweep (checked against its file, not against the records so
far); a claim whose groups are not all recorded yet gets no verdict. The expression may add and subtract
terms, multiply them by a number (a number is never added: ``16`` or ``0.8-1.2`` as a level is written
``'s=16'``) and take ``max``/``min`` of terms; it is evaluated seed by seed on the seeds every term has (the
seeds are
paired: one warm start and one prompt stream per seed), and the mean of those values gets the Student-t
interval over seeds (copc.experiments.stats.t_interval).

The verdict follows docs/results.md's rule. For ``> 0`` (``< 0`` alike): **held** when the interval lies
above 0, **not held** when it lies below, otherwise **not resolved at this scale**. For ``!= 0``: held
when the interval excludes 0, otherwise not resolved (a point null cannot be excluded). A group of
contrasts under ``all:`` (an intersection-union test, as C1's "beats every baseline") is held when every
member is held, not held when any member is not held, otherwise not resolved. With fewer seeds than the
file's ``seeds:`` (the pre-registered count) no verdict is given, only the numbers so far.

The file::

    metric: eval_after_start        # the summary figure the claims are about
    seeds: 8                        # verdicts only once this many paired seeds are in
    contrasts:
      - name: C2 the channels interact
        claim: (copc_behaviour - async_ppo_mask) - (async_ppo_advantage - async_ppo) != 0
      - name: L1 a within-arm diagnostic  # an entry's own metric wins for that entry
        metric: mean:oracle_gae_excess
        claim: async_ppo > 0
      - name: C1 R1 beats every baseline
        all: [copc_behaviour - async_ppo > 0, copc_behaviour - areal > 0]
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from copc.experiments.results import known_metric, metric_names
from copc.experiments.stats import Interval, t_interval
from copc.experiments.sweep_spec import SpecError, read_yaml_file
from copc.experiments.tables import by_group, group_text, same_start, start_keys

__all__ = ["Claim", "Contrast", "ContrastSet", "Verdict", "check_terms", "contrasts_text", "evaluate",
           "load_contrasts", "parse_claim"]

HELD, NOT_HELD, NOT_RESOLVED, NO_VERDICT = "held", "not held", "not resolved at this scale", "no verdict yet"
_OPS = {ast.Gt: ">", ast.Lt: "<", ast.NotEq: "!="}
_Key = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Claim:
    """``expression OP 0`` with the expression's tree kept for evaluation."""

    text: str
    expression: ast.expr
    op: str


@dataclass(frozen=True)
class Verdict:
    text: str
    interval: Interval | None
    seeds: tuple[int, ...]
    verdict: str
    # seeds every term has, left out: their records start from different policies
    unpaired: tuple[int, ...] = ()
    values: tuple[float, ...] = ()  # the claim's paired value at each of ``seeds``


@dataclass(frozen=True)
class Contrast:
    """One named entry: its claims, whether they form an ``all:`` group, and the figure they are about."""

    name: str
    claims: tuple[Claim, ...]
    is_all: bool
    metric: str


@dataclass(frozen=True)
class ContrastSet:
    metric: str
    seeds: int
    entries: tuple[Contrast, ...]


def _check_tree(node: ast.AST, text: str) -> None:
    bad = f"contrast {text!r}: "
    if isinstance(node, ast.BinOp):
        if not isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            raise SpecError(bad + "only +, - and * by a number are allowed")
        if isinstance(node.op, ast.Mult) and not any(_is_number(n) for n in (node.left, node.right)):
            raise SpecError(bad + "a product needs a number on one side (e.g. 0.5 * (a + b))")
        if isinstance(node.op, ast.Add | ast.Sub) and any(_is_number(n) for n in (node.left, node.right)):
            raise SpecError(
                bad + "a number is added or subtracted; numbers only multiply (0.5 * (a + b)), and a "
                            "level that is not a name (0.8-1.2, 16) is "
                            "written as a quoted 'axis=level' selector")
        _check_tree(node.left, text)
        _check_tree(node.right, text)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, ast.USub | ast.UAdd):
            raise SpecError(bad + "only a leading - or + is allowed")
        _check_tree(node.operand, text)
    elif isinstance(node, ast.Call):
        if not (isinstance(node.func, ast.Name) and node.func.id in ("max", "min")) or len(
            node.args) < 2 or node.keywords:
            raise SpecError(bad + "the only functions are max(a, b, ...) and min(a, b, ...)")
        for arg in node.args:
            _check_tree(arg, text)
    elif isinstance(node, ast.Name) or _is_number(node):
        return
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        if not all(len(p.split("=")) == 2 and all(p.split("=")) for p in node.value.split(",")):
            raise SpecError(bad + f"selector {node.value!r}: expected 'axis=level[,axis=level]'")
    else:
        raise SpecError(bad + "expected levels (names or 'axis=level' strings), numbers, + - *, max and min")


def _is_number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value,
                                                         int | float) and not isinstance(node.value, bool)


def parse_claim(text: str) -> Claim:
    """``EXPRESSION > 0``, ``< 0`` or ``!= 0``; SpecError naming the problem otherwise."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise SpecError(
            f"contrast {text!r}: not an expression; write e.g. 'copc_behaviour - async_ppo > 0'") from None
    if not (isinstance(tree, ast.Compare) and len(tree.ops) == 1 and type(tree.ops[0]) in _OPS
            and _is_number(tree.comparators[0]) and tree.comparators[0].value == 0):  # type: ignore[attr-defined]
        raise SpecError(f"contrast {text!r}: a claim compares an expression with 0 by >, < or != "
                        "(e.g. 'copc_behaviour - async_ppo > 0')")
    _check_tree(tree.left, text)
    return Claim(text.strip(), tree.left, _OPS[type(tree.ops[0])])


def _select(term: str, groups: Sequence[_Key], where: str) -> _Key | None:
    """The one recorded group ``term`` names, None when none is recorded yet; SpecError when several."""
    if "=" in term:
        wanted = [tuple(p.split("=", 1)) for p in term.split(",")]
        hits = [k for k in groups if all(pair in k for pair in wanted)]
    else:
        hits = [k for k in groups if any(level == term for _, level in k)]
    if len(hits) > 1:
        raise SpecError(
            f"{where}: term {term!r} selects {len(hits)} groups ({'; '.join(group_text(k) for k in hits)}); "
                        "name one with 'axis=level[,axis=level]'")
    return hits[0] if hits else None


def check_terms(contrasts: ContrastSet, axes: Mapping[str, Mapping[str, object]],
                groups: Sequence[_Key]) -> None:
    """SpecError for a term that names no level of the sweep's ``axes`` (a typo, not a cell still to run),
    or that does not select exactly one of the sweep's ``groups`` (every grid point's levels): a term is
    resolved against the whole grid, so its meaning cannot change as cells are recorded."""
    groups = list(dict.fromkeys(groups))  # one per grid point (the cells repeat them per seed)
    for name, claims in ((c.name, c.claims) for c in contrasts.entries):
        for claim in claims:
            for term in _terms(claim.expression):
                pairs = [tuple(p.split("=", 1)) for p in term.split(",")] if "=" in term else None
                known = (all(a in axes and lv in axes[a] for a, lv in pairs) if pairs is not None
                         else any(term in levels for levels in axes.values()))
                where = f"contrast {claim.text!r} ({name})"
                if not known:
                    listed = "; ".join(f"{a}: {', '.join(map(str, levels))}" for a, levels in axes.items())
                    raise SpecError(f"{where}: {term!r} is no level of this sweep ({listed})")
                if _select(term, groups, where) is None:
                    raise SpecError(
                        f"{where}: term {term!r} selects no grid point of this sweep (its levels are "
                                    "never crossed); name one with 'axis=level[,axis=level]'")


def _evaluate(node: ast.AST, values: Callable[[str], np.ndarray]) -> np.ndarray:
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, values), _evaluate(node.right, values)
        if isinstance(node.op, ast.Add):
            return left + right
        return left - right if isinstance(node.op, ast.Sub) else left * right
    if isinstance(node, ast.UnaryOp):
        inner = _evaluate(node.operand, values)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.Call):
        stack = np.stack([_evaluate(a, values) for a in node.args])
        return stack.max(axis=0) if node.func.id == "max" else stack.min(axis=0)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name):
        return values(node.id)
    assert isinstance(node, ast.Constant) and isinstance(node.value, str | int | float)
    return values(node.value) if isinstance(node.value, str) else np.asarray(float(node.value))


def _terms(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.Call):
        return [t for arg in node.args for t in _terms(arg)]
    return [t for child in ast.iter_child_nodes(node) for t in _terms(child)]


def _verdict(interval: Interval | None, op: str) -> str:
    if interval is None or interval.low is None or interval.high is None:
        return NOT_RESOLVED
    if op == "!=":
        return HELD if interval.excludes_zero() else NOT_RESOLVED
    above, below = interval.low > 0, interval.high < 0
    if op == ">":
        return HELD if above else NOT_HELD if below else NOT_RESOLVED
    return HELD if below else NOT_HELD if above else NOT_RESOLVED


def evaluate(claim: Claim, records: Sequence[Mapping[str, object]], metric: str, *, seeds_needed: int = 0,
             confidence: float = 0.95) -> Verdict:
    """The claim's per-seed values over the seeds all its terms share, their t interval and the verdict."""
    groups = by_group(records, metric)
    selected = {term: _select(term, list(groups),
                              f"contrast {claim.text!r}") for term in _terms(claim.expression)}
    keys = {term: key for term, key in selected.items() if key is not None}
    complete = bool(keys) and len(keys) == len(selected)
    common = sorted(set.intersection(*(set(groups[k]) for k in keys.values()))) if complete else []
    starts = start_keys(records)
    shared = [s for s in common if same_start(starts, list(keys.values()), s)]
    unpaired = tuple(s for s in common if s not in shared)
    if not shared:
        return Verdict(claim.text, None, (), NO_VERDICT, unpaired)
    per_seed = _evaluate(claim.expression, lambda t: np.array([groups[keys[t]][s] for s in shared]))
    values = np.broadcast_to(per_seed, (len(shared),))
    interval = t_interval(values, confidence)
    verdict = NO_VERDICT if len(shared) < seeds_needed else _verdict(interval, claim.op)
    return Verdict(claim.text, interval, tuple(shared), verdict, unpaired, tuple(float(v) for v in values))


def _combine(verdicts: Sequence[str]) -> str:
    if NO_VERDICT in verdicts:
        return NO_VERDICT
    if all(v == HELD for v in verdicts):
        return HELD
    return NOT_HELD if NOT_HELD in verdicts else NOT_RESOLVED


def load_contrasts(path: str | Path) -> ContrastSet:
    """Read a contrasts file (module docstring); SpecError naming the file and the entry."""
    where = str(path)
    data = read_yaml_file(path, "contrasts file")
    if not isinstance(data, dict) or not isinstance(data.get("metric"),
                                                    str) or not isinstance(data.get("contrasts"), list):
        raise SpecError(f"{where}: expected a mapping with 'metric: NAME' and a 'contrasts:' list")
    if not known_metric(data["metric"]):
        raise SpecError(f"{where}: metric {data['metric']!r} unknown; valid: {metric_names()}")
    unknown = set(data) - {"metric", "seeds", "contrasts"}
    if unknown:
        raise SpecError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; the keys are metric, seeds, contrasts")
    seeds = data.get("seeds", 0)
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 0:
        raise SpecError(f"{where}: 'seeds' must be a whole number >= 0 (the pre-registered seed count)")
    entries: list[Contrast] = []
    for i, entry in enumerate(data["contrasts"]):
        ok = isinstance(entry, dict) and isinstance(entry.get("name"), str) and (
            isinstance(entry.get("claim"), str) != isinstance(entry.get("all"), list))
        if not ok or set(entry) - {"name", "claim", "all", "metric"}:
            raise SpecError(
                f"{where}: contrasts[{i}]: expected 'name:' with either 'claim: TEXT' or 'all: [TEXT, ...]' "
                "(and optionally 'metric: NAME')")
        metric = entry.get("metric", data["metric"])
        if not isinstance(metric, str) or not known_metric(metric):
            raise SpecError(f"{where}: contrasts[{i}] ({entry['name']}): metric {metric!r} unknown; valid: "
                            f"{metric_names()}")
        texts = [entry["claim"]] if "claim" in entry else entry["all"]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise SpecError(
                f"{where}: contrasts[{i}] ({entry['name']}): 'all' needs one or more claims as text")
        if any(c.name == entry["name"] for c in entries):
            raise SpecError(f"{where}: contrasts[{i}]: the name {entry['name']!r} is given twice; name each "
                            "contrast once")
        entries.append(Contrast(entry["name"], tuple(parse_claim(t) for t in texts), "all" in entry, metric))
    if not entries:
        raise SpecError(f"{where}: 'contrasts:' is empty; list at least one pre-registered contrast")
    return ContrastSet(data["metric"], seeds, tuple(entries))


def _unpaired_text(r: Verdict) -> str:
    return (f" (left out, not paired: different step-0 evaluations: {_seed_text(r.unpaired)})" if r.unpaired
            else "")


def _seed_text(seeds: Sequence[int]) -> str:
    if not seeds:
        return ""
    if list(seeds) == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2:
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ",".join(map(str, seeds))


def contrasts_text(contrasts: ContrastSet, records: Sequence[Mapping[str, object]], confidence: float = 0.95,
                   *,
                   markdown: bool = False) -> str:
    """One block per contrast: each claim's paired mean [t interval] (n, seeds), the verdict and the paired
    value seed by seed; ``markdown``: one Markdown table, a row per claim, the contrast's verdict on its
    first row."""
    pct = f"{100 * confidence:g}%"
    lines = [f"pre-registered contrasts on {contrasts.metric} (per-seed paired values, mean [{pct} t "
             f"interval]; verdicts need {contrasts.seeds or 2} seeds)"]
    if markdown:
        lines += ["", f"| contrast: verdict | claim | paired mean [{pct} t interval] | n | seeds | claim's "
                      "verdict |",
                  "| --- | --- | --- | --- | --- | --- |"]
    for entry in contrasts.entries:
        claims, is_all = entry.claims, entry.is_all
        name = entry.name if entry.metric == contrasts.metric else f"{entry.name} (on {entry.metric})"
        results = [evaluate(c, records, entry.metric, seeds_needed=contrasts.seeds, confidence=confidence)
                   for c in claims]
        overall = _combine([r.verdict for r in results]) if is_all else results[0].verdict
        if markdown:
            for i, r in enumerate(results):
                numbers = "no seed has every term" if r.interval is None else r.interval.text().rsplit(" (n=",
                                                                                                       1)[0]
                head = f"{name}: **{overall}**" if i == 0 else ""
                lines.append(f"| {head} | `{r.text}` | {numbers} | {r.interval.n if r.interval else 0} | "
                             f"{_seed_text(r.seeds)}{_unpaired_text(r)} | {r.verdict} |")
            continue
        lines.append(f"\n{name}: {overall}")
        for r in results:
            numbers = r.interval.text() if r.interval is not None else "no seed has every term"
            seeds = _seed_text(r.seeds)
            lines.append(f"  {r.text}:  {numbers}  {seeds}{_unpaired_text(r)}" + (
                f"  -> {r.verdict}" if is_all else ""))
            if r.values:
                above, below = sum(v > 0 for v in r.values), sum(v < 0 for v in r.values)
                lines.append("    by seed: " + ", ".join(f"{seed} {_per_seed(v)}" for seed,
                                                         v in zip(r.seeds, r.values, strict=True))
                             + f" ({above} above 0, {below} below)")
    return "\n".join(lines)


def _per_seed(value: float) -> str:
    """A seed's paired value to 3 decimals, or to one significant digit when 3 decimals would read 0
    but the value is not: the above/below counts beside it use the exact sign."""
    return f"{value:+.3f}" if value == 0 or abs(value) >= 5e-4 else f"{value:+.0e}"
