"""Loading dataset rows for the dataset-backed tasks: JSONL, JSON, Parquet, or a Hugging Face dataset.

``source`` is a local path (``.jsonl``, ``.json``, ``.parquet``) or ``hf:NAME`` (``hf:NAME:CONFIG``) for
``datasets.load_dataset`` (an optional extra, imported only then; it needs the hub or a local cache).
Rows are plain dicts. :func:`column` reads one field of one row and fails with a message that names the
source, the row and the fix when the field is missing or empty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

Row = Mapping[str, object]


def load_rows(source: str, *, hf_split: str = "train") -> list[Row]:
    """All rows of ``source`` (see the module docstring), in file order."""
    if source.startswith("hf:"):
        return _load_hf(source[3:], hf_split)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist; pass a .jsonl/.json/.parquet path or hf:NAME")
    if path.suffix == ".parquet":
        return _load_parquet(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json data file must hold a list of objects; use .jsonl for one per line")
        return [_as_row(item, path, i + 1) for i, item in enumerate(data)]
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: unknown data format {path.suffix!r}; use .jsonl, .json, .parquet or hf:NAME")
    rows: list[Row] = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not valid JSON ({error.msg}); fix or remove the line") from None
            rows.append(_as_row(item, path, number))
    return rows


def _as_row(item: object, path: Path, number: int) -> Row:
    if not isinstance(item, dict):
        raise ValueError(f"{path}, row {number}: expected a JSON object, got {type(item).__name__}")
    return item


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


def column(row: Row, key: str, *, source: str, index: int, option: str) -> object:
    """``row[key]``, or an error naming ``source``, the 1-based row ``index`` and the config ``option``."""
    value = row.get(key)
    if value is None or (isinstance(value, str | list | tuple) and len(value) == 0):
        present = ", ".join(sorted(row)) or "none"
        raise ValueError(
            f"{source}, row {index}: column {key!r} is missing or empty (columns present: {present}); "
            f"fix the row or set {option}=<column name>"
        )
    return value


def text_column(row: Row, key: str, *, source: str, index: int, option: str) -> str:
    """A column read as text (numbers are converted, e.g. an integer answer)."""
    value = column(row, key, source=source, index=index, option=option)
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError(f"{source}, row {index}: column {key!r} should be text, got {type(value).__name__}")


def answers_column(row: Row, key: str, *, source: str, index: int, option: str) -> tuple[str, ...]:
    """A gold-answer column: a list of strings (Search-R1's ``golden_answers``) or a single value."""
    value = column(row, key, source=source, index=index, option=option)
    if isinstance(value, str | int | float):
        return (str(value),)
    if isinstance(value, Sequence) and all(isinstance(v, str | int | float) for v in value):
        return tuple(str(v) for v in value)
    raise ValueError(f"{source}, row {index}: column {key!r} should be a list of strings, got {value!r}")
