"""``copc export`` (a run's policy -> an HF folder transformers loads with its chat template) and
``copc convert-gguf``'s one-line refusals (issue 35, item 7). The GGUF conversion itself runs in
tests/models/test_smollm.py where the SmolLM2 GGUF package is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from copc.run.export import convert_cli, export_cli, load_run_policy
from copc.run.train import train_cli
from copc.trainer.checkpoint import list_checkpoints

TINY = [
    "model.policy=tiny", "task_options={train_size: 100, eval_size: 8}", "steps=2", "checkpoint_every=1",
    "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8",
    "rollout.max_total_tokens=12", "eval.prompts=4", "eval.samples=2", "driver.kind=sync",
    "trainer.critic_warmup_steps=0", "plots=false", "keep_checkpoints=3",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    template = run.parent / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert train_cli(["--no-progress", f"run_dir={run}", *TINY, f"rollout.chat_template={template}"]) == 0
    return run


def test_export_loads_with_transformers_and_generates(run_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    assert export_cli([str(run_dir), str(out)]) == 0
    assert "at step 2" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    trained, _, step = load_run_policy(run_dir)
    assert step == 2
    for name, value in trained.state_dict().items():  # the checkpoint's weights, not the initial ones
        assert torch.equal(value, model.state_dict()[name]), name
    # the template the run rendered prompts with travels with the tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<user>1+1<assistant>"
    ids = tokenizer("12+3=", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1]
    meta = json.loads((out / "copc_export.json").read_text())
    assert meta["step"] == 2 and meta["method"] == "copc" and meta["run_dir"] == str(run_dir)


def test_export_picks_a_step_and_never_overwrites(run_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert list_checkpoints(run_dir)[:2] == [1, 2]
    assert export_cli([str(run_dir), str(tmp_path / "one"), "--step", "1"]) == 0
    first, _, _ = load_run_policy(run_dir, step=1)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in first.state_dict().items())
    capsys.readouterr()
    assert export_cli([str(run_dir), str(tmp_path / "one")]) == 2  # not empty: refused, kept
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not an empty folder" in err
    assert (tmp_path / "one" / "copc_export.json").is_file()
    assert export_cli([str(run_dir), str(tmp_path / "x"), "--step", "7"]) == 2
    assert "no checkpoint of step 7; it has steps 1, 2" in capsys.readouterr().err
    assert export_cli([str(tmp_path), str(tmp_path / "y")]) == 2
    assert "not a copc run directory" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_export_of_a_damaged_step_asked_for_is_one_line(run_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--step N whose files fail their check: one line, nothing written (it was a CheckpointError traceback);
    without --step the newest step that verifies is exported."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    weights = run / "checkpoints" / "step_00000002" / "trainer.policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64] + bytes(64))
    capsys.readouterr()
    assert export_cli([str(run), str(tmp_path / "two"), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:") and not (tmp_path / "two").exists()


def test_convert_gguf_refuses_bad_input_in_one_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert convert_cli([str(tmp_path), "missing.gguf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.gguf does not exist" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert convert_cli([str(tmp_path), "missing.gguf", str(tmp_path / "full")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_make_critic_cuts_the_policy_and_trains_as_model_critic(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # issue 35 (8): model.critic=DIR was documented with no way to make one.
    from copc.models import build_tiny_model, build_tiny_tokenizer
    from copc.run.export import critic_cli

    tokenizer = build_tiny_tokenizer()
    policy = build_tiny_model(tokenizer, seed=0)
    total = policy.config.num_hidden_layers
    assert total >= 2
    policy.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    assert critic_cli([str(tmp_path / "policy"), str(tmp_path / "critic"), "--layers", "1"]) == 0
    assert "model.critic=" in capsys.readouterr().out
    small = AutoModelForCausalLM.from_pretrained(tmp_path / "critic")
    assert small.config.num_hidden_layers == 1
    big = policy.state_dict()
    for name, value in small.state_dict().items():  # every kept tensor is the policy's own
        assert torch.equal(value, big[name]), name
    run = tmp_path / "run"
    assert train_cli(["--no-progress", f"run_dir={run}", *TINY, f"model.policy={tmp_path / 'policy'}",
                      f"model.critic={tmp_path / 'critic'}"]) == 0
    assert critic_cli([str(tmp_path / "policy"), str(tmp_path / "c2"), "--layers", str(total)]) == 2
    assert "layers must be in [1," in capsys.readouterr().err
    assert critic_cli([str(tmp_path / "policy"), str(tmp_path / "critic"), "--layers", "1"]) == 2  # not empty
