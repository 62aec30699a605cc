"""Weights in checkpoints as safetensors files (copc.trainer.checkpoint writes and reads them).

A flat state dict wrapped in :class:`Weights` anywhere in a checkpoint payload is written as a file of its
own, named by its key path (``trainer.policy.safetensors``), and replaced in ``state.pt`` by a
reference ``{"__safetensors__": file name}``. Tied tensors (an embedding shared with the LM head) are
stored once, their other names kept in the file's metadata, and tied again on load. Two weight sets with
equal names, dtypes, shapes and bytes (the driver's snapshot of the newest version and the trained
policy) share one file. Any safetensors reader opens the files; copc's loader gives plain dicts back.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = ["WEIGHTS_SUFFIX", "WeightFiles", "Weights", "join_weights", "read_weights", "split_weights",
           "write_weights"]

WEIGHTS_SUFFIX = ".safetensors"
_WEIGHTS_REF = "__safetensors__"  # {_WEIGHTS_REF: file name} stands in state.pt for a Weights value
_ALIASES = "copc_aliases"  # safetensors metadata: JSON {alias: stored name} of tied tensors


class Weights(dict[str, torch.Tensor]):
    """A flat state dict (name -> tensor) that :func:`save_checkpoint` stores as its own safetensors file.

    Loading gives a plain ``dict`` back, bit-exact, with tied tensors sharing storage again.
    """


class WeightFiles:
    """The weights files of one checkpoint; a set equal to one already added (the same names, dtypes,
    shapes and values: e.g. the driver's snapshot of the newest version and the trained policy)
    shares its file."""

    def __init__(self) -> None:
        self.files: dict[str, Weights] = {}

    def add(self, name: str, weights: Weights) -> str:
        for known, other in self.files.items():
            if other.keys() == weights.keys() and all(_same(other[k], weights[k]) for k in weights):
                return known
        self.files[name] = weights
        return name


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)  # equal() alone promotes dtypes


def split_weights(value: object, path: tuple[str, ...], out: WeightFiles) -> object:
    """``value`` with every :class:`Weights` replaced by a reference to its file (collected in ``out``)."""
    if isinstance(value, Weights):
        return {_WEIGHTS_REF: out.add(".".join(path) + WEIGHTS_SUFFIX, value)}
    if isinstance(value, Mapping):
        return {key: split_weights(item, (*path, str(key)), out) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(split_weights(item, (*path, str(i)), out) for i, item in enumerate(value))
    return value


def write_weights(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """One safetensors file: each storage written once, names that alias it recorded in the metadata.

    The library writes straight from the tensors' memory (serialising to bytes would hold two transient
    copies of the set: about 1 GiB above the step's peak for a 135M-parameter policy), then the file is
    fsynced. A failed write is an ``OSError`` with its errno and path, as the rest of the checkpoint
    reports it (the library's own error carries the OS error's number in its message)."""
    stored: dict[str, torch.Tensor] = {}
    seen: dict[tuple[object, ...], str] = {}
    storages: set[int] = set()
    aliases: dict[str, str] = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        ptr = tensor.untyped_storage().data_ptr()
        key = (ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        if tensor.numel() > 0 and ptr not in storages:
            seen[key] = name
            storages.add(ptr)
            stored[name] = tensor.contiguous()
        else:  # empty, or a different view of a storage already written: its own copy
            stored[name] = tensor.clone().contiguous()
    try:
        save_file(stored, str(path), metadata={_ALIASES: json.dumps(aliases)})
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    except SafetensorError as err:
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one file written by :func:`write_weights`, aliases tied again."""
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
        aliases = json.loads((handle.metadata() or {}).get(_ALIASES, "{}"))
    for alias, name in aliases.items():
        tensors[alias] = tensors[name]
    return tensors


def join_weights(value: object, directory: Path) -> object:
    """Inverse of :func:`split_weights`: each file reference replaced by the tensors it names."""
    if isinstance(value, dict):
        if set(value) == {_WEIGHTS_REF}:
            return read_weights(directory / str(value[_WEIGHTS_REF]))
        return {key: join_weights(item, directory) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(join_weights(item, directory) for item in value)
    return value
