"""Loading dataset rows for the dataset-backed tasks: JSONL, JSON, Parquet, or a Hugging Face dataset.

``source`` is a local path (``.jsonl``, ``.json``, ``.parquet``) or ``hf:NAME`` (``hf:NAME:CONFIG``) for
``datasets.load_dataset`` (an optional extra, imported only then; it needs the hub or a local cache).

Every row keeps where it came from (:class:`SourceRow`: ``"data.jsonl, line 7"``; ``row N`` for
formats without lines), so every problem with a row is one :class:`DataError` line that names the file
and the line, counted in the file (blank lines and held-out eval rows included), and says what to do:
a line that is not UTF-8 or not JSON, a row that is not an object, a missing or empty column, a
boolean or float where text is expected (``true`` would silently become ``"True"``, ``0.1`` its
shortest repr), a file without rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

Row = Mapping[str, object]

__all__ = ["DataError", "Row", "SourceRow", "answers_column", "column", "load_rows", "text_column"]


class DataError(ValueError):
    """A data file or row is unusable; the message is one line naming the file, the line and the fix."""


@dataclass(frozen=True)
class SourceRow:
    """One row and where it is: ``where`` = ``"PATH, line N"`` (JSONL) or ``"PATH, row N"``; ``line`` = N."""

    where: str
    line: int
    data: Row


def load_rows(source: str, *, hf_split: str = "train") -> list[SourceRow]:
    """All rows of ``source`` (see the module docstring), in file order; a file without rows is an error."""
    if source.startswith("hf:"):
        rows = [SourceRow(f"{source}, row {i + 1}", i + 1, r) for i, r in enumerate(_load_hf(source[3:],
                                                                                             hf_split))]
    else:
        rows = _load_file(Path(source).expanduser())
    if not rows:
        raise DataError(f"{source} holds no rows; fill it or point data at another file")
    return rows


def _load_file(path: Path) -> list[SourceRow]:
    if not path.exists():
        raise FileNotFoundError(
            f"data file {path} does not exist; pass a .jsonl/.json/.parquet path or hf:NAME")
    if path.suffix == ".parquet":
        return [SourceRow(f"{path}, row {i + 1}", i + 1, r) for i, r in enumerate(_load_parquet(path))]
    if path.suffix == ".json":
        try:
            data = json.loads(_utf8(path.read_bytes(), path, 0))
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path}, line {error.lineno}: not valid JSON ({error.msg}); fix the file") from None
        if not isinstance(data, list):
            raise DataError(
                f"{path}: a .json data file must hold a list of objects; use .jsonl for one per line")
        return [_as_row(item, f"{path}, row {i + 1}", i + 1) for i, item in enumerate(data)]
    if path.suffix != ".jsonl":
        raise DataError(
            f"{path}: unknown data format {path.suffix!r}; use .jsonl, .json, .parquet or hf:NAME")
    rows: list[SourceRow] = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            line = _utf8(raw, path, number)
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: not valid JSON ({error.msg}); fix or remove the line") from None
            rows.append(_as_row(item, where, number))
    return rows


def _utf8(raw: bytes, path: Path, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        at = f"{path}, line {line}" if line else str(path)
        raise DataError(
            f"{at}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
            "re-encode the file as UTF-8"
        ) from None


def _as_row(item: object, where: str, number: int) -> SourceRow:
    if not isinstance(item, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(item).__name__}")
    return SourceRow(where, number, item)


def _load_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install 'copc[data]'") from None
    return list(pq.read_table(path).to_pylist())


def _load_hf(name: str, split: str) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"hf:{name} needs the datasets package: pip install 'copc[data]'") from None
    path, _, config = name.partition(":")
    dataset = datasets.load_dataset(path, config or None, split=split)
    return [dict(row) for row in dataset]


def column(row: SourceRow, key: str, *, option: str) -> object:
    """``row.data[key]``, or a :class:`DataError` naming the row's place and the config ``option``."""
    value = row.data.get(key)
    if value is None or (isinstance(value, str | list | tuple) and len(value) == 0):
        present = ", ".join(sorted(row.data)) or "none"
        raise DataError(
            f"{row.where}: column {key!r} is missing or empty (columns present: {present}); "
            f"fix the row or set {option}=<column name>"
        )
    return value


def _text(value: object, row: SourceRow, key: str) -> str:
    if isinstance(value, (bool, float)):
        raise DataError(
            f"{row.where}: column {key!r} holds the {type(value).__name__} {json.dumps(value)}; "
            "write it as a JSON string (in quotes) so the text is exactly what you mean"
        )
    if isinstance(value, str | int):
        return str(value)
    raise DataError(f"{row.where}: column {key!r} should be text, got {type(value).__name__}")


def text_column(row: SourceRow, key: str, *, option: str) -> str:
    """A column read as text (an integer is accepted and converted; booleans and floats are refused)."""
    return _text(column(row, key, option=option), row, key)


def answers_column(row: SourceRow, key: str, *, option: str) -> tuple[str, ...]:
    """A gold-answer column: a list of strings (Search-R1's ``golden_answers``) or a single value."""
    value = column(row, key, option=option)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(_text(v, row, key) for v in value)
    return (_text(value, row, key),)
