"""Rendering episodes through a tokenizer's chat template, by appending tokens (never re-rendering).

An instruct model expects its own conversation format: the prompt as a user turn followed by the
template's generation prompt, its answer closed by the template's end-of-turn text, a tool's output as
a tool (or user) turn, then the generation prompt again. The episode loop builds a trajectory by
appending token ids, so the template is cut once into the pieces that surround each turn, found by
rendering probe conversations (``U``, ``A``, ``O`` are probe strings)::

    s0 = render([user U], generation prompt)                 -> prompt text = render([user PROMPT], ...)
    s1 = render([user U, assistant A])  = s0 + A + turn_end
    s2 = render([user U, assistant A, ROLE O], generation prompt)
       = s1 + obs_open + O + obs_close                       (obs_close ends with the generation prompt)

After a policy turn the loop appends, as forced tokens (``action_mask`` False, log-prob 0, version -1)::

    turn_end (less the EOS the policy sampled, when turn_end starts with it) + obs_open + OBS + obs_close

so the decoded trajectory is ``render(conversation)`` exactly, and every template token around a turn is
forced, never sampled. ``ROLE`` is ``"tool"`` when the template handles a tool role (its source mentions
``tool`` and the probe renders), else ``"user"`` (templates such as SmolLM2's that know only
system/user/assistant). A template that does not render conversations by appending (checked with a
second round) is rejected with a message, since its rendering could not match the tokens the model saw.

Setting (``rollout.chat_template``): ``auto`` uses the tokenizer's template when it has one (raw text
otherwise), ``none`` always uses raw text, anything else is the path of a Jinja template file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from copc.config import ConfigError

__all__ = ["ChatFormat", "chat_format", "check_chat_template_setting"]

_USER, _ASSISTANT = "copc-probe-user", "copc-probe-assistant"
_OBS, _ASSISTANT_2 = "copc-probe-obs", "copc-probe-2"


def check_chat_template_setting(setting: str) -> None:
    """One-line error unless ``setting`` is ``auto``, ``none`` or an existing, non-empty template file that
    parses as Jinja (checked with the rest of the config, before any model loads)."""
    if setting in ("auto", "none"):
        return
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ValueError(
            f"rollout.chat_template: {setting!r} is not 'auto', 'none' "
            "or an existing Jinja template file; give one of those"
        )
    text = path.read_text()
    if not text.strip():
        raise ValueError(f"rollout.chat_template: {setting} is empty; write a Jinja chat template there, or "
                         "use 'auto' (the tokenizer's) or 'none' (raw text)")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # the environment transformers renders chat templates in
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as err:
        raise ValueError(f"rollout.chat_template: {setting}, line {err.lineno}: Jinja syntax error: "
                         f"{err.message}; fix the template") from None


def chat_format(tokenizer: PreTrainedTokenizerBase, setting: str) -> ChatFormat | None:
    """The chat format ``setting`` selects for ``tokenizer`` (module docstring), None for raw text."""
    if setting == "none":
        return None
    if setting == "auto":
        template = tokenizer.chat_template
        if isinstance(template, dict):  # several named templates: the default one renders chats
            template = template.get("default")
        if not template:
            return None
        return ChatFormat(tokenizer, str(template), source="the tokenizer's chat template")
    check_chat_template_setting(setting)
    return ChatFormat(tokenizer, Path(setting).expanduser().read_text(), source=setting)


class ChatFormat:
    """The pieces of one chat template around prompts, policy turns and tool observations.

    Args:
        tokenizer: the policy's tokenizer (its special tokens are what the template's text maps to).
        template: Jinja source of the chat template.
        source: where the template came from (for error messages).

    Attributes:
        tool_role: role of an observation turn, ``"tool"`` or ``"user"``.
        turn_end: text the template puts after an assistant message's content.
        obs_open: text that opens an observation turn (after ``turn_end``).
        obs_close: text after an observation, through the next generation prompt.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str, *, source: str) -> None:
        self.tokenizer, self.template, self.source = tokenizer, template, source
        try:
            self._probe()
        except ConfigError:
            raise
        except Exception as err:  # a template that parses can fail when rendered (jinja2, TypeError)
            first = " ".join(str(err).split()) or type(err).__name__
            raise ConfigError(
                f"chat template ({source}) fails when rendering a conversation ({type(err).__name__}: "
                f"{first[:200]}); fix the template, or set rollout.chat_template=none or auto"
            ) from None

    def _probe(self) -> None:
        """Render probe conversations: the pieces around turns, or :meth:`_reject` (class docstring)."""
        self.tool_role = "tool" if "tool" in self.template and self._renders_role("tool") else "user"
        s0 = self.render([_msg("user", _USER)], generation_prompt=True)
        s1 = self.render([_msg("user", _USER), _msg("assistant", _ASSISTANT)])
        if not s1.startswith(s0 + _ASSISTANT):
            self._reject("an assistant message is not the generation prompt followed by its content")
        self.turn_end = s1[len(s0) + len(_ASSISTANT) :]
        history = [_msg("user", _USER), _msg("assistant", _ASSISTANT), _msg(self.tool_role, _OBS)]
        s2 = self.render(history, generation_prompt=True)
        block = s2[len(s1) :]
        if not s2.startswith(s1) or block.count(_OBS) != 1:
            self._reject(f"a {self.tool_role} turn is not appended after the assistant message")
        self.obs_open, self.obs_close = block.split(_OBS)
        s3 = self.render([*history, _msg("assistant", _ASSISTANT_2)])
        if s3 != s2 + _ASSISTANT_2 + self.turn_end:
            self._reject("a second round renders differently from appending to the first")

    def render(self, messages: Sequence[dict[str, str]], *, generation_prompt: bool = False) -> str:
        """``apply_chat_template`` of ``messages`` with this template, as text."""
        text = self.tokenizer.apply_chat_template(
            list(messages), chat_template=self.template, tokenize=False,
            add_generation_prompt=generation_prompt
        )
        assert isinstance(text, str)
        return text

    def prompt_ids(self, text: str) -> list[int]:
        """Tokens of the prompt as a user turn plus the generation prompt (the template adds any BOS)."""
        return self._encode(self.render([_msg("user", text)], generation_prompt=True))

    def observation_ids(self, observation: str, *, eos_text: str | None) -> list[int]:
        """Forced tokens after a policy turn: the end of the assistant message, the observation turn and
        the next generation prompt. ``eos_text``: text of the EOS token that ended the turn, if any (it
        already closed the message when ``turn_end`` starts with it)."""
        return self._encode(self.observation_text(observation, eos_text=eos_text))

    def observation_text(self, observation: str, *, eos_text: str | None) -> str:
        end = self.turn_end
        if eos_text and end.startswith(eos_text):
            end = end[len(eos_text) :]
        return f"{end}{self.obs_open}{observation}{self.obs_close}"

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _renders_role(self, role: str) -> bool:
        try:
            text = self.render([_msg("user", _USER), _msg("assistant", _ASSISTANT), _msg(role, _OBS)])
        except Exception:  # templates raise on roles they do not know (Jinja raise_exception)
            return False
        return _OBS in text

    def _reject(self, why: str) -> None:
        raise ConfigError(
            f"chat template ({self.source}) cannot be used for multi-turn rollouts: {why}; "
            "set rollout.chat_template=none or to a template file that renders conversations by appending"
        )


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}
