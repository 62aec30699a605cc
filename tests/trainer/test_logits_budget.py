"""The trainer cuts a micro-batch whose vocabulary-sized logits would pass ``LOGITS_BUDGET`` into pieces of
fewer rows (issue 35, item 1: a 135M model with a 49152-token vocabulary peaked at 17.5 GB, most of it
[16, 600, 49152] float32 logits and their log-softmax temporaries), and the step's update is the same."""

from __future__ import annotations

import torch
from tests.trainer.test_trainer import TOKENIZER, make_trainer, params, synthetic_trajectories

import copc.trainer.forwards as forwards
from copc.trainer.batching import collate
from copc.trainer.forwards import LOGITS_BUDGET, Forwards


def _batch(rows: int, length: int):
    class _Batch:  # only what pieces() reads
        attention_mask = torch.ones(rows, length, dtype=torch.bool)

    return _Batch()


def test_pieces_keep_the_logits_within_the_budget_and_cover_every_row_once() -> None:
    # SmolLM2's vocabulary, rows of 600 tokens: 2^26 // (600 * 49152) = 2 rows a piece (236 MB of logits);
    # the tiny model's (113 ids) is never cut.
    fwd = Forwards(1.0, 0, 1.0, micro_batch_size=16, vocab_size=49152)
    index = torch.arange(20)
    pieces = fwd.pieces(_batch(20, 600), index)  # type: ignore[arg-type]
    assert [len(p) for p in pieces] == [2] * 10
    assert torch.equal(torch.cat(pieces), index)
    assert all(len(p) * 600 * 49152 <= LOGITS_BUDGET for p in pieces)
    tiny = Forwards(1.0, 0, 1.0, micro_batch_size=16, vocab_size=113)
    assert [len(p) for p in tiny.pieces(_batch(20, 4000), index)] == [16, 4]  # type: ignore[arg-type]
    huge = Forwards(1.0, 0, 1.0, micro_batch_size=4, vocab_size=10**9)  # one row over budget: still one row
    assert [len(p) for p in huge.pieces(_batch(3, 10), torch.arange(3))] == [1, 1,
                                                                             1]  # type: ignore[arg-type]


def test_a_step_cut_by_the_budget_makes_the_same_update(monkeypatch) -> None:
    trainer_a = make_trainer("copc", micro_batch_size=8)
    batch = collate(synthetic_trajectories(trainer_a.policy, seed=3), pad_id=TOKENIZER.pad_token_id)
    metrics_a = trainer_a.step(batch)
    monkeypatch.setattr(forwards, "LOGITS_BUDGET", 2 * batch.input_ids.shape[1] * 113)  # two rows a piece
    trainer_b = make_trainer("copc", micro_batch_size=8)
    assert [len(p) for p in trainer_b.fwd.pieces(batch, torch.arange(batch.batch_size))] == [2] * 4
    metrics_b = trainer_b.step(batch)
    # float32 sums over other groupings: equal to summation order (~1e-7 relative)
    for name, value in params(trainer_a.policy).items():
        torch.testing.assert_close(value, params(trainer_b.policy)[name], rtol=1e-5, atol=1e-6)
    assert abs(metrics_a["loss/policy"] - metrics_b["loss/policy"]) < 1e-5
