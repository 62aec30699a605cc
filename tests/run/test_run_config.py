"""The run config's defaults and its resolution of the method's rollout-side choices."""

from __future__ import annotations

import re

import pytest

from copc.config import ConfigError
from copc.run.config import load_run_config, resolve_method, resolve_rollout


def test_default_run_evaluates_every_20_steps() -> None:
    cfg = load_run_config(None, [])
    assert cfg.eval.every == 20 and cfg.steps % cfg.eval.every == 0


@pytest.mark.parametrize(("method", "on"), [("dapo", True), ("copc", False), ("ppo", False), ("areal",
                                                                                              False)])
def test_the_method_decides_dynamic_sampling_and_overlong_shaping_unless_rollout_does(method: str,
                                                                                      on: bool) -> None:
    rollout = resolve_rollout(load_run_config(None, [f"method={method}"]))
    assert rollout.dynamic_sampling.enabled is on and rollout.overlong.enabled is on
    # the rollout config wins in both directions, for any method
    flipped = resolve_rollout(load_run_config(None, [
        f"method={method}", f"rollout.dynamic_sampling.enabled={str(not on).lower()}",
        f"rollout.overlong.enabled={str(not on).lower()}", "rollout.dynamic_sampling.max_rounds=2",
    ]))
    assert flipped.dynamic_sampling.enabled is (not on) and flipped.overlong.enabled is (not on)
    assert flipped.dynamic_sampling.max_rounds == 2


def test_dynamic_sampling_with_groups_of_one_fails_at_load_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"rollout \(with method 'dapo'\): .*group_size >= 2"):
        load_run_config(None, ["method=dapo", "rollout.group_size=1"])
    load_run_config(None, ["method=copc", "rollout.group_size=1"])  # no dynamic sampling: fine


def test_method_overrides_change_the_preset_and_bad_ones_name_the_key() -> None:
    cfg = load_run_config(None, ["method_overrides.policy.mask_high=.inf",
                                 "method_overrides.advantage.ratio_high=1.5"])
    method = resolve_method(cfg)
    assert method.policy.mask_high == float("inf") and method.advantage.ratio_high == 1.5
    # the rest is the preset's
    assert method.policy.mask_low == resolve_method(load_run_config(None, [])).policy.mask_low
    for override, needle in [
        ("method_overrides.polcy.mask_high=2", "unknown section; valid: policy, advantage, critic"),
        ("method_overrides.policy.mask_hgh=2", "did you mean 'mask_high'"),
        ("method_overrides.policy.mask_high=-1", "mask_low/mask_high need 0 <= low < high"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_run_config(None, [override])


def test_errors_in_method_overrides_and_task_options_name_their_section() -> None:
    """CLI review item 16: these sections were called "the top-level config" in the message."""
    for override, needle in [
        ("method_overrides.policy.bad=1", "unknown key 'bad' in section 'method_overrides.policy'"),
        ("method_overrides.policy.clip_low=-1", "section 'method_overrides.policy' (PolicyChannelConfig)"),
        ("task_options={bad: 1}", "unknown key 'bad' in section 'task_options'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)) as err:
            load_run_config(None, [override])
        assert "top-level" not in str(err.value)


def test_model_critic_loads_a_smaller_backbone_that_reads_the_policys_tokens(tmp_path) -> None:
    import torch

    from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
    from copc.run.build import build_critic

    tokenizer = build_tiny_tokenizer()
    policy = build_tiny_model(tokenizer, seed=0)
    small = build_tiny_model(tokenizer, seed=1, num_hidden_layers=1)
    small.save_pretrained(tmp_path / "small")
    copy = build_critic(load_run_config(None, []), policy, tokenizer)
    critic = build_critic(load_run_config(None, [f"model.critic={tmp_path / 'small'}"]), policy, tokenizer)
    assert len(copy.backbone.layers) == len(policy.model.layers) and len(critic.backbone.layers) == 1
    assert sum(p.numel() for p in critic.parameters()) < sum(p.numel() for p in copy.parameters())
    ids = torch.tensor([tokenizer.encode("12*34=")])
    values = critic(ids, torch.ones_like(ids))
    assert values.shape == ids.shape and values.dtype == torch.float32
    with pytest.raises(ConfigError, match="no HF model folder"):
        build_critic(load_run_config(None, [f"model.critic={tmp_path / 'missing'}"]), policy, tokenizer)
    narrow = build_tiny_model(tokenizer, seed=1, num_hidden_layers=1)
    narrow.resize_token_embeddings(8)
    narrow.save_pretrained(tmp_path / "narrow")
    with pytest.raises(ConfigError, match="must share the policy's tokenizer"):
        build_critic(load_run_config(None, [f"model.critic={tmp_path / 'narrow'}"]), policy, tokenizer)


def test_the_sampler_transform_is_one_setting_shown_where_it_is_used() -> None:
    # issue 35 (4): rollout.temperature=0.7 used to leave trainer.temperature = 1.0 in --print-config and
    # config.yaml while the trainer used 0.7; trainer.temperature alone was silently ignored.
    cfg = load_run_config(None, ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=5"],
                          strict=False)
    assert (cfg.trainer.temperature, cfg.trainer.top_p, cfg.trainer.top_k) == (0.7, 0.9, 5)
    again = load_run_config(None, ["rollout.temperature=0.7", "rollout.temperature=0.8"], strict=False)
    assert again.trainer.temperature == 0.8  # overrides still compose
    with pytest.raises(ConfigError, match=r"trainer.temperature=0.7 but rollout.temperature=1.0: .* set "
                                          r"rollout.temperature=0.7"):
        load_run_config(None, ["trainer.temperature=0.7"], strict=False)
    assert load_run_config(None, ["rollout.temperature=0.7", "trainer.temperature=0.7"],
                           strict=False).trainer.temperature == 0.7


def test_paths_are_saved_absolute(tmp_path, monkeypatch) -> None:
    # issue 35 (3): a run configured with relative paths could not be evaluated or resumed from another
    # directory; the config holds absolute paths from the start.
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(None, [
        "task=math_tool", "task_options.data=train.jsonl", "task_options.eval_data=hf:gsm8k",
        "model.policy=smollm2-hf", "model.critic=../critic", "rollout.chat_template=t.jinja",
        "run_dir=runs/m",
    ], strict=False)
    assert cfg.task_options["data"] == str(tmp_path / "train.jsonl")
    assert cfg.task_options["eval_data"] == "hf:gsm8k"  # a hub name, not a path
    assert cfg.model.policy == str(tmp_path / "smollm2-hf") and cfg.model.critic == str(
        tmp_path / "../critic")
    assert cfg.rollout.chat_template == str(tmp_path / "t.jinja") and cfg.run_dir == str(tmp_path / "runs/m")
    plain = load_run_config(None, [], strict=False)
    assert (plain.model.policy, plain.model.critic, plain.rollout.chat_template) == ("warmstart", "policy",
                                                                                     "auto")


def test_data_rows_are_checked_before_anything_heavy(tmp_path, capsys) -> None:
    # issue 35 (5): a dataset with other column names failed after 51 s (sandbox and model loaded) and left
    # its run directory behind; its hint said problem_key= without the task_options. prefix.
    from copc.run.train import train_cli

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "solution": "2"}\n' * 4)
    overrides = ["task=math_tool", f"task_options.data={rows}", "task_options.eval_size=2",
                 "model.policy=tiny"]
    with pytest.raises(ConfigError,
                       match=r"rows.jsonl, line \d: column 'problem' is missing .*question, solution.* "
                                          r"set task_options.question_key=<column name>"):
        load_run_config(None, overrides)
    run_dir = tmp_path / "run"
    assert train_cli(["--no-progress", *overrides, f"run_dir={run_dir}"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not run_dir.exists()
    fixed = load_run_config(None, [*overrides, "task_options.question_key=question",
                                   "task_options.answer_key=solution"])
    assert fixed.task_options["question_key"] == "question"


@pytest.mark.parametrize(("override", "said"), [
    ("steps=-3", "steps must be >= 0, got -3"),
    ("checkpoint_every=-1", "checkpoint_every must be >= 0, got -1"),
    ("keep_checkpoints=0", "keep_checkpoints must be >= 1, got 0"),
    ("eval.prompts=-1", "eval.prompts must be >= 0, got -1"),
    ("eval.samples=0", "eval.samples must be >= 1, got 0"),
    ("eval.every=-2", "eval.every must be >= 0, got -2"),
    ("driver.num_workers=0", "driver.num_workers must be >= 1, got 0"),
    ("driver.trainer_threads=0", "driver.trainer_threads must be >= 1, got 0"),
    ("driver.max_worker_restarts=-1", "driver.max_worker_restarts must be >= 0, got -1"),
    ("driver.batch_timeout_s=-1", "driver.batch_timeout_s must be >= 0 and finite, got -1.0"),
    ("samples.every=-1", "samples.every must be >= 0, got -1"),
])
def test_a_count_out_of_range_names_its_key_and_value(override: str, said: str) -> None:
    """Counts used to share one message per section that named several keys and no value (CLI review 15)."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_run_config(None, [override])
