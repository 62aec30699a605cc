"""Fuzzed inputs (``hypothesis``): whatever a user feeds ``copc train`` either starts a valid run or is
refused with one ``error:`` line (exit 2), never a traceback, and nothing is left behind.

Input kinds: command-line overrides (keys of the config schema and others; values of wrong types, NaN,
inf, huge numbers, empty strings), YAML config files, dataset rows (random types, missing and extra
columns, invalid UTF-8, NUL bytes, an empty file; a 50 MB row), chat-template files and run directories
in odd states. The first four are checked where ``copc train`` checks them, before anything is written
(:func:`copc.run.config.load_run_config`, strict: task options, data rows and the chat template
included); a valid chat template and the run directories go through the whole ``copc train`` on the
tiny model (one step). ``COPC_FUZZ_EXAMPLES`` scales the number of cases (default: a bounded suite
under a minute); ``COPC_FUZZ_EXAMPLES=2000`` is the larger run docs/reliability.md reports.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from copc.config import ConfigError, to_dict
from copc.run.config import RunConfig, default_config, load_run_config
from copc.tasks.datasets import DataError

pytestmark = pytest.mark.timeout(600)

SCALE = int(os.environ.get("COPC_FUZZ_EXAMPLES", "0"))


def examples(default: int) -> settings:
    return settings(
        max_examples=SCALE or default,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
        ],
    )


def _flat(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict) and value and prefix != "task_options":
        for key, sub in value.items():
            _flat(f"{prefix}.{key}" if prefix else key, sub, out)
    else:
        out[prefix] = value


SCHEMA: dict[str, object] = {}
_flat("", to_dict(default_config()), SCHEMA)
#: Keys that write or read outside a temp dir, or start something heavy, left out of the draws.
UNSAFE = ("run_dir", "resume", "overwrite", "wandb", "wandb_project", "driver.address")
KEYS = sorted(k for k in SCHEMA if k not in UNSAFE)
ODD_KEYS = [
    "",
    "=",
    "trainer",
    "trainer.",
    ".steps",
    "steps.x",
    "nope",
    "trainer.nope",
    "rollout.dynamic_sampling",
    "task_options.nope",
    "task_options",
    "model.policy.x",
    "STEPS",
    "steps ",
    " steps",
    "a..b",
    "é",
]

numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**400, 1e308, -1e308, 5e-324]),
)
texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "",
            " ",
            "nan",
            "NaN",
            "inf",
            "-inf",
            ".inf",
            "-.nan",
            "null",
            "~",
            "true",
            "no",
            "[]",
            "{}",
            "[1, 2]",
            "{a: 1}",
            "1e999",
            "0x10",
            "1_000",
            "\x00",
            "'",
            '"',
            "- a",
            "&a",
            "*a",
            "!!python/none",
            "auto",
            "none",
            "tiny",
            "copc",
            "ppo",
            "sync",
            "async",
            "bounded",
            "fixed_lag",
        ]
    ),
)


def render(value: object) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan, inf, -inf as a user types them
    return value if isinstance(value, str) else json.dumps(value)


def _near(key: str) -> st.SearchStrategy[object]:
    """Values of the default's own type (most of them valid): the runs these overrides would start."""
    default = SCHEMA[key]
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(min_value=-2, max_value=max(4, 4 * default))
    if isinstance(default, float):
        return st.floats(min_value=0.0, max_value=max(1.0, 4 * default), allow_nan=False)
    return st.just(default)


typed = st.sampled_from(KEYS).flatmap(lambda k: _near(k).map(lambda v: (k, v)))
anything = st.tuples(
    st.one_of(st.sampled_from(KEYS), st.sampled_from(ODD_KEYS), st.text(max_size=12)),
    st.one_of(numbers, texts, st.booleans(), st.lists(numbers, max_size=3)),
)
overrides = st.lists(st.one_of(typed, anything), min_size=1, max_size=4).map(
    lambda pairs: [f"{k}={render(v)}" for k, v in pairs]
)


@contextlib.contextmanager
def inside(path: Path) -> Iterator[Path]:
    """Work in ``path``: anything a case writes into the working directory is found there."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield path
    finally:
        os.chdir(before)


Outcome = tuple[str, str]
COUNTS: dict[str, dict[str, int]] = {}


def outcome(kind: str, config_file: str | None, given_overrides: Sequence[str]) -> Outcome:
    """``("valid", "")`` or ``("refused", line)``; any other exception escapes (a traceback: the test
    fails)."""
    try:
        cfg = load_run_config(config_file, list(given_overrides))
        result: Outcome = ("valid", "") if isinstance(cfg, RunConfig) else ("odd", repr(cfg))
    except (ConfigError, DataError) as err:
        line = " ".join(str(err).split())  # what copc prints after "error: "
        assert line, f"an empty error message for {given_overrides}"
        result = ("refused", line)
    counts = COUNTS.setdefault(kind, {"valid": 0, "refused": 0})
    counts[result[0]] = counts.get(result[0], 0) + 1
    return result


def nothing_written(folder: Path, allowed: Sequence[str] = ()) -> None:
    left = sorted(p.name for p in folder.iterdir() if p.name not in allowed)
    assert not left, f"left behind: {left}"


# ------------------------------------------------------------------------------------ overrides
@examples(150)
@given(given_overrides=overrides)
def test_fuzzed_overrides_are_valid_or_one_line(
    tmp_path_factory: pytest.TempPathFactory, given_overrides: list[str]
) -> None:
    with inside(tmp_path_factory.mktemp("cwd")) as cwd:
        outcome("overrides", None, given_overrides)
        nothing_written(cwd)


# ------------------------------------------------------------------------------------ YAML files
leaf = st.one_of(numbers, texts, st.booleans(), st.none())
sections = st.fixed_dictionaries(
    {},
    optional={
        k: leaf for k in ("steps", "seed", "method", "task", "checkpoint_every", "plots", "stall_timeout_s")
    },
) | st.dictionaries(
    st.sampled_from([k.split(".")[0] for k in KEYS] + ["nope", ""]),
    st.one_of(leaf, st.dictionaries(st.text(max_size=10) | st.sampled_from(KEYS), leaf, max_size=3)),
    max_size=4,
)


@examples(80)
@given(
    body=st.one_of(
        sections.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
        st.text(max_size=200),
        st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
        st.sampled_from(
            [
                "",
                "---\n",
                "- 1\n- 2\n",
                "a: [\n",
                "steps: !!python/object:os.system x\n",
                "steps: 1\nsteps: 2\n",
                "\ufeffsteps: 3\n",
                "trainer: 7\n",
                "&a [*a]\n",
                "stall_timeout_s: 1" + "0" * 400 + "\n",  # an int no float holds
            ]
        ),
    ),
    raw=st.booleans(),
)
def test_fuzzed_yaml_files_are_valid_or_one_line(
    tmp_path_factory: pytest.TempPathFactory, body: str, raw: bool
) -> None:
    folder = tmp_path_factory.mktemp("yaml")
    path = folder / "config.yaml"
    path.write_bytes(body.encode("utf-8", "surrogatepass") if not raw else body.encode("utf-8", "replace"))
    with inside(folder):
        outcome("yaml", str(path), [])
        nothing_written(folder, ["config.yaml"])


def test_invalid_utf8_and_nul_yaml_files_are_one_line(tmp_path: Path) -> None:
    for name, data in [
        ("bad.yaml", b"steps: \xff\xfe\n"),
        ("nul.yaml", b"steps: 1\x00\n"),
        ("empty.yaml", b""),
    ]:
        (tmp_path / name).write_bytes(data)
        kind, line = outcome("yaml", str(tmp_path / name), [])
        assert kind in ("valid", "refused"), line


# ------------------------------------------------------------------------------------ data rows
cell = st.one_of(
    st.text(max_size=20),
    st.integers(),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
#: A row math_tool can read (text or an integer in ``problem`` and ``answer``), sometimes with extra
#: columns of any type: with these, a drawn file is often a whole valid dataset, so the valid path is
#: fuzzed too, not only the refusals.
readable = st.one_of(st.text(min_size=1, max_size=20), st.integers())
valid_row = st.fixed_dictionaries({"problem": readable, "answer": readable},
                                  optional={"extra": cell, "question": cell, "Problem": cell})
rows = st.one_of(
    st.lists(
        st.dictionaries(
            st.sampled_from(["problem", "answer", "question", "extra", "Problem", ""]), cell, max_size=4
        ),
        max_size=6,
    ),
    st.lists(valid_row, min_size=1, max_size=6),
    st.lists(st.one_of(valid_row, valid_row, valid_row, st.dictionaries(st.text(max_size=3), cell,
                                                                        max_size=3)), max_size=6),
)


def _row_file(folder: Path, data: list[dict[str, object]], damage: str) -> Path:
    path = folder / "rows.jsonl"
    text = "".join(json.dumps(r, allow_nan=True) + "\n" for r in data).encode()
    if damage == "invalid utf-8":
        text = text[: len(text) // 2] + b"\xff\xc3(" + text[len(text) // 2 :]
    elif damage == "nul":
        text = text.replace(b'"', b'"\x00', 1) if text else b"\x00"
    elif damage == "truncated":
        text = text[: max(0, len(text) - 3)]
    elif damage == "empty":
        text = b""
    path.write_bytes(text)
    return path


@examples(80)
@given(
    data=rows,
    damage=st.sampled_from(["none", "none", "invalid utf-8", "nul", "truncated", "empty"]),
    eval_size=st.sampled_from([0, 1, 2]),
)
def test_fuzzed_data_rows_are_valid_or_one_line(
    tmp_path_factory: pytest.TempPathFactory, data: list[dict[str, object]], damage: str, eval_size: int
) -> None:
    folder = tmp_path_factory.mktemp("rows")
    path = _row_file(folder, data, damage)
    with inside(folder):
        outcome(
            "data rows",
            None,
            # the tiny model: math_tool has no warm-start demonstrations for the default policy
            ["task=math_tool", "model.policy=tiny", f"task_options.data={path}",
             f"task_options.eval_size={eval_size}"],
        )
        nothing_written(folder, ["rows.jsonl"])


# ------------------------------------------------------------------------------------ chat templates
jinja = st.one_of(
    st.text(max_size=80),
    st.lists(
        st.sampled_from(
            [
                "{{",
                "}}",
                "{%",
                "%}",
                "{#",
                "#}",
                " for m in messages ",
                " endfor ",
                " if ",
                " endif ",
                "m['content']",
                "m.role",
                "messages[9]",
                "raise_exception('no')",
                " | upper",
                "x",
                "\n",
                "\x00",
                "{{ add_generation_prompt }}",
                "{{ bos_token }}",
            ]
        ),
        max_size=12,
    ).map("".join),
)


@examples(80)
@given(template=jinja)
def test_fuzzed_chat_template_files_are_valid_or_one_line(
    tmp_path_factory: pytest.TempPathFactory, template: str
) -> None:
    folder = tmp_path_factory.mktemp("chat")
    path = folder / "chat.jinja"
    path.write_text(template, encoding="utf-8", errors="surrogatepass")
    with inside(folder):
        outcome("chat templates", None, [f"rollout.chat_template={path}", "model.policy=tiny"])
        nothing_written(folder, ["chat.jinja"])


@pytest.fixture(scope="module", autouse=True)
def report_counts() -> Iterator[None]:
    """With ``COPC_FUZZ_REPORT=path``, the cases tried per input kind (valid / refused) are written there."""
    yield
    target = os.environ.get("COPC_FUZZ_REPORT")
    if target:
        Path(target).write_text(json.dumps(COUNTS, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------ whole copc train
TINY = """task: arith_tool
task_options: {train_size: 50, eval_size: 4}
steps: 2
seed: 3
checkpoint_every: 1
plots: false
model: {policy: tiny}
rollout: {prompts_per_batch: 2, group_size: 2, max_turns: 1, max_new_tokens_per_turn: 4, max_total_tokens: 4,
  context_limit: 96}
trainer: {micro_batch_size: 4}
driver: {kind: sync}
eval: {prompts: 2, samples: 1, greedy: false, every: 0}
"""


def copc_train(args: Sequence[str]) -> tuple[int, str]:
    """``copc train ARGS`` in this process: its exit code and stderr. An exception escaping it would be a
    traceback for the user: the test fails with it."""
    from copc.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--no-progress", *args])
    return code, err.getvalue()


def one_error_line(code: int, stderr: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in stderr, stderr
    if code != 0:
        assert code in (1, 2) and len(errors) == 1, (code, stderr)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.yaml"
    path.write_text(TINY)
    return path


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[9]['content'] }}",
        "{{ raise_exception('no assistant role') }}",
        "{% for m in messages %}{{ m.content | nofilter }}{% endfor %}",
        "{{ messages[0].content.nope() }}",
        "x",
    ],
)
def test_a_chat_template_that_parses_but_cannot_render_is_one_line_and_leaves_nothing(
    tmp_path: Path, tiny_config: Path, template: str
) -> None:
    (tmp_path / "chat.jinja").write_text(template)
    run_dir = tmp_path / "run"
    code, stderr = copc_train(
        [
            "--config",
            str(tiny_config),
            f"run_dir={run_dir}",
            f"rollout.chat_template={tmp_path / 'chat.jinja'}",
        ]
    )
    assert code == 2, stderr
    one_error_line(code, stderr)
    assert "chat template" in stderr and not run_dir.exists(), stderr


@settings(
    max_examples=min(SCALE, 30) or 3,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(template=jinja)
def test_fuzzed_chat_templates_through_copc_train(
    tmp_path_factory: pytest.TempPathFactory, tiny_config: Path, template: str
) -> None:
    folder = tmp_path_factory.mktemp("chat-run")
    (folder / "chat.jinja").write_text(template, encoding="utf-8", errors="surrogatepass")
    run_dir = folder / "run"
    code, stderr = copc_train(
        [
            "--config",
            str(tiny_config),
            f"run_dir={run_dir}",
            "steps=1",
            f"rollout.chat_template={folder / 'chat.jinja'}",
        ]
    )
    one_error_line(code, stderr)
    COUNTS.setdefault("chat templates (copc train)", {"valid": 0, "refused": 0})[
        "valid" if code == 0 else "refused"
    ] += 1
    if code != 0:
        assert not run_dir.exists(), stderr


# ------------------------------------------------------------------------------------ run directories
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_config: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    code, stderr = copc_train(["--config", str(tiny_config), f"run_dir={run_dir}"])
    assert code == 0, stderr
    return run_dir


def _garbage(path: Path, data: bytes) -> None:
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    path.write_bytes(data)


DAMAGE = {
    "config.yaml removed": lambda r: (r / "config.yaml").unlink(),
    "config.yaml garbage": lambda r: _garbage(r / "config.yaml", b"steps: [\n\xff"),
    "config.yaml empty": lambda r: _garbage(r / "config.yaml", b""),
    "latest removed": lambda r: (r / "checkpoints" / "latest").unlink(),
    "latest garbage": lambda r: _garbage(r / "checkpoints" / "latest", b"step_99999999\x00"),
    "newest state.pt truncated": lambda r: _garbage(r / "checkpoints" / "step_00000002" / "state.pt", b"PK"),
    "newest meta.json removed": lambda r: (r / "checkpoints" / "step_00000002" / "meta.json").unlink(),
    "every checkpoint removed": lambda r: _garbage(r / "checkpoints", b"not a folder"),
    "metrics.jsonl cut mid-line": lambda r: _garbage(
        r / "metrics.jsonl", (r / "metrics.jsonl").read_bytes()[:-17]
    ),
    "metrics.jsonl garbage": lambda r: _garbage(r / "metrics.jsonl", b"\x00\xff{not json\n"),
    "metrics.jsonl step as text": lambda r: _garbage(
        r / "metrics.jsonl", b'{"step": "one"}\n{"step": null}\n{"step": NaN}\n[1]\n'
    ),
    "summary.json garbage": lambda r: _garbage(r / "summary.json", b"{"),
    "samples.jsonl removed": lambda r: (r / "samples.jsonl").unlink(),
    "a stale temp checkpoint": lambda r: (r / "checkpoints" / ".tmp-step_00000003-1").mkdir(),
    "a stale lock file": lambda r: _garbage(r / ".lock", b"999999\n"),
    "tb is a file": lambda r: _garbage(r / "tb", b"x"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_each_odd_state_resumes_or_says_why(tmp_path: Path, finished_run: Path, damage: str) -> None:
    """Each damage alone, resumed and continued one step past the end (each failed before its fix with a
    traceback: metrics.jsonl bytes that are not UTF-8, a file named tb)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    DAMAGE[damage](run_dir)
    code, stderr = copc_train([f"run_dir={run_dir}", "resume=true", "steps=3"])
    one_error_line(code, stderr)


@settings(
    max_examples=min(SCALE, 60) or 4,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    damage=st.lists(st.sampled_from(sorted(DAMAGE)), min_size=1, max_size=3, unique=True),
    how=st.sampled_from(["resume", "resume and continue", "fresh", "overwrite"]),
)
def test_run_directories_in_odd_states_resume_or_say_why(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_config: Path,
    finished_run: Path,
    damage: list[str],
    how: str,
) -> None:
    import shutil

    run_dir = tmp_path_factory.mktemp("odd") / "run"
    shutil.copytree(finished_run, run_dir)
    for name in damage:
        with contextlib.suppress(OSError):  # an earlier damage can take away what this one changes
            DAMAGE[name](run_dir)
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    # (overwrite=true without --config would start the embedded default: a long run, not an odd state)
    extra = {
        "resume": ["resume=true"],
        "resume and continue": ["resume=true", "steps=3"],
        "fresh": [],
        "overwrite": ["--config", str(tiny_config), "overwrite=true"],
    }[how]
    code, stderr = copc_train([*extra, f"run_dir={run_dir}"])
    one_error_line(code, stderr)
    COUNTS.setdefault("run directories", {"valid": 0, "refused": 0})["valid" if code == 0 else "refused"] += 1
    if code != 0 and how != "overwrite":  # a refused claim changes nothing that was there
        after = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
        assert set(before) <= set(after) | {"checkpoints/.tmp-step_00000003-1"}, (damage, how, stderr)


def test_a_50_mb_data_row_is_read_or_refused_in_one_line(tmp_path: Path, tiny_config: Path) -> None:
    """One 50 MB problem among ordinary rows: the prompt cannot fit any context, so the run is refused in
    one line before anything is written."""
    rows = tmp_path / "rows.jsonl"
    with rows.open("w") as out:
        out.write(json.dumps({"problem": "x" * 50_000_000, "answer": "1"}) + "\n")
        for i in range(4):
            out.write(json.dumps({"problem": f"What is {i}+1?", "answer": str(i + 1)}) + "\n")
    run_dir = tmp_path / "run"
    code, stderr = copc_train(
        [
            "--config",
            str(tiny_config),
            f"run_dir={run_dir}",
            "task=math_tool",
            f"task_options.data={rows}",
            "task_options.eval_size=1",
            "steps=1",
        ]
    )
    one_error_line(code, stderr)
    assert code == 2 and not run_dir.exists(), stderr
