"""Task protocol, the task registry and small helpers shared by every task.

A *task* is a picklable builder: it lists prompts (``prompts(split, n)``) and makes one single-use
:class:`~copc.types.Env` per prompt (``make_env(prompt)``). The async driver pickles tasks into worker
processes, so a task holds only its frozen config and caches it can rebuild (retrievers, loaded rows),
which it drops when pickled.

Registry: ``@register_task("name", ConfigClass)`` on a class whose constructor takes that config;
:func:`get_task` validates the name (listing the valid ones) and the config fields before building.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

from copc.config import ConfigValue, from_dict
from copc.registry import Registry
from copc.types import Env, Prompt

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")


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
class TaskEntry:
    """A registered task: its config dataclass and the class built from one."""

    config_cls: type
    factory: Callable[[Any], Task]


TASKS: Registry[TaskEntry] = Registry("task")


def register_task(name: str, config_cls: type[_C]) -> Callable[[type[_T]], type[_T]]:
    """Class decorator: register a task class built as ``cls(config_cls(**fields))``."""

    def decorate(cls: type[_T]) -> type[_T]:
        TASKS.add(name, TaskEntry(config_cls=config_cls, factory=cls))  # type: ignore[arg-type]
        return cls

    return decorate


def task_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_task`, sorted."""
    return TASKS.names()


def task_config_class(name: str) -> type:
    """The frozen config dataclass of task ``name``."""
    return TASKS.get(name).config_cls


def get_task(name: str, **config: ConfigValue) -> Task:
    """Build task ``name`` with config fields ``config`` (e.g. ``get_task("arith_tool", hard=True)``).

    Unknown names and fields, and wrongly typed values, raise :class:`~copc.config.ConfigError`
    (a one-line message naming the valid choices).
    """
    entry = TASKS.get(name)
    return entry.factory(from_dict(entry.config_cls, config))


def stable_hash(payload: Mapping[str, object]) -> str:
    """Stable 12-hex-digit hash of a JSON-serialisable mapping (used to name caches)."""
    text = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------- shared helpers


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return split  # type: ignore[return-value]


def take(items: list[_T], n: int | None, what: str) -> list[_T]:
    """The first ``n`` items (all when None); fail when more are asked than exist."""
    if n is None:
        return items
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n > len(items):
        raise ValueError(
            f"asked for {n} {what} but only {len(items)} exist; raise the size in the task config")
    return items[:n]


def split_pool(pool: list[_T], split: Split, eval_size: int) -> list[_T]:
    """The ``split`` part of a pool shuffled once per seed: eval is its first ``eval_size`` items and train
    the rest, so the two splits share no item."""
    return pool[:eval_size] if split == "eval" else pool[eval_size:]


def draw_distinct(draw: Callable[[], _T], key: Callable[[_T], str], n: int, taken: set[str], *,
                  failure: str) -> list[_T]:
    """``n`` items from ``draw()`` whose ``key`` is new: not in ``taken`` and not drawn before (``taken``
    gains every key drawn). Raises ValueError(``failure``) after ``50 n + 1000`` draws, so a generator with
    too few distinct items fails instead of looping."""
    items: list[_T] = []
    draws = 0
    while len(items) < n:
        draws += 1
        if draws > 50 * n + 1000:
            raise ValueError(failure)
        item = draw()
        if key(item) in taken:
            continue
        taken.add(key(item))
        items.append(item)
    return items


class PerProcess(Generic[_T]):
    """A task's cache: ``build()`` runs on the first call in each process and its value is kept; pickling
    drops the value (``build`` must pickle: a module-level function or a partial of one), so a task sent
    to a worker process carries its config and rebuilds the cache there."""

    def __init__(self, build: Callable[[], _T]) -> None:
        self.build = build
        self._value: _T | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"build": self.build, "_value": None}

    def __call__(self) -> _T:
        if self._value is None:
            self._value = self.build()
        return self._value


def prompt_text(question: str) -> str:
    """A generated task's prompt: the question on its own line."""
    return f"{question}\n"
