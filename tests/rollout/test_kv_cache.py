"""The engine's growing KV cache: the same keys/values as transformers' DynamicLayer at every step, the
same generations bit for bit, and amortised growth."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import copc.rollout.engine as engine_module
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine
from copc.rollout.kv_cache import GrowingLayer, growing_cache, plain_kv, rows_of, stacked
from copc.rollout.sampling import SamplingConfig


def _kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 3, generator=g), torch.randn(batch, 2, length, 3, generator=g)


def test_growing_layer_holds_what_a_dynamic_layer_holds_through_appends_selections_crops_and_replacements(
        ) -> None:
    growing, dynamic = GrowingLayer(), DynamicLayer()
    script: list[tuple[str, object]] = [("append", 5), *[("append", 1)] * 70, ("select", [0, 2, 3]),
                                        *[("append", 1)] * 60, ("crop", -4), ("append", 2), ("repeat", 2),
                                        ("append", 1), ("select", [1]), ("append", 130)]
    batch = 4
    for step, (op, arg) in enumerate(script):
        if op == "append":
            k, v = _kv(batch, int(arg), seed=step)  # type: ignore[call-overload]
            got, want = growing.update(k, v), dynamic.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
        elif op == "select":
            index = torch.tensor(arg)
            growing.batch_select_indices(index)
            dynamic.batch_select_indices(index)
            batch = len(index)
        elif op == "repeat":  # the base class replaces keys/values: the next update must notice
            growing.batch_repeat_interleave(int(arg))  # type: ignore[call-overload]
            dynamic.batch_repeat_interleave(int(arg))  # type: ignore[call-overload]
            batch *= int(arg)  # type: ignore[call-overload]
        else:
            growing.crop(int(arg))  # type: ignore[call-overload]
            dynamic.crop(int(arg))  # type: ignore[call-overload]
        assert growing.keys is not None and dynamic.keys is not None
        assert growing.values is not None and dynamic.values is not None
        assert torch.equal(growing.keys, dynamic.keys) and torch.equal(growing.values, dynamic.values), step
        assert growing.get_seq_length() == dynamic.get_seq_length()


def test_appending_one_token_at_a_time_reallocates_a_logarithmic_number_of_times() -> None:
    layer = GrowingLayer(*_kv(2, 10, seed=0))
    capacities = {layer.capacity}
    for step in range(1000):
        layer.update(*_kv(2, 1, seed=step + 1))
        capacities.add(layer.capacity)
        assert layer.capacity >= layer.get_seq_length()
    assert layer.get_seq_length() == 1010
    # 10 + 64 of room, then each new buffer is (length + 1) * 1.5: 7 buffers for 1010 tokens, not 1000
    assert sorted(capacities) == [74, 139, 210, 316, 475, 714, 1072]


def test_cache_helpers_keep_rows_and_stack_batches() -> None:
    layers = [_kv(5, 7, seed=1), _kv(5, 7, seed=2)]
    cache = growing_cache(layers)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    for (k, v), (k0, v0) in zip(plain_kv(cache), layers, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    top, bottom = rows_of(cache, slice(0, 2)), rows_of(cache, slice(2, 5))
    for (k, v), (k0, v0) in zip(plain_kv(stacked([top, bottom])), layers, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert growing_cache().get_seq_length() == 0


def _dynamic(layers=None) -> DynamicCache:  # type: ignore[no-untyped-def]
    return DynamicCache(ddp_cache_data=layers) if layers is not None else DynamicCache()


def test_generations_are_bit_identical_to_dynamic_cache_ones(
        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Ragged rows in blocks with prefill chunks, rows finishing early (stop strings, EOS), a second turn
    from the first one's keys/values: the same tokens and log-probs as with transformers' DynamicCache."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(3, 100, (int(n),), generator=g).tolist()]
               for n in torch.randint(5, 90, (40,), generator=g)]
    config = SamplingConfig(max_new_tokens=30, stop_strings=("7",))

    def play() -> list[tuple[list[int], list[float]]]:
        engine = Engine(model, tok, max_rows=16, prefill_tokens=600)
        first = engine.generate(prompts, config, seeds=list(range(40)), return_kv=True)
        follow = [p + x.token_ids.tolist() + [5, 6] for p, x in zip(prompts, first, strict=True)]
        second = engine.generate(follow, config, seeds=list(range(40, 80)), prefix_kv=[x.kv for x in first])
        return [(x.token_ids.tolist(), x.logp.tolist()) for x in (*first, *second)]

    growing = play()
    monkeypatch.setattr(engine_module, "growing_cache", _dynamic)
    monkeypatch.setattr(engine_module, "rows_of", lambda c, r: _dynamic([(k[r], v[r]) for k,
                                                                         v in plain_kv(c)]))
    monkeypatch.setattr(engine_module, "stacked", lambda parts: _dynamic([
        (torch.cat([k for k, _ in grp]), torch.cat([v for _, v in grp]))
        for grp in zip(*(plain_kv(p) for p in parts), strict=True)
    ]))
    assert play() == growing
    assert len({len(ids) for ids, _ in growing}) > 3  # rows did finish at different steps
