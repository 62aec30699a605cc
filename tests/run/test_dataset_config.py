"""Configuring dataset tasks from the command line: ``task=X`` resets the task options, every bad key or
missing path is one line before any run directory exists, ``--print-config`` documents every key, and
``copc eval`` takes any task with its options and rollout budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.run.config import load_run_config
from copc.run.describe import config_rows
from copc.run.eval import eval_cli
from copc.run.train import train_cli

FIXTURES = Path(__file__).parent.parent / "fixtures"
MATH = str(FIXTURES / "math_tool.jsonl")
QA = str(FIXTURES / "search_qa.jsonl")
CORPUS = str(FIXTURES / "corpus.jsonl")


def test_task_override_resets_task_options_before_later_overrides() -> None:
    cfg = load_run_config(None, ["task=math_tool", f"task_options.data={MATH}", "task_options.eval_size=2",
                                 "model.policy=tiny"])
    assert cfg.task == "math_tool" and cfg.task_options == {"data": MATH, "eval_size": 2}
    # Naming the task it already has keeps the options; arith_tool's run defaults come back with it.
    same = load_run_config(None, ["task_options.train_size=100", "task=arith_tool"])
    assert same.task_options["train_size"] == 100
    back = load_run_config(None, ["task=kv_search", "task=arith_tool"])
    assert back.task_options == {"difficulty": 1, "train_size": 5000}


def test_yaml_naming_a_task_without_options_gets_its_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("task: kv_search\nsteps: 3\n")
    cfg = load_run_config(str(path), [])
    assert cfg.task == "kv_search" and cfg.task_options == {}


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["task=math_tool", f"task_options.dta={MATH}"], "did you mean 'data'"),  # unknown option
        (["task=math_tool"], "data is empty"),  # required option missing
        (["task=math_tool", "task_options.data=/no/such/rows.jsonl"],
         "data=/no/such/rows.jsonl does not exist"),
        (["task=math_tool", f"task_options.data={MATH}", "task_options.eval_data=/no/eval.jsonl"],
         "eval_data="),
        (["task=math_tool", f"task_options.data={FIXTURES}"], "is a folder"),
        (["task=search_qa", f"task_options.data={QA}", "task_options.corpus=/no/corpus.jsonl"], "corpus="),
        (["rollout.chat_template=/no/template.jinja"], "rollout.chat_template"),
        (["model.policy=/no/model"], "model.policy=/no/model: not 'warmstart', 'tiny' or an HF model folder"),
        (["task=math_tool", f"task_options.data={MATH}"],
         "model.policy=warmstart: task math_tool has no warm-start"),
    ],
)
def test_bad_task_options_and_paths_fail_in_one_line_before_a_run_dir(
    overrides: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert train_cli(["--no-progress", f"run_dir={run_dir}", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not run_dir.exists()


def test_search_qa_with_a_saved_index_does_not_need_the_corpus(tmp_path: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    load_run_config(None, ["task=search_qa", f"task_options.data={QA}", "task_options.corpus=/gone.jsonl",
                           f"task_options.index_dir={index}", "model.policy=tiny"])


def test_print_config_lists_every_key_with_its_value_and_doc(capsys: pytest.CaptureFixture[str]) -> None:
    # Prints even before the config is complete (no data yet), without creating anything.
    assert train_cli(["--print-config", "task=math_tool", "rollout.max_new_tokens_per_turn=256"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(
        "rollout.max_new_tokens_per_turn = 256 ") and "# Token budget" in line for line in lines)
    assert any(line.startswith('task_options.data = ""') and "# Train rows" in line for line in lines)
    assert any(line.startswith("rollout.chat_template = auto ") for line in lines)
    cfg = load_run_config(None, ["task=math_tool", f"task_options.data={MATH}"], strict=False)
    rows = config_rows(cfg)
    undocumented = [key for key, _, doc in rows if not doc]
    assert not undocumented, undocumented
    keys = [key for key, _, _ in rows]
    assert len(keys) == len(set(keys)) and len(lines) == len(keys)
    assert {"steps", "trainer.actor_lr", "staleness.mode", "task_options.max_tool_calls"} <= set(keys)


def test_copc_eval_on_an_hf_folder_with_a_dataset_task(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    tok = build_tiny_tokenizer()
    folder = tmp_path / "policy"
    build_tiny_model(tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    args = ["--checkpoint", str(folder), "--task", "math_tool", "--prompts", "2", "--samples", "1",
            "--no-greedy",
            f"task_options.data={MATH}", "task_options.eval_size=2", "rollout.max_new_tokens_per_turn=6",
            "rollout.max_total_tokens=12"]
    samples = tmp_path / "samples.jsonl"
    assert eval_cli([*args, "--samples-out", str(samples), "--samples-limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "copc eval on math_tool" in out and "pass_at_k" in out and "truncated_frac" in out
    # What the model wrote: the prompt, its turns, the reward and why it stopped.
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["prompt"].startswith("<bos>What is the sum of the first 20")
    assert rows[0]["turns"][0]["source"] == "policy" and rows[0]["stop_reason"] in {"max_tokens", "answer",
                                                                                    "eos"}
    # Bad keys and paths: one line, exit code 2.
    for bad in (["rollout.max_new_tokens=8"], ["task_options.data=/no/rows.jsonl"]):
        assert eval_cli([*args, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
