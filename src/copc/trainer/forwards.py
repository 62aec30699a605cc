"""The trainer's forwards: token log-probs under the sampler's transform and critic values, micro-batch by
micro-batch over right-padded rows (each micro-batch trimmed to its longest row).

Notation as in :mod:`copc.trainer.trainer`: ``B`` rows, ``T`` the batch's padded length, ``b`` / ``t``
those of one micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
from torch import nn

from copc.models.hf import LogProbTransform, TokenLogProbs, token_logprobs
from copc.rollout.sampling import truncated_logprobs
from copc.trainer.batching import TrainBatch, micro_batches
from copc.trainer.common import trim_length

__all__ = ["LOGITS_BUDGET", "Forwards", "RowsFn"]

#: Most elements ``b * t * V`` of one forward's vocabulary-sized logits. A micro-batch whose logits would
#: exceed it is cut into pieces of fewer rows: the float32 logits and their log-softmax temporaries are the
#: trainer's largest tensors with a real vocabulary (SmolLM2: V = 49152; 16 rows x 600 tokens = 1.9 GB
#: each), and gradients are accumulated over pieces with the minibatch's global denominators, so the
#: step computes the same update. 2^26 elements = 256 MB of float32; a tiny model is never cut.
LOGITS_BUDGET = 1 << 26

#: ``fn(batch, rows)``: a per-token quantity ``[len(rows), t]`` of the rows ``rows`` (``[b] int64``).
RowsFn = Callable[[TrainBatch, torch.Tensor], torch.Tensor]
K = TypeVar("K")


@dataclass(frozen=True)
class Forwards:
    """The sampler's transform (``temperature``, ``top_k``, ``top_p``), the micro-batch size and whether
    micro-batches are cut after sorting rows by length (``trainer.micro_batch_by_length``)."""

    temperature: float
    top_k: int
    top_p: float
    micro_batch_size: int
    by_length: bool = False
    #: the policy's vocabulary size V (0: no cut by :data:`LOGITS_BUDGET`).
    vocab_size: int = 0

    def pieces(self, batch: TrainBatch, index: torch.Tensor) -> list[torch.Tensor]:
        """The micro-batches of the rows ``index`` (:func:`~copc.trainer.batching.micro_batches`), each cut
        further so that its logits stay within :data:`LOGITS_BUDGET`; every loop over one set of rows cuts
        it here, so a forward kept by its rows is found again."""
        lengths = batch.attention_mask.sum(dim=-1) if self.by_length else None
        out: list[torch.Tensor] = []
        for rows in micro_batches(index, self.micro_batch_size, lengths):
            per_row = trim_length(rows, batch.attention_mask) * self.vocab_size
            fit = max(1, LOGITS_BUDGET // per_row) if per_row else len(rows)
            out.extend(rows[i: i + fit] for i in range(0, len(rows), fit))
        return out

    def transform(self) -> tuple[float, LogProbTransform | None]:
        """``(temperature, transform)`` for the log-prob helpers: the sampler's own distribution (temperature
        only without top-k / top-p, else the engine's ``truncated_logprobs``), so ``w = old / mu`` is 1 at
        staleness 0 (docs/algorithms.md, "Sampling transform")."""
        if self.top_p >= 1.0 and self.top_k == 0:
            return self.temperature, None
        return 1.0, partial(truncated_logprobs, temperature=self.temperature, top_k=self.top_k,
                            top_p=self.top_p)

    def logp(self, model: nn.Module, batch: TrainBatch, index: torch.Tensor) -> torch.Tensor:
        """``[b, t] float32`` log-probs of the rows ``index`` (gradients flow unless under no_grad)."""
        return self.logp_entropy(model, batch, index, entropy=False).logp

    def logp_entropy(self, model: nn.Module, batch: TrainBatch, rows: torch.Tensor, *,
                     entropy: bool) -> TokenLogProbs:
        """Log-probs (with grad) and, when ``entropy``, per-token entropies ``[b, t] float32`` (one
        forward)."""
        length = trim_length(rows, batch.attention_mask)
        temperature, transform = self.transform()
        return token_logprobs(
            model,  # type: ignore[arg-type]  # any causal LM module; typed as PreTrainedModel upstream
            batch.input_ids[rows, :length],
            batch.attention_mask[rows, :length],
            temperature=temperature,
            transform=transform,
            entropy=entropy,
        )

    def values(self, critic: nn.Module, batch: TrainBatch, index: torch.Tensor) -> torch.Tensor:
        """``[b, t] float32`` values ``V(s_t)`` of the rows ``index``."""
        length = trim_length(index, batch.attention_mask)
        values = critic(batch.input_ids[index, :length], batch.attention_mask[index, :length])
        return values  # type: ignore[no-any-return]

    def logp_of(self, model: nn.Module) -> RowsFn:
        """:meth:`logp` of ``model`` as a :data:`RowsFn`."""
        return lambda b, r: self.logp(model, b, r)

    def keep_first(
        self, fn: Callable[[TrainBatch, torch.Tensor], tuple[K, torch.Tensor]], batch: TrainBatch,
        first: torch.Tensor, out: torch.Tensor,
    ) -> tuple[dict[tuple[int, ...], K], torch.Tensor]:
        """Forwards kept for the step's first update: ``fn(batch, rows) = (kept, value)`` run with grad over
        the rows ``first``, micro-batch by micro-batch, ``value`` written (detached) into ``out``. Returns
        the kept objects by their rows and the rows not in ``first`` (for :meth:`full`)."""
        kept: dict[tuple[int, ...], K] = {}
        for rows in self.pieces(batch, first):
            keep, value = fn(batch, rows)
            kept[tuple(rows.tolist())] = keep
            out[rows, : value.shape[1]] = value.detach().float()
        every = torch.arange(batch.batch_size)
        return kept, every[~torch.isin(every, first)]

    @torch.no_grad()
    def full(self, fn: RowsFn, batch: TrainBatch, index: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``fn(batch, rows)`` micro-batch by micro-batch over ``index`` (default: every row) and stitch
        a ``[B, T] float32`` result (into ``out`` when given)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32) if out is None else out
        index = torch.arange(batch.batch_size) if index is None else index
        for rows in self.pieces(batch, index):
            piece = fn(batch, rows)
            out[rows, : piece.shape[1]] = piece.float()
        return out

    @torch.no_grad()
    def last_values(self, critic: nn.Module, batch: TrainBatch) -> torch.Tensor:
        """``[B] float32``: V of the state after each row's last token (the head's unshifted output at the
        last real position; ``truncation = bootstrap``)."""
        last = batch.attention_mask.sum(dim=-1) - 1
        out = torch.zeros(batch.batch_size, dtype=torch.float32)
        for rows in self.pieces(batch, torch.arange(batch.batch_size)):
            length = trim_length(rows, batch.attention_mask)
            raw = critic(batch.input_ids[rows, :length], batch.attention_mask[rows, :length], shift=False)
            out[rows] = raw.float().gather(1, last[rows, None]).squeeze(1)
        return out
