"""Generic machinery for configs: nested frozen dataclasses <-> dicts, YAML files and CLI overrides.

Every component owns a frozen dataclass config (CONTRIBUTING.md#configs): each field has a default, a
one-line doc under it, and ``__post_init__`` checks ranges and says how to fix a bad value. This module
knows nothing about any particular component. It turns plain data (a YAML file, ``key.sub=value``
overrides) into those dataclasses, checking every value against the field's annotation:

- ``bool`` accepts only true/false (not 0/1); ``int`` rejects bools; ``float`` accepts ints and the
  strings ``inf``/``-inf``; ``str``; ``Literal[...]`` (the valid choices are listed on error);
- every ``float`` field must be finite (``nan`` never is a setting; ``actor_lr=inf`` would train NaN
  weights), except the fields a config class names in its ``INFINITE_OK`` class variable, where
  ``inf`` means "no bound";
- ``X | None`` / ``Optional[X]`` and other unions (first member that accepts the value wins);
- ``tuple[X, ...]``, ``tuple[X, Y]``, ``list[X]``, ``dict[str, X]``;
- nested dataclasses (a mapping, merged over the current or default section).

Any problem raises :class:`ConfigError` with a one-line message that names the key, its section and
what to do (the CLI prints it without a traceback). Annotations are resolved with
``typing.get_type_hints``, so configs may use ``from __future__ import annotations``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, NoReturn, TypeAlias, TypeVar, Union

import yaml

T = TypeVar("T")

#: Plain data a config turns into and comes from (what YAML and JSON can hold).
ConfigValue: TypeAlias = Union[  # noqa: UP007 (a recursive alias needs the subscript form)
    bool, int, float, str, list["ConfigValue"], dict[str, "ConfigValue"], None
]


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message is one line that says how to fix it."""


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line pointing to ``--help``, not a usage block and
    the error (every copc command's parser, sub-parsers included)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; {self.prog} --help lists the "
                     f"arguments\n")


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _section_name(section: str) -> str:
    return f"section '{section}'" if section else "the top-level config"


def _unknown_key(key: str, section: str, valid: Sequence[str]) -> ConfigError:
    hint = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    did_you_mean = f" (did you mean '{hint[0]}'?)" if hint else ""
    return ConfigError(
        f"unknown key '{key}' in {_section_name(section)}{did_you_mean}; valid keys: {', '.join(valid)}"
    )


def _field_types(cls: type) -> dict[str, object]:
    """Resolved annotations of the init fields of dataclass ``cls`` (works with postponed annotations)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _describe(tp: object) -> str:
    if tp == ConfigValue:
        return "plain data (a number, string, boolean, list or mapping)"
    if isinstance(tp, type):
        return tp.__name__
    origin = typing.get_origin(tp)
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        return " | ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    return str(tp).replace("typing.", "")


def _is_dataclass_type(tp: object) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: object, tp: object, where: str) -> object:
    """Check ``value`` against annotation ``tp`` and convert it (lists -> tuples, int -> float ...)."""
    if isinstance(tp, typing.ForwardRef):  # the recursive ConfigValue alias; anything else: unchecked
        tp = ConfigValue if tp.__forward_arg__ == "ConfigValue" else typing.Any
    origin = typing.get_origin(tp)
    if tp is typing.Any or tp is object:
        return value
    if origin is Literal:
        return _coerce_choice(value, typing.get_args(tp), where)
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        return _coerce_union(value, tp, where)
    if origin in (tuple, list, dict):
        return _coerce_container(value, tp, where)
    if _is_dataclass_type(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):  # type: ignore[arg-type]
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping for section '{where}', got {value!r}")
        return _build(tp, value, where)  # type: ignore[arg-type]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            return _coerce_choice(value, tuple(m.value for m in tp), where)
    return _coerce_scalar(value, tp, where)


def _coerce_choice(value: object, choices: tuple[object, ...], where: str) -> object:
    for choice in choices:
        if value == choice and type(value) is type(choice):
            return choice
    valid = ", ".join(repr(c) for c in choices)
    raise ConfigError(f"{where}: {value!r} is not a valid choice; valid choices: {valid}")


def _coerce_union(value: object, tp: object, where: str) -> object:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:  # Optional[X]: X's own message is the precise one
        return _coerce(value, members[0], where)
    for member in members:
        try:
            return _coerce(value, member, where)
        except ConfigError:
            continue
    raise ConfigError(f"{where}: {value!r} does not fit {_describe(tp)}")


def _coerce_container(value: object, tp: object, where: str) -> object:
    """``list[X]``, ``tuple[X, ...]``, ``tuple[X, Y]`` (from any list) and ``dict[K, V]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping ({_describe(tp)}), got {value!r}")
        key_tp, val_tp = args if args else (typing.Any, typing.Any)
        return {_coerce(k, key_tp, where): _coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"{where}: expected a list ({_describe(tp)}), got {value!r}")
    items = list(value)
    if origin is list:
        member = args[0] if args else typing.Any
        return [_coerce(v, member, f"{where}[{i}]") for i, v in enumerate(items)]
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(items))
    if not args:
        return tuple(items)
    if len(args) != len(items):
        raise ConfigError(f"{where}: expected {len(args)} items ({_describe(tp)}), got {len(items)}")
    return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(items, args, strict=True)))


def _coerce_scalar(value: object, tp: object, where: str) -> object:
    """``bool`` (true/false only), ``int`` (not bool), ``float`` (ints and inf/nan strings), ``str``."""
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:  # torch, numpy and the seeds take signed 64-bit integers
                raise ConfigError(f"{where}: must fit in 64 bits (between -2**63 and 2**63 - 1), got a "
                                  f"{len(str(abs(value)))}-digit number")
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{where}: {str(value)[:12]}... ({len(str(value))} digits) is too large "
                                  f"for a number here; give a value below 1e308") from None
        if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf", "infinity",
                                                                "-infinity"):
            return float(value.strip().lower().replace("infinity", "inf"))
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r} (quote it)")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    raise ConfigError(f"{where}: unsupported annotation {_describe(tp)} in a config class")


def _check_finite(cls: type, kwargs: Mapping[str, object], section: str) -> None:
    """Every float value given must be finite, but ``inf`` in a field ``cls.INFINITE_OK`` names."""
    allowed = getattr(cls, "INFINITE_OK", ())
    for key, value in kwargs.items():
        if not isinstance(value, float) or math.isfinite(value):
            continue
        if math.isnan(value):
            raise ConfigError(f"{_join(section, key)}: nan is not a valid setting; give a number")
        if key not in allowed:
            raise ConfigError(f"{_join(section, key)}: {value} is not allowed here; give a finite number")


def _construct(cls: type[T], kwargs: Mapping[str, object], section: str) -> T:
    """Call ``cls(**kwargs)``; a range check failing in ``__post_init__`` becomes a one-line ConfigError."""
    _check_finite(cls, kwargs, section)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        message = " ".join(str(err).split())
        raise ConfigError(f"{_section_name(section)} ({cls.__name__}): {message}") from None


def _build(cls: type[T], data: Mapping[str, object], section: str, base: T | None = None) -> T:
    """Build ``cls`` from ``data``, starting from ``base`` (or the defaults) for keys not given."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_section_name(section)} must be a mapping, got {data!r}")
    hints = _field_types(cls)
    kwargs: dict[str, object] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in hints:
            raise _unknown_key(str(key), section, list(hints))
        tp = hints[key]
        where = _join(section, key)
        current = getattr(base, key) if base is not None else None
        if (
            isinstance(value, Mapping)
            and _is_dataclass_type(current.__class__)
            and isinstance(current, _plain_dataclass_types(tp))
        ):
            kwargs[key] = _build(type(current), value, where, base=current)
        else:
            kwargs[key] = _coerce(value, tp, where)
    if base is not None:
        return _replace(base, kwargs, section)
    return _construct(cls, kwargs, section)


def _plain_dataclass_types(tp: object) -> tuple[type, ...]:
    """The dataclass types an annotation admits (``X``, ``X | None`` ...), for merging a mapping."""
    if _is_dataclass_type(tp):
        return (tp,)  # type: ignore[return-value]
    return tuple(a for a in typing.get_args(tp) if _is_dataclass_type(a))


def _replace(cfg: T, changes: Mapping[str, object], section: str) -> T:
    fields = [f for f in dataclasses.fields(cfg) if f.init]  # type: ignore[arg-type]
    kwargs = {f.name: getattr(cfg, f.name) for f in fields}
    kwargs.update(changes)
    return _construct(type(cfg), kwargs, section)


def from_dict(cls: type[T], data: Mapping[str, object] | None, *, section: str = "") -> T:
    """Build config ``cls`` from plain data; keys not given keep their defaults. ``section``: where ``data``
    sits in the run's config (``task_options``, ``method_overrides.policy``), for the messages.

    Raises:
        ConfigError: unknown key (with the valid keys and a close match), wrongly typed value, or a
            value the dataclass's ``__post_init__`` rejects.
    """
    if not _is_dataclass_type(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    return _build(cls, data or {}, section)


def to_dict(cfg: object) -> dict[str, ConfigValue]:
    """Plain, YAML/JSON-ready data for a config dataclass (tuples become lists, enums their value)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict needs a dataclass instance, got {cfg!r}")
    out = _plain(cfg)
    assert isinstance(out, dict)
    return out


def _plain(value: object) -> ConfigValue:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"config value {value!r} of type {type(value).__name__} cannot be written to YAML")


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, line: int, first: int) -> None:
        super().__init__(f"key '{key}' on line {line} is given twice (first on line {first})")
        self.key, self.line, self.first = key, line, first


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` where a key given twice in one mapping is an error (PyYAML keeps the last one
    silently): sweep and contrasts files, whose level names must read as written (``1e-4`` stays a string)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(str(key), line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]


class ConfigLoader(UniqueKeyLoader):
    """:class:`UniqueKeyLoader` for config files, where also ``1e-5`` is a float (YAML 1.1 wants ``1.0e-5``
    and reads ``1e-5`` as a string, while the command line, YAML 1.2 and Python all read a number): neither
    lets a file mean something else than it says."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(cls: type[T], path: str | os.PathLike[str]) -> T:
    """Read a YAML file (a mapping of sections) into config ``cls`` (:class:`ConfigLoader`: ``1e-5`` is a
    number, a duplicated key an error naming the key and its line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}); "
                          "save it as UTF-8 YAML") from None
    try:
        data = yaml.load(text, Loader=ConfigLoader)  # a SafeLoader subclass: no arbitrary objects
    except _DuplicateKey as err:
        raise ConfigError(f"config file {path}, line {err.line}: key '{err.key}' is given twice (first on "
                          f"line {err.first}); keep one") from None
    except yaml.YAMLError as err:
        first = " ".join(str(err).split())
        raise ConfigError(f"config file {path} is not valid YAML: {first}") from None
    if data is None:
        raise ConfigError(
            f"config file {path} is empty; write the keys to change (or leave out --config for the defaults)"
        )
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    try:
        return from_dict(cls, data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def dump_yaml(cfg: object, path: str | os.PathLike[str]) -> Path:
    """Write ``cfg`` as YAML (atomically: a temp file, then ``os.replace``); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True))
    os.replace(tmp, path)
    return path


def parse_override(text: str) -> tuple[list[str], object]:
    """Split ``"a.b=value"`` into ``(["a", "b"], parsed value)``; the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value (for example trainer.lr=1e-5)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. an unbalanced bracket): keep the text as written
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)  # YAML 1.1 reads "1e-5" as a string; people mean a number
    return key.split("."), value


def _looks_like_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _override_one(cfg: T, path: list[str], value: object, section: str) -> T:
    hints = _field_types(type(cfg))
    key = path[0]
    if key not in hints:
        raise _unknown_key(key, section, list(hints))
    where = _join(section, key)
    current = getattr(cfg, key)
    if len(path) > 1 and isinstance(current, Mapping):  # a dict field: set (or add) one entry
        return _replace(cfg, {key: _coerce(_set_entry(current, path[1:], value), hints[key], where)}, section)
    if len(path) > 1:
        if not (dataclasses.is_dataclass(current) and not isinstance(current, type)):
            raise ConfigError(f"'{where}' is a value, not a section: write {where}=VALUE")
        return _replace(cfg, {key: _override_one(current, path[1:], value, where)}, section)
    if isinstance(value, Mapping) and dataclasses.is_dataclass(current) and not isinstance(current, type):
        new: object = _build(type(current), value, where, base=current)
    else:
        new = _coerce(value, hints[key], where)
    return _replace(cfg, {key: new}, section)


def _set_entry(mapping: Mapping[str, object], path: list[str], value: object) -> dict[str, object]:
    """A copy of ``mapping`` with ``mapping[p0][p1]... = value`` (missing levels become mappings)."""
    out = dict(mapping)
    if len(path) == 1:
        out[path[0]] = value
        return out
    inner = out.get(path[0], {})
    if not isinstance(inner, Mapping):
        raise ConfigError(f"'{path[0]}' holds {inner!r}, not a mapping: cannot set {'.'.join(path)}")
    out[path[0]] = _set_entry(inner, path[1:], value)
    return out


def apply_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """Return ``cfg`` with each ``"key.sub=value"`` applied in order (values parsed as YAML).

    Example: ``apply_overrides(cfg, ["trainer.lr=1e-5", "method=copc", "staleness.mode=bounded"])``.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"apply_overrides needs a dataclass instance, got {cfg!r}")
    for text in overrides:
        path, value = parse_override(text)
        try:
            cfg = _override_one(cfg, path, value, "")
        except ConfigError as err:
            raise ConfigError(f"override {text!r}: {err}") from None
    return cfg


# ------------------------------------------------------- checks shared by the configs' __post_init__


def check_one_of(field: str, value: object, valid: tuple[object, ...]) -> None:
    """Raise ``ValueError`` naming ``field`` and the valid values unless ``value`` is one of ``valid``."""
    if value not in valid:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, valid))}; got {value!r}")


def check_positive(owner: str, **values: float) -> None:
    """Raise naming the first field of ``owner`` that is not a finite number > 0."""
    for key, value in values.items():
        if not 0 < value < math.inf:
            raise ValueError(f"{owner}.{key} must be > 0 and finite, got {value!r}")


def check_at_least(owner: str, least: float, **values: float) -> None:
    """Raise naming the first field of ``owner`` (``""``: the top level) below ``least``, and its value."""
    for key, value in values.items():
        if value < least:
            raise ValueError(f"{_join(owner, key)} must be >= {least}, got {value!r}")


def check_fraction(owner: str, **values: float) -> None:
    """Raise naming the first field of ``owner`` outside [0, 1]."""
    for key, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{owner}.{key} must be in [0, 1], got {value!r}")
