"""Task protocol, the task registry and small helpers shared by every task.

A *task* is a picklable builder: it lists prompts (``prompts(split, n)``) and makes one single-use
:class:`~copc.types.Env` per prompt (``make_env(prompt)``). The async driver pickles tasks into worker
processes, so a task holds only its frozen config and caches it can rebuild (retrievers, loaded rows),
which it drops when pickled.

Registry: ``@register_task("name", ConfigClass)`` on a class whose constructor takes that config;
:func:`get_task` validates the name (listing the valid ones) and the config fields before building.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, runtime_checkable

from copc.types import Env, Prompt

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")
ConfigValue = str | int | float | bool | None


@runtime_checkable
class Task(Protocol):
    """What the rollout side needs from a task."""

    @property
    def name(self) -> str:
        """Registry name of the task (e.g. ``"arith_tool"``)."""
        ...

    def prompts(self, split: Split, n: int | None = None) -> list[Prompt]:
        """The first ``n`` prompts of ``split`` (all of them when ``n`` is None), deterministic."""
        ...

    def make_env(self, prompt: Prompt) -> Env:
        """A fresh single-use environment for one episode on ``prompt``."""
        ...


@dataclass(frozen=True)
class Segment:
    """One piece of a demonstration: text, and whether the policy writes it (``is_action``)."""

    text: str
    #: True for text the policy generates (trained on); False for the prompt and tool output.
    is_action: bool


@dataclass(frozen=True)
class Demo:
    """A supervised demonstration laid out exactly like an episode: prompt, then turns and observations."""

    segments: tuple[Segment, ...]
    #: Kind of demonstration (``"tool"``, ``"direct"``, ``"copy_error"`` ...), for the mix statistics.
    kind: str

    @property
    def text(self) -> str:
        return "".join(segment.text for segment in self.segments)


@runtime_checkable
class SupportsSFT(Protocol):
    """Built-in tasks also provide warm-start demonstrations."""

    @property
    def name(self) -> str: ...

    def sft_demos(self, n: int, seed: int) -> list[Demo]:
        """``n`` demonstrations (a mix of good and flawed ones) from the train split."""
        ...

    def sft_examples(self, n: int, seed: int) -> list[str]:
        """The same demonstrations as plain text."""
        ...


# ----------------------------------------------------------------------------------------- registry

_C = TypeVar("_C")
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Entry:
    config_cls: type
    factory: Callable[[object], Task]


_REGISTRY: dict[str, _Entry] = {}


def register_task(name: str, config_cls: type[_C]) -> Callable[[type[_T]], type[_T]]:
    """Class decorator: register a task class built as ``cls(config_cls(**fields))``."""

    def decorate(cls: type[_T]) -> type[_T]:
        if name in _REGISTRY:
            raise ValueError(f"task {name!r} is already registered; pick another name")
        _REGISTRY[name] = _Entry(config_cls=config_cls, factory=cls)  # type: ignore[arg-type]
        return cls

    return decorate


def task_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_task`, sorted."""
    return tuple(sorted(_REGISTRY))


def task_config_class(name: str) -> type:
    """The frozen config dataclass of task ``name``."""
    return _entry(name).config_cls


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise KeyError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}")
    return _REGISTRY[name]


def make_config(config_cls: type[_C], values: Mapping[str, ConfigValue]) -> _C:
    """Build a config dataclass, naming any unknown field and listing the valid ones."""
    valid = [f.name for f in dataclasses.fields(config_cls)]  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise TypeError(f"{config_cls.__name__} has no field(s) {unknown}; valid fields: {', '.join(valid)}")
    return config_cls(**values)


def get_task(name: str, **config: ConfigValue) -> Task:
    """Build task ``name`` with config fields ``config`` (e.g. ``get_task("arith_tool", hard=True)``)."""
    entry = _entry(name)
    return entry.factory(make_config(entry.config_cls, config))


def stable_hash(payload: Mapping[str, object]) -> str:
    """Stable 12-hex-digit hash of a JSON-serialisable mapping (used to name caches)."""
    text = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------- shared helpers


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return split  # type: ignore[return-value]


def check_positive(owner: str, **values: float) -> None:
    """Raise naming the first field that is not > 0."""
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{owner}.{key} must be > 0, got {value!r}")


def check_fraction(owner: str, **values: float) -> None:
    """Raise naming the first field outside [0, 1]."""
    for key, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{owner}.{key} must be in [0, 1], got {value!r}")


def last_tag_content(text: str, open_tag: str, close_tag: str) -> str | None:
    """Content of the last complete ``open_tag ... close_tag`` span in ``text``, or None."""
    pattern = re.escape(open_tag) + r"(.*?)" + re.escape(close_tag)
    matches = re.findall(pattern, text, flags=re.DOTALL)
    return matches[-1] if matches else None


def ends_with_span(text: str, open_tag: str, close_tag: str) -> bool:
    """True when ``text`` (stripped of trailing whitespace) ends with a closed ``open..close`` span."""
    stripped = text.rstrip()
    return stripped.endswith(close_tag) and open_tag in stripped


def take(items: list[_T], n: int | None, what: str) -> list[_T]:
    """The first ``n`` items (all when None); fail when more are asked than exist."""
    if n is None:
        return items
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n > len(items):
        raise ValueError(f"asked for {n} {what} but only {len(items)} exist; raise the size in the task config")
    return items[:n]
