"""Weights in checkpoints as safetensors files (copc.trainer.checkpoint writes and reads them).

A flat state dict wrapped in :class:`Weights` anywhere in a checkpoint payload is written as a file of its
own, named by its key path (``trainer.policy.safetensors``), and replaced in ``state.pt`` by a
reference ``{"__safetensors__": file name}``. Tied tensors (an embedding shared with the LM head) are
stored once, their other names kept in the file's metadata, and tied again on load. Two weight sets with
equal names, dtypes, shapes and bytes (the driver's snapshot of the newest version and the trained
policy) share one file. Any safetensors reader opens the files; copc's loader gives plain dicts back.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

__all__ = ["WEIGHTS_SUFFIX", "WeightFiles", "Weights", "join_weights", "read_weights", "split_weights", "write_weights"]

WEIGHTS_SUFFIX = ".safetensors"
_WEIGHTS_REF = "__safetensors__"  # {_WEIGHTS_REF: file name} stands in state.pt for a Weights value
_ALIASES = "copc_aliases"  # safetensors metadata: JSON {alias: stored name} of tied tensors


class Weights(dict[str, torch.Tensor]):
    """A flat state dict (name -> tensor) that :func:`save_checkpoint` stores as its own safetensors file.

    Loading gives a plain ``dict`` back, bit-exact, with tied tensors sharing storage again.
    """



class WeightFiles:
    """The weights files of one checkpoint; a set equal to one already added (names, dtypes, shapes and
    bytes: e.g. the driver's snapshot of the newest version and the trained policy) shares its file."""

    def __init__(self) -> None:
        self.files: dict[str, Weights] = {}
        self._by_digest: dict[str, str] = {}

    def add(self, name: str, weights: Weights) -> str:
        digest = hashlib.sha256()
        for key in sorted(weights):
            tensor = weights[key].detach().contiguous()
            digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
        same = self._by_digest.get(digest.hexdigest())
        if same is not None:
            return same
        self._by_digest[digest.hexdigest()] = name
        self.files[name] = weights
        return name


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
    """One safetensors file: each storage written once, names that alias it recorded in the metadata."""
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
    data = save_safetensors(stored, metadata={_ALIASES: json.dumps(aliases)})
    try:
        with path.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    data = path.read_bytes()
    tensors = load_safetensors(data)
    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    for alias, name in json.loads(metadata.get(_ALIASES, "{}")).items():
        tensors[alias] = tensors[name]
    return tensors


def join_weights(value: object, directory: Path) -> object:
    """Inverse of :func:`_split_weights`: each file reference replaced by the tensors it names."""
    if isinstance(value, dict):
        if set(value) == {_WEIGHTS_REF}:
            return read_weights(directory / str(value[_WEIGHTS_REF]))
        return {key: join_weights(item, directory) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(join_weights(item, directory) for item in value)
    return value
