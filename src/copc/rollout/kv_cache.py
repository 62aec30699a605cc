"""The engine's KV cache: plain per-layer keys/values that grow in place instead of by copying.

transformers' :class:`~transformers.cache_utils.DynamicLayer` appends a decode step's keys and values
with ``torch.cat``, so every step copies the whole cache: under the profiler that copy was half of the
self time of a 128-row decode on a CPU, and without it the call is 1.15-1.2x faster
(``benchmarks/engine_blocks.py``, one thread, 2026-12-01). A :class:`GrowingLayer` keeps its keys and
values in a buffer with room for more tokens and writes each step's into it; ``keys`` and ``values``
are views of the filled part, so attention reads the same numbers as before (the generations are
bit-identical, tested). The buffer grows by half its length when full, so the copying is amortised
O(length).

Everything else (row selection, the prefix reuse of multi-turn episodes) works on ``keys`` and
``values`` as on a ``DynamicLayer``. ``crop`` leaves views of the same buffer; a base-class method that
replaces them with new tensors (``reorder_cache``, ``batch_repeat_interleave``) is noticed at the next
``update``, which then starts a new buffer from them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["GrowingLayer", "growing_cache", "plain_dynamic_cache", "plain_kv", "rows_of", "stacked"]

MIN_ROOM = 64
"""Tokens of room a new buffer gets at least beyond what it holds (a testbed turn's 48 fit in it)."""


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of a buffer with room to grow (module docstring)."""

    def __init__(
        self, keys: torch.Tensor | Sequence[torch.Tensor] | None = None,
        values: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Empty, or holding ``keys``/``values`` ``[B, heads, length, head_dim]`` (or their batch parts, in
        order: copied once, straight into the buffer)."""
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        if keys is not None and values is not None:
            key_parts = [keys] if isinstance(keys, torch.Tensor) else list(keys)
            value_parts = [values] if isinstance(values, torch.Tensor) else list(values)
            self.device, self.is_initialized = key_parts[0].device, True
            self._rebuffer(key_parts, value_parts, extra=0)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, heads, n, head_dim]`` keys/values; the whole filled cache as views."""
        if not self.is_initialized or self.keys is None or self.values is None:
            self.device, self.is_initialized = key_states.device, True
            self._rebuffer([key_states], [value_states], extra=0)
            return self._views(key_states.shape[-2])
        length, added = self.keys.shape[-2], key_states.shape[-2]
        if not self._owns_views() or length + added > self.capacity:
            self._rebuffer([self.keys], [self.values], extra=added)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, length : length + added] = key_states
        self._value_buffer[:, :, length : length + added] = value_states
        return self._views(length + added)

    @property
    def capacity(self) -> int:
        """Tokens the buffer holds before it must grow (0 before the first update)."""
        return self._key_buffer.shape[-2] if self._key_buffer is not None else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (buffer room included, so the next steps still write in place)."""
        if self.keys is None or not self._owns_views():
            super().batch_select_indices(indices)
            return
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer, self._value_buffer = self._key_buffer[indices], self._value_buffer[indices]
        self._views(self.keys.shape[-2])

    def _views(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Point ``keys``/``values`` at the buffers' first ``length`` tokens."""
        assert self._key_buffer is not None and self._value_buffer is not None
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]
        return self.keys, self.values

    def _owns_views(self) -> bool:
        """Whether ``keys``/``values`` are still the views this layer gave out (not replaced by the base)."""
        buffer, keys = self._key_buffer, self.keys
        return (
            buffer is not None
            and keys is not None
            and keys.data_ptr() == buffer.data_ptr()
            and keys.shape[0] == buffer.shape[0]
            and keys.stride() == buffer.stride()
        )

    def _rebuffer(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], *, extra: int) -> None:
        """New buffers holding the batch parts ``keys``/``values`` (stacked in order) with room for
        ``extra`` more tokens and then some."""
        length = keys[0].shape[-2]
        room = length + extra + max(MIN_ROOM, (length + extra) // 2)
        self._key_buffer, self._value_buffer = _buffer(keys, room), _buffer(values, room)
        self._views(length)


def _buffer(parts: Sequence[torch.Tensor], room: int) -> torch.Tensor:
    """``[sum of B, heads, room, dim]``: the parts' tokens first, stacked along the batch; the rest unset."""
    batch, (_, heads, length, dim) = sum(p.shape[0] for p in parts), parts[0].shape
    out = parts[0].new_empty(batch, heads, room, dim)
    lo = 0
    for part in parts:
        out[lo : lo + part.shape[0], :, :length] = part
        lo += part.shape[0]
    return out


def growing_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Cache:
    """A cache of :class:`GrowingLayer`: empty (layers made as the model fills them) or holding ``layers``
    (per layer ``(keys, values)`` ``[B, heads, length, head_dim]``, copied into the buffers)."""
    if layers is None:
        return Cache(layer_class_to_replicate=GrowingLayer)
    return Cache(layers=[GrowingLayer(keys, values) for keys, values in layers])


def plain_kv(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` ``[B, heads, length, head_dim]`` of a cache of plain layers."""
    layers = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)  # plain layers only
        layers.append((keys, values))
    return layers


def rows_of(cache: Cache, rows: slice) -> Cache:
    """The batch rows ``rows`` of a plain cache, as a growing cache of their own."""
    return growing_cache([(keys[rows], values[rows]) for keys, values in plain_kv(cache)])


def stacked(parts: Sequence[Cache]) -> Cache:
    """Plain caches of the same length stacked along the batch: one growing cache for the whole batch."""
    layers = zip(*(plain_kv(part) for part in parts), strict=True)
    return Cache(layers=[GrowingLayer([k for k, _ in group], [v for _, v in group]) for group in layers])


def plain_dynamic_cache(model: PreTrainedModel) -> bool:
    """Prefix reuse needs plain growing cache layers (no sliding windows, no recurrent state)."""
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # configs DynamicCache cannot read: no reuse, plain generation still works
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
