"""Episodes rendered through a chat template: the tiny tokenizer with ChatML tokens and templates added.

What must hold (copc.rollout.chat): the decoded trajectory is ``apply_chat_template`` of the conversation
the env saw, ``action_mask`` is True exactly on the tokens the engine sampled (template tokens around a
turn are forced), and the recorded behaviour log-probs are a teacher-forced forward's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from copc.models.hf import token_logprobs
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.chat import ChatFormat, chat_format, check_chat_template_setting
from copc.rollout.engine import Engine
from copc.rollout.episode import run_episodes
from copc.rollout.samples import render_episode
from copc.types import EnvStep, StopReason, Trajectory

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

#: Generic ChatML (SmolLM2's template, system line shortened): no tool role, so tool output is a user turn.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Qwen2.5-style: tool results go into a user turn wrapped in <tool_response> (consecutive ones merged).
QWEN_LIKE = (
    "{% for message in messages %}{% if message.role == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Re-renders the last assistant message differently from earlier ones: cannot be built by appending.
NOT_APPENDING = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and not loop.last %}{{ 'A: ' + message.content[:3] + '\\n' }}"
    "{% else %}{{ message.role + ': ' + message.content + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def chat_tokenizer(template: str = CHATML):
    """The tiny tokenizer with ChatML's two special tokens, ``<|im_end|>`` as EOS, and ``template``."""
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tok.eos_token = IM_END
    tok.chat_template = template
    return tok


def eos_biased_model(tok, seed: int, eos_logit_bias: float):
    """Tiny model whose output layer adds ``eos_logit_bias`` to the EOS logit (so turns end on EOS)."""
    model = build_tiny_model(tok, seed=seed)
    head = nn.Linear(model.config.hidden_size, len(tok), bias=True)
    head.weight = model.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tok.eos_token_id] = eos_logit_bias
    model.lm_head = head
    return model


class ToolThenAnswer:
    """Every turn before ``answer_turn`` is a 'tool call' whose output names the turn; then done."""

    def __init__(self, prompt: str, *, answer_turn: int = 3, stops: tuple[str, ...] = ()) -> None:
        self.prompt, self.answer_turn, self.stops = prompt, answer_turn, stops
        self.actions: list[str] = []
        self.observations: list[str] = []

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stops

    def initial_text(self) -> str:
        return self.prompt

    def step(self, action_text: str) -> EnvStep:
        self.actions.append(action_text)
        if len(self.actions) >= self.answer_turn:
            return EnvStep(observation=None, done=True, reward=1.0)
        obs = f"```output\nresult {len(self.actions)}\n```\n"
        self.observations.append(obs)
        return EnvStep(observation=obs, done=False)

    def finish(self, reason: StopReason) -> EnvStep:
        return EnvStep(observation=None, done=True, reward=0.0)

    def conversation(self, tool_role: str) -> list[dict[str, str]]:
        messages = [{"role": "user", "content": self.prompt}]
        for i, action in enumerate(self.actions):
            messages.append({"role": "assistant", "content": action})
            if i < len(self.observations):
                messages.append({"role": tool_role, "content": self.observations[i]})
        return messages


PROMPTS = ["What is 6*7?", "Add 2 and 3.", "x"]
LIMITS = {"max_turns": 5, "max_new_tokens_per_turn": 40, "max_total_tokens": 150, "context_limit": 600,
          "seed": 0}


def _sampled_runs(traj: Trajectory) -> list[list[int]]:
    """Maximal runs of action tokens."""
    runs: list[list[int]] = []
    previous = False
    for token, sampled in zip(traj.token_ids.tolist(), traj.action_mask.tolist(), strict=True):
        if sampled and not previous:
            runs.append([])
        if sampled:
            runs[-1].append(token)
        previous = sampled
    return runs


def test_chatml_pieces_and_tool_role() -> None:
    chat = ChatFormat(chat_tokenizer(), CHATML, source="test")
    assert chat.tool_role == "user"  # the template knows no tool role
    assert chat.turn_end == "<|im_end|>\n"
    assert (chat.obs_open, chat.obs_close) == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    qwen = ChatFormat(chat_tokenizer(QWEN_LIKE), QWEN_LIKE, source="test")
    assert qwen.tool_role == "tool"
    assert qwen.obs_open == "<|im_start|>user\n<tool_response>\n"
    assert qwen.obs_close == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # After a sampled <|im_end|> only the newline of the end of turn is forced; after another EOS, all of it.
    assert chat.observation_text(
        "o", eos_text=IM_END) == "\n<|im_start|>user\no<|im_end|>\n<|im_start|>assistant\n"
    assert chat.observation_text("o", eos_text="a").startswith("<|im_end|>\n<|im_start|>user\n")


@pytest.mark.parametrize("template", [CHATML, QWEN_LIKE], ids=["chatml", "qwen_like"])
def test_episode_renders_as_the_template_with_exact_masks_and_logprobs(template: str) -> None:
    tok = chat_tokenizer(template)
    model = eos_biased_model(tok, seed=3, eos_logit_bias=4.0)
    engine = Engine(model, tok)
    chat = chat_format(tok, "auto")
    assert chat is not None
    envs = [ToolThenAnswer(p) for p in PROMPTS]
    trajs = run_episodes(engine, envs, chat=chat, **LIMITS)
    eos_turns = 0
    for env, traj in zip(envs, trajs, strict=True):
        assert traj.stop_reason is StopReason.ANSWER and len(env.actions) == 3
        # The prompt is the template's user turn and generation prompt, tokenized without extra BOS.
        prompt = chat.render([{"role": "user", "content": env.prompt}], generation_prompt=True)
        assert tok.decode(traj.token_ids[: traj.prompt_len]) == prompt
        # The whole trajectory is the template's rendering of the conversation (up to the final end of
        # turn, which nobody samples after the answer).
        rendered = chat.render(env.conversation(chat.tool_role))
        text = tok.decode(traj.token_ids.tolist(), skip_special_tokens=False)
        assert rendered.startswith(text) and rendered[len(text) :] in (chat.turn_end,
                                                                       chat.turn_end[len(IM_END) :])
        # action_mask: exactly the sampled tokens, one run per turn, each decoding to the turn's text
        # (plus the EOS that ended it); every template token is forced.
        runs = _sampled_runs(traj)
        assert len(runs) == 3 and traj.num_action_tokens == traj.info["gen_tokens"] == sum(map(len, runs))
        for run, action in zip(runs, env.actions, strict=True):
            ended_on_eos = run[-1] == tok.eos_token_id
            eos_turns += ended_on_eos
            assert tok.decode(run[:-1] if ended_on_eos else run) == action
        forced = traj.token_ids[~traj.action_mask].tolist()
        # system, user, 2 x (obs, assistant)
        assert forced.count(tok.convert_tokens_to_ids(IM_START)) >= 1 + 2 * 2
        # Behaviour log-probs equal a teacher-forced forward on the recorded ids.
        ids = traj.token_ids.unsqueeze(0)
        with torch.no_grad():
            teacher = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool)).logp[0]
        mask = traj.action_mask
        torch.testing.assert_close(traj.logp_behav[mask], teacher[mask], atol=1e-5, rtol=0)
        assert (traj.logp_behav[~mask] == 0).all() and (traj.policy_version[~mask] == -1).all()
    # The bias makes <|im_end|> end most turns: the EOS-then-observation path is exercised, not skipped.
    assert eos_turns >= 3


def test_tool_call_ending_on_eos_continues_with_a_chat_template_only() -> None:
    tok = chat_tokenizer()
    model = eos_biased_model(tok, seed=3, eos_logit_bias=8.0)  # nearly every turn is a lone EOS
    env_chat, env_raw = ToolThenAnswer("q"), ToolThenAnswer("q")
    (with_chat,) = run_episodes(Engine(model, tok), [env_chat], chat=chat_format(tok, "auto"), **LIMITS)
    (raw,) = run_episodes(Engine(model, tok), [env_raw], chat=None, **LIMITS)
    # With a template EOS closes the assistant message; the tool output follows and the episode goes on.
    assert with_chat.stop_reason is StopReason.ANSWER and len(env_chat.actions) == 3
    # Raw text: EOS ends the document, hence the episode.
    assert raw.stop_reason is StopReason.EOS and len(env_raw.actions) == 1


def test_kv_reuse_gives_the_same_chat_trajectories() -> None:
    tok = chat_tokenizer()
    model = eos_biased_model(tok, seed=5, eos_logit_bias=3.0)
    chat = chat_format(tok, "auto")
    a = run_episodes(Engine(model, tok), [ToolThenAnswer(p) for p in PROMPTS], chat=chat, reuse_kv=True,
                     **LIMITS)
    b = run_episodes(Engine(model, tok), [ToolThenAnswer(p) for p in PROMPTS], chat=chat, reuse_kv=False,
                     **LIMITS)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.action_mask, y.action_mask)
        torch.testing.assert_close(x.logp_behav, y.logp_behav, atol=1e-5, rtol=0)


def test_settings_auto_none_and_path(tmp_path) -> None:
    plain = build_tiny_tokenizer()
    assert chat_format(plain, "auto") is None  # no template: raw text
    assert chat_format(chat_tokenizer(), "none") is None
    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML)
    from_file = chat_format(plain_with_chatml_tokens(), str(path))
    assert from_file is not None and from_file.turn_end == "<|im_end|>\n"
    with pytest.raises(ValueError, match=r"^rollout.chat_template: .* is not 'auto', 'none' or an existing"):
        check_chat_template_setting(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError,
                       match="cannot be used for multi-turn rollouts: a user turn is not appended"):
        chat_format(chat_tokenizer(NOT_APPENDING), "auto")


def plain_with_chatml_tokens():
    tok = chat_tokenizer()
    tok.chat_template = None
    return tok


def test_rendered_samples_show_policy_turns_and_forced_template_text() -> None:
    tok = chat_tokenizer()
    model = eos_biased_model(tok, seed=3, eos_logit_bias=4.0)
    env = ToolThenAnswer(PROMPTS[0])
    (traj,) = run_episodes(Engine(model, tok), [env], chat=chat_format(tok, "auto"), **LIMITS)
    sample = render_episode(traj, tok)
    pieces = sample["turns"]
    assert isinstance(pieces, list) and [p["source"] for p in pieces] == ["policy", "forced"] * 2 + ["policy"]
    policy = [p["text"].removesuffix(IM_END) for p in pieces if p["source"] == "policy"]
    assert policy == env.actions
    forced = [p["text"] for p in pieces if p["source"] == "forced"]
    assert all(obs in text and text.endswith("<|im_start|>assistant\n") for obs,
               text in zip(env.observations, forced, strict=True))
    assert sample["prompt"] + "".join(p["text"] for p in pieces) == tok.decode(traj.token_ids.tolist())
    assert sample["stop_reason"] == "answer" and sample["reward"] == 1.0


def test_template_that_rejects_a_tool_role_gets_tool_output_as_a_user_turn() -> None:
    # Mentions 'tool' but raises on it (as Gemma/Mistral-style templates raise on unknown roles).
    strict = (
        "{% for message in messages %}{% if message.role not in ['user', 'assistant'] %}{{ "
        "raise_exception('no tool role here') }}{% "
        "endif %}"
        "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chat = ChatFormat(chat_tokenizer(strict), strict, source="test")
    assert chat.tool_role == "user" and chat.obs_open == "<|im_start|>user\n"


def test_a_broken_or_empty_template_file_is_refused_with_the_config(tmp_path, capsys):
    # issue 34 (6): a Jinja syntax error or an empty file gave a 40-line traceback after the model loaded
    # (in the async driver, three worker restarts and exit 1); now one line at config time, no run dir.
    from copc.run.train import train_cli

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ValueError,
                       match=r"^rollout.chat_template: .*broken.jinja, line 2: Jinja syntax error: "):
        check_chat_template_setting(str(broken))
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match=r"empty.jinja is empty; write a Jinja chat template"):
        check_chat_template_setting(str(empty))
    for template in (broken, empty):
        run_dir = tmp_path / f"run-{template.stem}"
        assert train_cli(["--no-progress", "model.policy=tiny", f"rollout.chat_template={template}",
                          f"run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and template.name in err, err
        assert not run_dir.exists()
    check_chat_template_setting("auto")
