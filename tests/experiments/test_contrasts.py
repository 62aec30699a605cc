"""Pre-registered contrasts (copc.experiments.contrasts): hand-worked intervals, the verdict rule, the
per-seed evaluation against a plain loop, and one-line errors for bad claims and files."""

from __future__ import annotations

import math

import pytest
import yaml

from copc.experiments.contrasts import (
    HELD,
    NO_VERDICT,
    NOT_HELD,
    NOT_RESOLVED,
    contrasts_text,
    evaluate,
    load_contrasts,
    parse_claim,
)
from copc.experiments.sweep_cli import sweep_cli
from copc.experiments.sweep_spec import SpecError, load_spec
from reference.sweep_records import write_cell_record


def records_of(table: dict[str, dict[int, float]], metric: str = "eval_final",
               axis: str = "arm") -> list[dict]:
    return [{"levels": {axis: arm}, "seed": seed, "summary": {metric: value}}
            for arm, by_seed in table.items() for seed, value in by_seed.items()]


# the 2 x 2 of issue 32 on three seeds, values chosen so every contrast is worked by hand below
GRID = {
    "base": {0: 0.30, 1: 0.40, 2: 0.50},
    "mask": {0: 0.32, 1: 0.41, 2: 0.49},
    "adv": {0: 0.29, 1: 0.44, 2: 0.52},
    "both": {0: 0.35, 1: 0.47, 2: 0.56},
}
ARM_METHODS = {"base": "async_ppo", "mask": "async_ppo_mask", "adv": "async_ppo_advantage",
               "both": "copc_behaviour",
               "later": "vtrace"}  # the sweep file's arms as runnable cells
T_975_2 = 4.302652729911275  # Student t, 2 degrees of freedom, 97.5%


def test_interaction_contrast_golden():
    # I = (both - mask) - (adv - base): seed 0 0.03 - (-0.01) = 0.04, seed 1 0.06 - 0.04 = 0.02,
    # seed 2 0.07 - 0.02 = 0.05; mean 0.03667, sd sqrt(0.000467 / 2) = 0.01528, half-width
    # 4.3027 x 0.01528 / sqrt(3) = 0.03795: [-0.0013, 0.0746], which just fails to exclude 0.
    values = [0.04, 0.02, 0.05]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    half = T_975_2 * sd / math.sqrt(3)
    got = evaluate(parse_claim("(both - mask) - (adv - base) != 0"), records_of(GRID), "eval_final")
    assert got.seeds == (0, 1, 2) and got.interval.n == 3
    assert got.interval.mean == pytest.approx(mean, abs=1e-12)
    assert (got.interval.low, got.interval.high) == (pytest.approx(mean - half), pytest.approx(mean + half))
    assert got.interval.low == pytest.approx(-0.0013, abs=1e-4) and got.interval.high == pytest.approx(
        0.0746, abs=1e-4)
    assert got.verdict == NOT_RESOLVED


def test_max_and_scaled_terms_match_a_plain_loop():
    claim = parse_claim("both - max(mask, adv) + 0.5 * -(base - 'arm=mask') > 0")
    got = evaluate(claim, records_of(GRID), "eval_final")
    expected = [GRID["both"][s] - max(GRID["mask"][s],
                                      GRID["adv"][s]) + 0.5 * -(GRID["base"][s] - GRID["mask"][s])
                for s in (0, 1, 2)]
    assert got.interval.mean == pytest.approx(sum(expected) / 3, abs=1e-12)


def test_only_seeds_every_term_has_are_paired():
    grid = {**GRID, "both": {0: 0.35, 2: 0.56, 7: 0.9}}
    got = evaluate(parse_claim("both - base > 0"), records_of(grid), "eval_final")
    assert got.seeds == (0, 2) and got.interval.mean == pytest.approx((0.05 + 0.06) / 2)


@pytest.mark.parametrize("values, op, verdict", [
    ([0.02, 0.03, 0.025], ">", HELD),
    ([0.02, 0.03, 0.025], "<", NOT_HELD),
    ([-0.02, -0.03, -0.025], ">", NOT_HELD),
    ([-0.02, -0.03, -0.025], "<", HELD),
    ([-0.02, 0.03, 0.0], ">", NOT_RESOLVED),
    ([-0.02, 0.03, 0.0], "<", NOT_RESOLVED),
    ([-0.02, -0.03, -0.025], "!=", HELD),
    ([-0.02, 0.03, 0.0], "!=", NOT_RESOLVED),
])
def test_verdict_rule(values, op, verdict):
    grid = {"a": {s: v for s, v in enumerate(values)}, "b": {s: 0.0 for s in range(len(values))}}
    assert evaluate(parse_claim(f"a - b {op} 0"), records_of(grid), "eval_final").verdict == verdict


def test_no_verdict_before_the_preregistered_seeds_are_in():
    held = evaluate(parse_claim("both - base > 0"), records_of(GRID), "eval_final", seeds_needed=3)
    assert held.verdict == HELD
    early = evaluate(parse_claim("both - base > 0"), records_of(GRID), "eval_final", seeds_needed=8)
    assert early.verdict == NO_VERDICT and early.interval.n == 3
    one = evaluate(parse_claim("both - base > 0"), records_of({"both": {0: 1.0}, "base": {0: 0.0}}),
                   "eval_final")
    assert one.verdict == NOT_RESOLVED and one.interval.low is None


def test_all_group_is_an_intersection_union(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({"metric": "eval_final", "seeds": 3, "contrasts": [
        {"name": "beats all", "all": ["both - base > 0", "both - mask > 0"]},
        {"name": "beats adv and mask", "all": ["both - adv > 0", "mask - base > 0"]},
        {"name": "one", "claim": "adv - base < 0"},
    ]}))
    text = contrasts_text(load_contrasts(spec), records_of(GRID))
    assert "beats all: held" in text
    # mask - base = (0.02, 0.01, -0.01): not resolved, so the group is not resolved
    assert f"beats adv and mask: {NOT_RESOLVED}" in text
    assert f"one: {NOT_RESOLVED}" in text
    md = contrasts_text(load_contrasts(spec), records_of(GRID), markdown=True).splitlines()
    rows = [line for line in md if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 5 and rows[0].startswith("| beats all: **held** | `both - base > 0` | ")
    assert rows[1].startswith("|  | `both - mask > 0` | ") and rows[1].endswith(" | 3 | seeds 0-2 | held |")
    assert rows[3].startswith("|  | `mask - base > 0` | 0.007 [") and rows[3].endswith(f" | {NOT_RESOLVED} |")


def test_each_claim_shows_its_value_for_every_seed(tmp_path):
    """The text report prints a claim's paired value seed by seed, with how many are above and below 0,
    so a verdict's interval can be read against the seeds that make it."""
    got = evaluate(parse_claim("(both - mask) - (adv - base) != 0"), records_of(GRID), "eval_final")
    assert got.values == pytest.approx((0.04, 0.02, 0.05))
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({"metric": "eval_final", "seeds": 3, "contrasts": [
        {"name": "I", "claim": "(both - mask) - (adv - base) != 0"}, {"name": "mask",
                                                                      "claim": "mask - base > 0"}]}))
    lines = contrasts_text(load_contrasts(spec), records_of(GRID)).splitlines()
    assert "    by seed: 0 +0.040, 1 +0.020, 2 +0.050 (3 above 0, 0 below)" in lines
    assert "    by seed: 0 +0.020, 1 +0.010, 2 -0.010 (2 above 0, 1 below)" in lines


def test_a_seed_value_that_rounds_to_zero_shows_its_sign(tmp_path):
    """A paired value of 2e-4 is counted above 0, so it is not printed as +0.000; an exact 0 counts neither
    way."""
    table = {"base": {0: 0.5, 1: 0.5, 2: 0.5}, "arm": {0: 0.5002, 1: 0.5, 2: 0.49}}
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({"metric": "eval_final", "seeds": 3,
                                    "contrasts": [{"name": "a", "claim": "arm - base > 0"}]}))
    lines = contrasts_text(load_contrasts(spec), records_of(table)).splitlines()
    assert "    by seed: 0 +2e-04, 1 +0.000, 2 -0.010 (1 above 0, 1 below)" in lines


def test_terms_must_select_one_group():
    records = [{"levels": {"method": m, "lr": lr}, "seed": 0, "summary": {"eval_final": 1.0}}
               for m in ("r0", "b3") for lr in ("1e-4", "2.5e-5")]
    with pytest.raises(SpecError, match=r"term 'r0' selects 2 groups .*'axis=level"):
        evaluate(parse_claim("r0 - b3 > 0"), records, "eval_final")
    # a group not recorded yet: no verdict
    not_yet = evaluate(parse_claim("nope - 'method=b3,lr=1e-4' > 0"), records, "eval_final")
    assert not_yet.verdict == NO_VERDICT and not_yet.interval is None
    got = evaluate(parse_claim("'method=r0,lr=1e-4' - 'method=b3,lr=1e-4' > 0"), records, "eval_final")
    assert got.interval.mean == 0.0


@pytest.mark.parametrize("text, problem", [
    ("a - b", "compares an expression with 0"),
    ("a - b > 1", "compares an expression with 0"),
    ("0 < a - b", "compares an expression with 0"),
    ("a ** 2 > 0", "only \\+, - and \\*"),
    ("a * b > 0", "needs a number"),
    ("abs(a) > 0", "max\\(a, b, ...\\)"),
    ("max(a) > 0", "max\\(a, b, ...\\)"),
    ("a - 'arm' > 0", "expected 'axis=level"),
    ("a - b.c > 0", "expected levels"),
    ("a - (b > 0", "not an expression"),
    ("w1 - 0.8-1.2 < 0", "a number is added or subtracted"),  # the level 0.8-1.2 read as arithmetic
    ("a - 16 > 0", "quoted 'axis=level' selector"),
])
def test_bad_claims_get_one_line(text, problem):
    with pytest.raises(SpecError, match=problem) as err:
        parse_claim(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("content, problem", [
    ("[1, 2]", "expected a mapping"),
    ("metric: eval_final\ncontrasts: []\nextra: 1", "unknown key"),
    ("metric: eval_final\nseeds: -1\ncontrasts: []", "'seeds' must be"),
    ("metric: eval_final\ncontrasts: [{name: x}]", "either 'claim: TEXT' or 'all"),
    ("metric: eval_final\ncontrasts: [{name: x, claim: 'a > 0', all: ['a > 0']}]", "either 'claim"),
    ("metric: eval_final\ncontrasts: [{name: x, all: []}]", "one or more claims"),
    ("metric: eval_final\ncontrasts: [{name: x, claim: 'a >'}]", "not an expression"),
    ("metric: [", "not valid YAML"),
    ("metric: eval_final\ncontrasts: []", "'contrasts:' is empty"),
    ("metric: eval_final\ncontrasts: [{name: x, claim: 'a > 0'}, {name: x, claim: 'b > 0'}]",
     "'x' is given twice"),
    ("metric: eval_final\ncontrasts:\n  - name: x\n    claim: a > 0\n    claim: b > 0\n", "'claim'.*twice"),
])
def test_bad_files_get_one_line(tmp_path, content, problem):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    with pytest.raises(SpecError, match=problem):
        load_contrasts(path)
    with pytest.raises(SpecError, match="cannot read"):
        load_contrasts(tmp_path / "missing.yaml")


def test_sweep_report_prints_the_contrasts(tmp_path, capsys):
    """`copc sweep FILE --report --contrasts C` reads the records and prints each verdict; a term naming no
    group is one error line and exit 2."""
    spec = tmp_path / "grid.yaml"
    spec.write_text(yaml.safe_dump({"experiment": "grid", "seeds": [0, 1, 2], "shared": ["steps=2"],
                                    "axes": {"arm": {a: [f"method={m}"] for a, m in ARM_METHODS.items()}},
                                    "report": ["eval_final"]}))
    for record in records_of(GRID, metric="eval_final"):
        write_cell_record(load_spec(spec), tmp_path / "results",
                          f"arm={record['levels']['arm']}__seed{record['seed']}",
                          summary=record["summary"])
    contrasts = tmp_path / "c.yaml"
    contrasts.write_text(yaml.safe_dump({"metric": "eval_final", "seeds": 3, "contrasts": [
        {"name": "C2 interaction", "claim": "(both - mask) - (adv - base) != 0"},
        {"name": "later", "claim": "both - later > 0"}]}))
    args = [str(spec), "--results", str(tmp_path / "results"), "--report"]
    capsys.readouterr()
    assert sweep_cli([*args, "--contrasts", str(contrasts)]) == 0
    out = capsys.readouterr().out
    assert f"C2 interaction: {NOT_RESOLVED}" in out and "0.037 [-0.001, 0.075] (n=3)  seeds 0-2" in out
    assert f"later: {NO_VERDICT}" in out and "no seed has every term" in out  # an arm still to run
    contrasts.write_text(yaml.safe_dump({"metric": "eval_final",
                                         "contrasts": [{"name": "x", "claim": "gone - base > 0"}]}))
    assert sweep_cli([*args, "--contrasts", str(contrasts)]) == 2
    err = capsys.readouterr().err
    assert "'gone' is no level of this sweep (arm: adv, base, both, later, mask)" in err and err.count(
        "\n") == 1


def test_curve_means_are_report_metrics(tmp_path, capsys):
    """``mean:<curve>`` is the run mean of a record's diagnostic curve (the gain x delay table's drift), in
    --report --metrics, in a sweep file's report list and in a contrasts file; an unknown name is one line."""
    from copc.experiments.tables import by_group

    record = {"levels": {"arm": "a"}, "seed": 0, "summary": {},
              "curves": {"drift": [[0, 0.1], [1, 0.3], [2, float("nan")], [3, 0.5]], "mask_rate": []}}
    assert by_group([record], "mean:drift") == {(("arm", "a"),): {0: pytest.approx(0.3)}}
    assert by_group([record], "mean:mask_rate") == {}  # an empty curve is no value, not 0
    assert by_group([{**record, "curves": None}], "mean:drift") == {}  # a record from before curves
    spec = tmp_path / "grid.yaml"
    spec.write_text(yaml.safe_dump({"experiment": "grid", "seeds": [0], "shared": ["steps=2"],
                                    "axes": {"arm": {"a": ["method=ppo"]}}, "report": ["mean:drift"]}))
    write_cell_record(load_spec(spec), tmp_path / "results", "arm=a__seed0", summary={},
                      curves=record["curves"])
    args = [str(spec), "--results", str(tmp_path / "results"), "--report"]
    capsys.readouterr()
    assert sweep_cli(args) == 0 and "mean:drift:\n  arm=a  0.300 (n=1)" in capsys.readouterr().out
    assert sweep_cli([*args, "--metrics", "eval_final,mean:drift"]) == 0
    with pytest.raises(SpecError,
                       match=r"'mean:drfit' is no report metric.*mean:<curve> with <curve> one of drift"):
        sweep_cli([*args, "--metrics", "mean:drfit"])
    bad = tmp_path / "c.yaml"
    bad.write_text("metric: mean:nope\ncontrasts: []")
    with pytest.raises(SpecError, match="metric 'mean:nope' unknown"):
        load_contrasts(bad)


def test_a_term_is_resolved_against_the_grid_not_the_records_so_far(tmp_path, capsys):
    """With axes method x lr, `copc - ppo` names two groups each: it must fail before any record makes
    it look unique (one lr of each recorded so far would otherwise be compared with the other)."""
    spec = tmp_path / "grid.yaml"
    spec.write_text(yaml.safe_dump({"experiment": "grid", "seeds": [0, 1, 2], "shared": ["steps=2"],
                                    "axes": {"method": {"copc": ["method=copc"], "ppo": ["method=ppo"]},
                                             "lr": {"key": "trainer.actor_lr", "values": ["1e-4", "3e-5"]}},
                                    "report": ["eval_final"]}))
    for seed in range(3):  # only copc at 1e-4 and ppo at 3e-5 are recorded so far
        write_cell_record(load_spec(spec), tmp_path / "results", f"lr=1e-4__method=copc__seed{seed}",
                          summary={"eval_final": 0.5})
        write_cell_record(load_spec(spec), tmp_path / "results", f"lr=3e-5__method=ppo__seed{seed}",
                          summary={"eval_final": 0.1 * seed})
    contrasts = tmp_path / "c.yaml"
    contrasts.write_text(yaml.safe_dump({"metric": "eval_final", "contrasts": [{"name": "x",
                                                                                "claim": "copc - ppo > 0"}]}))
    args = [str(spec), "--results", str(tmp_path / "results"), "--report", "--contrasts", str(contrasts)]
    capsys.readouterr()
    assert sweep_cli(args) == 2
    err = capsys.readouterr().err
    assert "term 'copc' selects 2 groups (lr=1e-4 method=copc; lr=3e-5 method=copc)" in err and err.count(
        "\n") == 1
    contrasts.write_text(yaml.safe_dump({"metric": "eval_final", "contrasts": [
        {"name": "x", "claim": "'method=copc,lr=1e-4' - 'method=ppo,lr=1e-4' > 0"}]}))
    assert sweep_cli(args) == 0  # a grid point not recorded yet: no verdict, no error
    assert "no seed has every term" in capsys.readouterr().out


@pytest.mark.parametrize("contrasts, sweeps", [
    ("confirm_maths.yaml", ["confirm_maths_s64.yaml", "confirm_maths_s16.yaml"]),
    ("confirm_search.yaml", ["confirm_search_s64.yaml"]),
])
def test_committed_contrasts_name_levels_of_their_sweeps(contrasts, sweeps):
    from pathlib import Path

    from copc.experiments.contrasts import check_terms
    from copc.experiments.sweep_spec import expand, load_spec

    experiments = Path(__file__).resolve().parents[2] / "experiments"
    loaded = load_contrasts(experiments / "contrasts" / contrasts)
    for sweep in sweeps:
        spec = load_spec(experiments / sweep)
        check_terms(loaded, spec.axes, [c.levels for c in expand(spec)])
        assert loaded.seeds == len(spec.seeds)  # verdicts wait for every pre-registered seed


def test_report_flags_that_name_nothing_are_refused_not_ignored(tmp_path, capsys):
    """A review found three silent reports: --baseline naming no axis or level printed no paired column,
    --collapse with a misspelt metric printed 0 collapses everywhere, and report flags without --report were
    dropped. Each is now one line and exit 2."""
    spec = tmp_path / "grid.yaml"
    spec.write_text(yaml.safe_dump({"experiment": "grid", "seeds": [0], "shared": ["steps=2"],
                                    "axes": {"arm": {"a": ["method=ppo"], "b": ["method=async_ppo"]}}}))
    evals = [{"step": s, "accuracy": 0.5, "greedy_accuracy": g} for s,
             g in [(0, 0.6), (1, 0.4), (2, 0.4), (3, 0.4)]]
    for arm in ("a", "b"):
        write_cell_record(load_spec(spec), tmp_path / "results", f"arm={arm}__seed0", summary={}, evals=evals)
    args = [str(spec), "--results", str(tmp_path / "results")]
    capsys.readouterr()
    assert sweep_cli([*args, "--report", "--collapse", "greedy_accuracy,0.1,3"]) == 0
    assert "1 of 1" in capsys.readouterr().out  # the rule itself sees the drop
    assert sweep_cli([*args, "--report", "--collapse", "greedy_acc,0.1,3"]) == 2
    err = capsys.readouterr().err
    assert "no record's evaluations hold 'greedy_acc'" in err and "greedy_accuracy" in err and err.count(
        "\n") == 1
    assert sweep_cli([*args, "--report", "--baseline", "arm=nope"]) == 2
    assert "axis 'arm' has no level 'nope'; levels: a, b" in capsys.readouterr().err
    assert sweep_cli([*args, "--report", "--baseline", "armm=a"]) == 2
    assert "no axis 'armm'; axes: arm" in capsys.readouterr().err
    assert sweep_cli([*args, "--collapse", "greedy_accuracy", "--markdown"]) == 2
    assert "--collapse, --markdown only apply to --report" in capsys.readouterr().err
    a_file = tmp_path / "file.png"
    a_file.write_text("mine")
    assert sweep_cli([*args, "--report", "--plot", str(a_file)]) == 2
    assert "--plot takes a folder" in capsys.readouterr().err and a_file.read_text() == "mine"


def test_a_metric_no_record_holds_is_said_not_skipped():
    """--metrics mean:entropy over records whose method logs no loss entropy printed nothing at all."""
    from copc.experiments.tables import report_text

    record = {"levels": {"arm": "a"}, "seed": 0, "summary": {"eval_final": 0.5}, "curves": {"drift": [[0,
                                                                                                       0.1]]}}
    text = report_text([record], ("eval_final", "mean:entropy"), None)
    assert "mean:entropy: no record holds it" in text and "0.500" in text


def test_an_entry_may_name_its_own_metric(tmp_path):
    """A contrast may be decided on another figure than the file's (a within-arm diagnostic such as the
    oracle's error excess): its own ``metric:`` wins for that entry only, and the report names it."""
    records = records_of(GRID)
    for record in records:  # base's values 0.10, 0.11, 0.12: mean 0.11 +- 4.303 * 0.01 / sqrt(3), above 0
        record["curve_means"] = {"oracle_gae_excess": 0.1 + 0.01 * record["seed"]
                                 if record["levels"]["arm"] == "base" else 0.0}
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({"metric": "eval_final", "seeds": 3, "contrasts": [
        {"name": "on the primary", "claim": "both - base > 0"},
        {"name": "L1", "metric": "mean:oracle_gae_excess", "claim": "base > 0"}]}))
    loaded = load_contrasts(spec)
    assert [c.metric for c in loaded.entries] == ["eval_final", "mean:oracle_gae_excess"]
    text = contrasts_text(loaded, records)
    assert "L1 (on mean:oracle_gae_excess): held" in text
    assert "  base > 0:  0.110 [0.085, 0.135] (n=3)  seeds 0-2" in text
    assert "    by seed: 0 +0.100, 1 +0.110, 2 +0.120 (3 above 0, 0 below)" in text
    assert "on the primary: held" in text
    spec.write_text(yaml.safe_dump({"metric": "eval_final", "contrasts": [
        {"name": "x", "metric": "mean:nope", "claim": "base > 0"}]}))
    with pytest.raises(SpecError, match=r"contrasts\[0\] \(x\): metric 'mean:nope' unknown"):
        load_contrasts(spec)
