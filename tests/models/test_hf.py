"""Policy loading, token log-probs and the value model, checked against per-prefix forwards (oracle)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from copc.models.hf import (
    EXCLUDED_LOGPROB,
    ValueModel,
    load_policy,
    position_ids_from_mask,
    token_logprobs,
)
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.sampling import truncated_logprobs

# fp32 forwards of the same prefix batched/padded vs alone differ by summation order only: ~1e-6.
ATOL = 2e-5


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, seed=1)


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    return ids, mask


def _right_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return ids, mask


def _oracle_logprobs(model, row: list[int], temperature: float) -> list[float]:
    """log pi(x_t | x_<t) by one separate forward per prefix (no batching, no padding)."""
    out = [0.0]
    with torch.no_grad():
        for t in range(1, len(row)):
            logits = model(torch.tensor([row[:t]])).logits[0, -1].float() / temperature
            out.append(float(torch.log_softmax(logits, -1)[row[t]]))
    return out


ROWS_TEXT = ["<python>print(2+2)</python>", "hi", "a\nb<answer>7</answer>"]


def test_position_ids_skip_padding() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("pad", [_left_pad, _right_pad])
def test_token_logprobs_match_per_prefix_oracle(model, tok, temperature, pad) -> None:
    rows = [tok.encode(t) for t in ROWS_TEXT]
    ids, mask = pad(rows, tok.pad_token_id)
    with torch.no_grad():
        logp = token_logprobs(model, ids, mask, temperature=temperature).logp
    assert logp.dtype == torch.float32 and logp.shape == ids.shape
    for b, row in enumerate(rows):
        got = logp[b][mask[b]].tolist()
        torch.testing.assert_close(torch.tensor(got), torch.tensor(_oracle_logprobs(model, row, temperature)),
                                   atol=ATOL, rtol=0)
        assert got[0] == 0.0


def test_token_logprobs_has_gradients_and_checks_input(model, tok) -> None:
    ids, mask = _left_pad([tok.encode("abc")], tok.pad_token_id)
    token_logprobs(model, ids, mask).logp[:, 1:].sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, mask, temperature=0.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        token_logprobs(model, ids[0], mask[0])


def test_truncated_transform_and_entropy(model, tok) -> None:
    # The trainer's log-probs under the sampler's top-p transform: the picked entry of
    # truncated_logprobs(l_{t-1}); tokens outside the nucleus get EXCLUDED_LOGPROB (finite), no NaN in
    # the gradient; the entropy is over the kept tokens; asking for the entropy leaves the log-probs
    # bit for bit as they are without it (with and without a transform).
    rows = [tok.encode(t) for t in ROWS_TEXT]
    ids, mask = _right_pad(rows, tok.pad_token_id)
    transform = partial(truncated_logprobs, temperature=0.8, top_k=0, top_p=0.5)
    logp = token_logprobs(model, ids, mask, transform=transform).logp
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(),
                       position_ids=position_ids_from_mask(mask)).logits.float()
    full = transform(logits[:, :-1])  # [B, T-1, V]
    want = full.gather(-1, ids[:, 1:, None]).squeeze(-1)
    has_prefix = mask[:, 1:] & mask[:, :-1]
    excluded = has_prefix & ~torch.isfinite(want)
    kept = has_prefix & torch.isfinite(want)
    assert excluded.any() and kept.any()  # a near-uniform random model: half the vocabulary is out
    torch.testing.assert_close(logp[:, 1:][kept], want[kept], atol=ATOL, rtol=0)
    assert bool((logp[:, 1:][excluded] == EXCLUDED_LOGPROB).all())
    assert token_logprobs(model, ids, mask, transform=transform).entropy is None
    logp_e, entropy = token_logprobs(model, ids, mask, transform=transform, entropy=True)
    assert entropy is not None and torch.equal(logp_e.detach(), logp.detach())
    (logp_e[:, 1:][kept].sum() + entropy.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    probs = full.exp()
    want_h = -torch.where(torch.isfinite(full), probs * full, 0.0).sum(-1)
    torch.testing.assert_close(entropy[:, 1:][has_prefix], want_h[has_prefix], atol=ATOL, rtol=0)
    with torch.no_grad():
        plain = token_logprobs(model, ids, mask, temperature=0.7)
        both = token_logprobs(model, ids, mask, temperature=0.7, entropy=True)
    assert plain.entropy is None and both.entropy is not None
    assert torch.equal(plain.logp, both.logp)
    with pytest.raises(ValueError, match="give the temperature to the transform"):
        token_logprobs(model, ids, mask, temperature=0.5, transform=transform)


def test_value_alignment_is_state_before_token(model, tok) -> None:
    critic = ValueModel.from_policy(model, head_init_std=0.5)
    rows = [tok.encode(t) for t in ROWS_TEXT]
    ids, mask = _left_pad(rows, tok.pad_token_id)
    with torch.no_grad():
        values = critic(ids, mask)
        raw = critic(ids, mask, shift=False)
        for b, row in enumerate(rows):
            got = values[b][mask[b]]
            assert got[0] == 0.0
            for t in range(1, len(row)):
                # V(s_t): the head at the last position of the prefix x_<t, computed alone.
                prefix = torch.tensor([row[:t]])
                alone = critic(prefix, torch.ones_like(prefix, dtype=torch.bool), shift=False)[0, -1]
                torch.testing.assert_close(got[t], alone, atol=ATOL, rtol=0)
            torch.testing.assert_close(raw[b][mask[b]][:-1], got[1:], atol=0, rtol=0)
    assert values.dtype == torch.float32


def test_value_model_starts_from_policy_weights_and_is_independent(model) -> None:
    critic = ValueModel.from_policy(model)
    assert torch.equal(critic.backbone.embed_tokens.weight, model.model.embed_tokens.weight)
    assert critic.backbone.embed_tokens.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert critic.head.weight.abs().max() < 0.01 and critic.head.bias.abs().max() == 0


def test_value_model_save_load_round_trip(model, tok, tmp_path: Path) -> None:
    critic = ValueModel.from_policy(model, head_init_std=0.3)
    critic.save_pretrained(tmp_path / "critic")
    loaded = ValueModel.from_pretrained(tmp_path / "critic")
    ids, mask = _left_pad([tok.encode(t) for t in ROWS_TEXT], tok.pad_token_id)
    with torch.no_grad():
        assert torch.equal(critic(ids, mask), loaded(ids, mask))


def test_load_policy_and_critic_from_policy_checkpoint(model, tok, tmp_path: Path) -> None:
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policy, tokenizer = load_policy(tmp_path)
    assert tokenizer.encode("<answer>") == tok.encode("<answer>")
    ids, mask = _left_pad([tok.encode(t) for t in ROWS_TEXT], tok.pad_token_id)
    with torch.no_grad():
        assert torch.equal(policy(ids, attention_mask=mask.long()).logits,
                           model(ids, attention_mask=mask.long()).logits)
    critic = ValueModel.from_pretrained(tmp_path)  # no value head saved: fresh head, policy backbone
    assert torch.equal(critic.backbone.embed_tokens.weight, model.model.embed_tokens.weight)
    with pytest.raises(OSError, match="save_pretrained"):
        load_policy(tmp_path / "missing")
