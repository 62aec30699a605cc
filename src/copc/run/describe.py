"""``copc train --print-config``: every key of a resolved run config with its value and its one-line doc.

The docs are the attribute docstrings written under each dataclass field (CONTRIBUTING.md#configs), read from
the source with :mod:`ast`; a field of a base class is documented where it is declared. The task's own
options are listed under ``task_options`` from the task's config class, with the run's values where
set and the class defaults elsewhere.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap

import yaml

from copc.config import to_dict
from copc.run.config import RunConfig

__all__ = ["config_rows", "field_docs", "format_config"]

_MISSING = "(required)"
_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_./:+-]*")


def field_docs(cls: type) -> dict[str, str]:
    """``{field: first line of the docstring under it}`` for a dataclass and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # no source (frozen app, REPL): no docs
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.strip().splitlines()[0].split())
    return docs


def config_rows(cfg: RunConfig) -> list[tuple[str, object, str]]:
    """``(dotted key, value, doc)`` for every leaf of ``cfg``, the task's options included."""
    rows: list[tuple[str, object, str]] = []
    _walk(cfg, "", rows)
    return rows


def _walk(node: object, prefix: str, rows: list[tuple[str, object, str]]) -> None:
    docs = field_docs(node.__class__)
    for f in dataclasses.fields(node):  # type: ignore[arg-type]
        if not f.init:
            continue
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _walk(value, f"{key}.", rows)
        elif isinstance(node, RunConfig) and f.name == "task_options":
            _task_options(node, rows)
        else:
            rows.append((key, _plain(value), docs.get(f.name, "")))


def _task_options(cfg: RunConfig, rows: list[tuple[str, object, str]]) -> None:
    from copc.tasks import task_config_class, task_names

    if cfg.task not in task_names():
        rows.append(("task_options", dict(cfg.task_options), f"options of the unknown task {cfg.task!r}"))
        return
    cls = task_config_class(cfg.task)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in cfg.task_options:
            value: object = cfg.task_options[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = _MISSING
        rows.append((f"task_options.{f.name}", _plain(value), docs.get(f.name, "")))
    known = {f.name for f in dataclasses.fields(cls)}
    for key in sorted(set(cfg.task_options) - known):
        rows.append((f"task_options.{key}", cfg.task_options[key], f"UNKNOWN: not an option of {cfg.task}"))


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    return value


def format_config(cfg: RunConfig, *, max_value_chars: int = 80) -> str:
    """One line per key: ``key = value  # doc``. Values are YAML (JSON where quoting is needed, so a
    value never spans lines); one longer than ``max_value_chars`` is cut, with its length."""

    def show(value: object) -> str:
        plain = list(value) if isinstance(value, tuple) else value
        text = json.dumps(plain)
        if isinstance(plain, str) and _BARE.fullmatch(plain) and yaml.safe_load(plain) == plain:
            text = plain  # a bare YAML string reads back as itself: no quotes needed
        if len(text) > max_value_chars:
            text = f"{text[: max_value_chars - 20]}... ({len(text)} chars)"
        return text

    rows = [(f"{key} = {show(value)}", doc) for key, value, doc in config_rows(cfg)]
    width = min(max(len(left) for left, _ in rows), max_value_chars)
    return "\n".join(f"{left:<{width}}  # {doc}" if doc else left for left, doc in rows)
