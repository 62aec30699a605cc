"""Batched sampling from an HF causal LM with a KV cache, per-token behaviour log-probs and versions.

The loop is written here (not ``model.generate``) so that the log-prob recorded for every sampled token is
computed from the *exact* distribution the token was drawn from (:mod:`copc.rollout.sampling`): with ``top_k =
0`` and ``top_p = 1`` it is the number ``copc.models.token_logprobs(..., temperature=tau)`` gives in a
teacher-forced pass. Each row draws its uniforms from its own seed when ``seeds`` are given, so a row's tokens
do not depend on which other rows share the batch (up to float rounding).

Batches are left-padded; ``position_ids`` count real tokens only, so a padded row sees exactly the positions
and keys it would see alone. Rows that finish are dropped from the KV cache, so the step cost follows the
number of rows still generating. The cache grows in place (:mod:`copc.rollout.kv_cache`), not by a copy per
step.

A row stops at EOS (the EOS token is kept in its ids, not in its text), at the token that completes one of its
stop strings in the decoded text of the tokens generated in this call (the stop string is kept; that token may
carry characters past it, as a BPE piece ``>\n`` after ``</search``: :attr:`Generation.text_to_stop` leaves
them out), or at its token budget.

**Interruptible decoding** (partial rollouts): ``refresh`` runs before the prefill and every ``chunk_tokens``
decode steps; when it loads newer weights (returns True) the running rows continue with them, each token
stamped with its version (``Generation.versions``), and their keys/values are recomputed under the new
weights, not kept, so ``logp`` stays ``log pi_v(token | prefix)`` for the token's own version ``v``
(docs/algorithms.md, "Partial rollouts", has why and the cost).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from copc.models.hf import position_ids_from_mask
from copc.rollout.kv_cache import growing_cache, plain_dynamic_cache, plain_kv, rows_of, stacked
from copc.rollout.sampling import SamplingConfig, sample_inverse_cdf, truncated_logprobs


class FinishReason(str, Enum):
    """Why one row of a :meth:`Engine.generate` call stopped."""

    STOP = "stop"  # the row's last token completed a stop string
    EOS = "eos"  # the model sampled an end-of-sequence token
    LENGTH = "length"  # the row's max_new_tokens ran out


@dataclass(frozen=True)
class Generation:
    """One row's output.

    Attributes:
        token_ids: ``[N] int64``, the sampled tokens (an EOS that ended the row included).
        logp: ``[N] float32``, log mu(token | prefix) under the distribution it was sampled from.
        versions: ``[N] int64``, the weight version that sampled each token (several after a refresh).
        text: decoded text of ``token_ids`` (a final EOS excluded, special tokens otherwise kept).
        finish: why the row stopped.
        stop_string: the stop string the last token completed, when ``finish`` is STOP.
        stop_end: where that stop string ends in ``text`` (the token may run past it).
    """

    token_ids: torch.Tensor
    logp: torch.Tensor
    versions: torch.Tensor
    text: str
    finish: FinishReason
    stop_string: str | None = None
    stop_end: int | None = None
    kv: PrefixKV | None = None

    @property
    def text_to_stop(self) -> str:
        """``text`` up to the end of the stop string that ended the row: what a tool or a grader reads.

        The last token may run past its stop string (``</search>`` closed by a ``>\n`` piece); those
        characters stay in the trajectory, which is what the policy sampled, but they are not part of the
        call or answer the stop string closed."""
        if self.finish is not FinishReason.STOP or self.stop_end is None:
            return self.text
        return self.text[: self.stop_end]

    @property
    def version(self) -> int:
        """The version that sampled the row's first token (the only one without a mid-row refresh)."""
        return int(self.versions[0]) if self.versions.numel() else -1


@dataclass(frozen=True)
class PrefixKV:
    """Keys and values of the first ``length`` tokens of a row, computed with weights ``version``.

    Returned by ``generate(..., return_kv=True)`` for the row's prompt plus all sampled tokens but the
    last (the tokens the model was fed), and accepted back as ``prefix_kv`` so the next turn of a
    multi-turn episode only feeds its new tokens. Ignored when the engine's weights changed since.

    Attributes:
        version: weight version the keys/values were computed with.
        length: number of leading tokens covered.
        layers: per layer ``(keys, values)``, each ``[heads, length, head_dim]``.
    """

    version: int
    length: int
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; set one (tokenizer.eos_token = ...) before "
                         "sampling")
    return ids


MAX_ROWS = 128
"""Default rows decoded together: a ``generate`` call with more runs them in blocks of this many, one block
after another. Re-measured with the growing cache (2026-12-02): in ``benchmarks/engine_blocks.py``, where
every row decodes the same number of tokens, one block of 200-400 rows is 1.1-1.3x faster than blocks of 128;
but a real held-out evaluation of the arith_tool testbed (200 rows that finish at different times) took 12.19
s in one block against 11.71 s in blocks of 128 (``benchmarks/eval_blocks.py --repeats 6``, medians; kv_search
6.73 s against 6.62 s, 2 repeats): each time rows finish, the block's cache is compacted
(``batch_select_indices`` copies it), and a larger block copies more. So 128 stays, on a CPU; other devices
use :data:`ACCELERATOR_MAX_ROWS`."""
ACCELERATOR_MAX_ROWS = 256
"""Default block on any device but the CPU. A GPU's decode step is bound by kernel launches, not by the rows:
on an H200 a 0.6B model took ~42 ms a step for 64 and for 256 rows, so blocks of 128 ran a 256-row batch in
two passes at 0.62x HF ``generate``, one block at 1.10x (``benchmarks/engine_bench.py --device cuda``,
docs/figures/gpu_engine_h200_*). 256 is the largest block measured there; the cap stays because the KV cache
grows with the rows decoded together."""
PREFILL_TOKENS = 8192
"""Default token budget of one prefill forward (rows x padded width) when the cache is a plain one; a longer
batch is fed in row chunks (each row's keys/values do not depend on its chunk but for rounding). A training
batch of the testbeds (32 rows of at most 256 tokens) fits in one."""


class Engine:
    """Samples from a causal LM; owns the model it is given and the version of its weights.

    Rows are decoded in blocks of at most ``max_rows`` (None: :data:`MAX_ROWS` on a CPU,
    :data:`ACCELERATOR_MAX_ROWS` on any other device), and a block's prefill feeds at most
    ``prefill_tokens`` (:data:`PREFILL_TOKENS`) per forward; 0 lifts either limit. Per-row seeds make a
    row's tokens independent of its block up to float rounding.

    The engine puts the model in eval mode and overwrites it in :meth:`load_weights`: give it its own
    copy (``copy.deepcopy(policy)``) when the trainer keeps training the original. Not thread-safe:
    call ``generate`` and ``load_weights`` from one thread (a rollout worker's loop).
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, version: int = 0,
        max_rows: int | None = None, prefill_tokens: int = PREFILL_TOKENS,
    ) -> None:
        self._device = next(model.parameters()).device
        if max_rows is None:  # the device's default
            max_rows = MAX_ROWS if self._device.type == "cpu" else ACCELERATOR_MAX_ROWS
        if max_rows < 0 or prefill_tokens < 0:
            raise ValueError(f"max_rows ({max_rows}) and prefill_tokens ({prefill_tokens}) must be >= 0 (0 = "
                             f"no limit)")
        self.model = model.eval()
        self.max_rows, self.prefill_tokens = max_rows, prefill_tokens
        self.tokenizer = tokenizer
        self._version = int(version)
        self._eos = _eos_ids(model, tokenizer)
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self._eos)
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.2x names the KV cache `cache`; older releases and remote code `past_key_values`.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._kv_reusable = plain_dynamic_cache(model)

    @property
    def version(self) -> int:
        """Version of the weights currently loaded; stamped on every token sampled with them."""
        return self._version

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self._eos)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Replace the weights and advance the version (to ``version``, default ``self.version + 1``).

        Every parameter must be present except tied copies (e.g. ``lm_head.weight`` tied to the input
        embedding). ``version`` must be larger than the current one, so a token's version always names
        one set of weights.
        """
        new_version = self._version + 1 if version is None else int(version)
        if new_version <= self._version:
            raise ValueError(
                f"version must increase: engine is at {self._version}, got {new_version}; "
                "pass the trainer's step count after the update (or omit it for version + 1)"
            )
        result = self.model.load_state_dict(dict(state_dict), strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise KeyError(
                f"state_dict does not match the engine's model: missing {missing[:5]}, unexpected "
                f"{result.unexpected_keys[:5]}; publish the full policy state_dict()"
            )
        self._version = new_version

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        config: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        max_new_tokens: Sequence[int] | None = None,
        stop_strings: Sequence[tuple[str, ...]] | None = None,
        prefix_kv: Sequence[PrefixKV | None] | None = None,
        return_kv: bool = False,
        refresh: Callable[[], bool] | None = None,
        chunk_tokens: int = 0,
    ) -> list[Generation]:
        """Sample a continuation of every prompt, all rows in one batch.

        Args:
            prompts: token ids per row (non-empty; no padding).
            config: sampling settings.
            seeds: one seed per row: row i's draws come from ``torch.Generator().manual_seed(seeds[i])``
                and do not depend on the rest of the batch. Otherwise all draws come from ``generator``
                (or torch's global RNG when it is None).
            max_new_tokens: per-row budgets overriding ``config.max_new_tokens`` (each >= 1).
            stop_strings: per-row stop strings overriding ``config.stop_strings``.
            prefix_kv: per row, keys/values of a prefix of its prompt from an earlier call (None: feed
                the whole prompt). Entries from other weight versions are ignored. The result is the
                same as without them, up to float rounding.
            return_kv: attach each row's :class:`PrefixKV` to its Generation (when the model's cache
                allows it).
            refresh: run before the prefill and every ``chunk_tokens`` decode steps; True when it
                called :meth:`load_weights` (module docstring). None: one version for the whole call.
            chunk_tokens: decode steps between two refreshes (0: only the one before the prefill).

        Returns:
            One :class:`Generation` per prompt, in order.
        """
        n = len(prompts)
        if n == 0:
            return []
        budgets = self._per_row(max_new_tokens, config.max_new_tokens, n, "max_new_tokens")
        stops = list(stop_strings) if stop_strings is not None else [config.stop_strings] * n
        if len(stops) != n:
            raise ValueError(f"stop_strings has {len(stops)} rows, prompts has {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (e.g. a BOS token)")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        bad = [i for i, p in enumerate(prompts) if min(p) < 0 or max(p) >= vocab]
        if bad:
            raise ValueError(
                f"prompts {bad[:5]} hold token ids outside [0, "
                f"{vocab}): encode them with this engine's tokenizer"
            )
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0 (0 = refresh only before the prefill), got "
                             f"{chunk_tokens}")
        uniforms = self._uniforms(n, max(budgets), seeds, generator)
        if refresh is not None:
            refresh()  # a turn boundary: newer weights, if any, sample this whole call
        rows, prefixes = _Rows(n), self._usable_prefixes(prompts, prefix_kv)
        # Rows in blocks of max_rows, one after another (one block when weights may change mid-call).
        block = n if refresh is not None or self.max_rows == 0 else self.max_rows
        for lo in range(0, n, block):
            self._decode_loop(list(range(lo, min(n, lo + block))), prompts, prefixes, config, budgets, stops,
                              uniforms, rows, return_kv and self._kv_reusable,
                              refresh if chunk_tokens > 0 else None, chunk_tokens)
        return [self._finish_row(rows, i) for i in range(n)]

    def _usable_prefixes(
        self, prompts: Sequence[Sequence[int]], prefix_kv: Sequence[PrefixKV | None] | None
    ) -> list[PrefixKV | None]:
        if prefix_kv is None or not self._kv_reusable:
            return [None] * len(prompts)
        if len(prefix_kv) != len(prompts):
            raise ValueError(f"prefix_kv has {len(prefix_kv)} rows, prompts has {len(prompts)}")
        for i, (prompt, prefix) in enumerate(zip(prompts, prefix_kv, strict=True)):
            if prefix is not None and prefix.length >= len(prompt):
                raise ValueError(
                    f"prefix_kv[{i}] covers {prefix.length} tokens but prompt {i} has {len(prompt)}: "
                    "a prompt must extend its prefix by at least one token"
                )
        return [p if p is not None and p.version == self._version else None for p in prefix_kv]

    @staticmethod
    def _per_row(values: Sequence[int] | None, default: int, n: int, name: str) -> list[int]:
        out = list(values) if values is not None else [default] * n
        if len(out) != n or any(v < 1 for v in out):
            raise ValueError(f"{name} needs {n} values, each >= 1 (got {out})")
        return out

    def _uniforms(
        self, n: int, steps: int, seeds: Sequence[int] | None, generator: torch.Generator | None
    ) -> torch.Tensor:
        """``[n, steps] float64`` draws in [0, 1): row i, step s uses ``u[i, s]``."""
        if seeds is None:
            return torch.rand(n, steps, generator=generator, dtype=torch.float64)
        if len(seeds) != n:
            raise ValueError(f"seeds has {len(seeds)} values, prompts has {n}")
        return torch.stack(
            [torch.rand(steps, generator=torch.Generator().manual_seed(int(s)),
                        dtype=torch.float64) for s in seeds]
        )

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache | None
    ) -> tuple[torch.Tensor, Cache]:
        if cache is None and self._kv_reusable:
            cache = growing_cache()
        kwargs = {self._cache_kw: cache} if cache is not None else {}
        out = self.model(
            input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=True, logits_to_keep=1,
            **kwargs
        )
        new_cache = out["cache"] if "cache" in out else out["past_key_values"]
        return out.logits[:, -1], new_cache

    def _prefill(
        self, prompts: Sequence[Sequence[int]], prefixes: list[PrefixKV | None]
    ) -> tuple[torch.Tensor, Cache, torch.Tensor, torch.Tensor]:
        """Feed every row's uncached tokens. Layout of row i: [pad | its cached prefix | pad | suffix].

        Returns:
            last logits ``[B, V]``, the cache, the attention mask ``[B, cache length]`` and the
            position of the next token ``[B, 1]``.
        """
        cached = [p.length if p is not None else 0 for p in prefixes]
        suffixes = [list(p[c:]) for p, c in zip(prompts, cached, strict=True)]
        width_c, width_s = max(cached), max(len(x) for x in suffixes)
        ids = torch.full((len(prompts), width_s), self._pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width_c + width_s), dtype=torch.bool)
        for i, (c, suffix) in enumerate(zip(cached, suffixes, strict=True)):
            ids[i, width_s - len(suffix) :] = torch.as_tensor(suffix, dtype=torch.long)
            mask[i, width_c - c : width_c] = True
            mask[i, width_c + width_s - len(suffix) :] = True
        ids, mask = ids.to(self._device), mask.to(self._device)
        pos = position_ids_from_mask(mask)[:, width_c:]
        prefix_cache = self._batch_cache(prefixes, width_c) if width_c else None
        step = self._prefill_rows(width_s)
        if step >= len(prompts) or not self._kv_reusable:
            logits, cache = self._forward(ids, mask, pos, prefix_cache)
            return logits, cache, mask, pos[:, -1:] + 1
        parts = []
        for lo in range(0, len(prompts), step):
            rows = slice(lo, lo + step)
            part = rows_of(prefix_cache, rows) if prefix_cache is not None else None
            parts.append(self._forward(ids[rows], mask[rows], pos[rows], part))
        return torch.cat([x for x, _ in parts]), stacked([c for _, c in parts]), mask, pos[:, -1:] + 1

    def _prefill_rows(self, width: int) -> int:
        """Rows fed per prefill forward: ``prefill_tokens // width`` (at least one), or every row when 0."""
        return max(1, self.prefill_tokens // width) if self.prefill_tokens > 0 else sys.maxsize

    def _batch_cache(self, prefixes: list[PrefixKV | None], width: int) -> Cache:
        """Left-pad the rows' cached keys/values to ``width`` and stack them into one cache."""
        first = next(p for p in prefixes if p is not None)
        layers = []
        for layer, (k0, v0) in enumerate(first.layers):
            keys = k0.new_zeros(len(prefixes), k0.shape[0], width, k0.shape[-1])
            values = v0.new_zeros(len(prefixes), v0.shape[0], width, v0.shape[-1])
            for i, p in enumerate(prefixes):
                if p is not None:
                    keys[i, :, width - p.length :], values[i, :, width - p.length :] = p.layers[layer]
            layers.append((keys, values))
        return growing_cache(layers)

    def _row_kv(self, cache: Cache, mask: torch.Tensor, b: int) -> PrefixKV:
        """Batch row b's keys/values at its real (unmasked) positions."""
        real = mask[b]
        layers = tuple((keys[b][:, real], values[b][:, real]) for keys, values in plain_kv(cache))
        return PrefixKV(version=self._version, length=int(real.sum()), layers=layers)

    def _decode_loop(
        self,
        members: list[int],
        prompts: Sequence[Sequence[int]],
        prefixes: list[PrefixKV | None],
        config: SamplingConfig,
        budgets: list[int],
        stops: list[tuple[str, ...]],
        uniforms: torch.Tensor,
        rows: _Rows,
        return_kv: bool,
        refresh: Callable[[], bool] | None,
        chunk_tokens: int,
    ) -> None:
        """Prefill rows ``members`` as one left-padded batch, then one token per step for the rows still
        active; every ``chunk_tokens`` steps ``refresh`` may swap the weights (the active rows are then
        prefilled again)."""
        logits, cache, mask, next_pos = self._prefill([prompts[i] for i in members],
                                                      [prefixes[i] for i in members])
        active = list(members)  # original row index of each batch row
        for step in range(max(budgets[i] for i in members)):
            if refresh is not None and step > 0 and step % chunk_tokens == 0 and refresh():
                # New weights: recompute every running row's keys/values with them (module docstring).
                fed = [list(prompts[i]) + rows.ids[i] for i in active]
                logits, cache, mask, next_pos = self._prefill(fed, [None] * len(active))
            logp = truncated_logprobs(logits, temperature=config.temperature, top_k=config.top_k,
                                      top_p=config.top_p)
            u = uniforms[active, step].to(self._device)
            tokens = sample_inverse_cdf(logp, u)
            token_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            keep = []
            for b, (i, token, lp) in enumerate(zip(active, tokens.tolist(), token_logp.tolist(),
                                                   strict=True)):
                rows.ids[i].append(token)
                rows.logp[i].append(lp)
                rows.versions[i].append(self._version)
                if not self._row_done(rows, i, budgets[i], stops[i], config):
                    keep.append(b)
                elif return_kv:
                    rows.kv[i] = self._row_kv(cache, mask, b)
            if not keep:
                return
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self._device)
                cache.batch_select_indices(index)
                tokens, mask, next_pos = tokens[index], mask[index], next_pos[index]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            logits, cache = self._forward(tokens.unsqueeze(-1), mask, next_pos, cache)
            next_pos = next_pos + 1

    def _row_done(self, rows: _Rows, i: int, budget: int, stops: tuple[str, ...],
                  config: SamplingConfig) -> bool:
        """Whether row i is finished after its latest token; records the reason."""
        token_ids = rows.ids[i]
        if token_ids[-1] in self._eos and not config.ignore_eos:
            rows.finish[i] = FinishReason.EOS
            return True
        if (found := self.completed_stop(token_ids, stops)) is not None:
            rows.finish[i], rows.stop[i], rows.stop_end[i] = FinishReason.STOP, *found
            return True
        if len(token_ids) >= budget:
            rows.finish[i] = FinishReason.LENGTH
            return True
        return False

    def completed_stop(self, token_ids: list[int], stops: tuple[str, ...]) -> tuple[str, int] | None:
        """The first of ``stops`` that the last of ``token_ids`` (a turn's tokens so far) completes, and where
        it ends in their text; None when it completes none. The rule that ends a row, also for replays."""
        if not stops:
            return None
        # A stop string of c characters spans at most c tokens (+ a few for merged/partial bytes). It is
        # looked for anywhere in that tail, not only at its end: a token may complete it and run on (a BPE
        # piece ">\n"), and since every token is checked, one found now was completed now.
        tail = self._decode(token_ids[-(max(len(s) for s in stops) + 4) :])
        stop = next((s for s in stops if s in tail), None)
        return None if stop is None else (stop, self._stop_end(token_ids, stop))

    def _stop_end(self, token_ids: list[int], stop: str) -> int:
        """Where in the row's text the stop string the last token completed ends: its first occurrence
        that reaches into that token's characters (the last occurrence if decoding is not prefix-stable)."""
        text, before = self._decode(token_ids), self._decode(token_ids[:-1])
        start = text.find(stop, max(0, len(before) - len(stop) + 1)) if text.startswith(before) else -1
        return (start if start >= 0 else text.rfind(stop)) + len(stop)

    def _decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        assert isinstance(text, str)
        return text

    def _finish_row(self, rows: _Rows, i: int) -> Generation:
        token_ids = rows.ids[i]
        text_ids = token_ids[:-1] if rows.finish[i] is FinishReason.EOS else token_ids
        return Generation(
            token_ids=torch.tensor(token_ids, dtype=torch.long),
            logp=torch.tensor(rows.logp[i], dtype=torch.float32),
            versions=torch.tensor(rows.versions[i], dtype=torch.long),
            text=self._decode(text_ids),
            finish=rows.finish[i],
            stop_string=rows.stop[i],
            stop_end=rows.stop_end[i],
            kv=rows.kv[i],
        )


class _Rows:
    """Per-row accumulators of one generate call."""

    def __init__(self, n: int) -> None:
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.logp: list[list[float]] = [[] for _ in range(n)]
        self.versions: list[list[int]] = [[] for _ in range(n)]
        self.finish: list[FinishReason] = [FinishReason.LENGTH] * n
        self.stop: list[str | None] = [None] * n
        self.stop_end: list[int | None] = [None] * n
        self.kv: list[PrefixKV | None] = [None] * n
