"""The tiny model and tokenizer: real HF objects, saved and loaded offline, tags as single tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from copc.models.tiny import (
    CHARACTERS,
    DEFAULT_SIZE,
    TAG_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_config,
)

TEXT = "Compute 17*23.\n<python>print(17*23)</python>\n<output>391\n</output><answer>391</answer>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_vocab_layout(tokenizer) -> None:
    # 4 specials + newline + tab + 95 printable ASCII + one token per tag.
    assert len(tokenizer) == 4 + 2 + 95 + len(TAG_TOKENS)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "left"
    assert len(CHARACTERS) == len(set(CHARACTERS)) == 97


def test_tags_are_single_tokens(tokenizer) -> None:
    for tag in TAG_TOKENS:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        assert tokenizer.decode(ids) == tag
    # A tag glued to text is still one token, and the characters around it stay single characters.
    ids = tokenizer.encode("a<python>b", add_special_tokens=False)
    assert len(ids) == 3


def test_round_trip_with_tags(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # 6 tags, every other character one token each.
    n_tag_chars = sum(TEXT.count(tag) * len(tag) for tag in TAG_TOKENS)
    n_tags = sum(TEXT.count(tag) for tag in TAG_TOKENS)
    assert len(ids) == len(TEXT) - n_tag_chars + n_tags
    assert tokenizer.decode(ids) == TEXT
    with_bos = tokenizer.encode(TEXT)
    assert with_bos[0] == tokenizer.bos_token_id and with_bos[1:] == ids
    # Concatenating separately encoded pieces equals encoding the whole when the cut is not inside a tag
    # (the episode loop appends observations encoded on their own).
    half = TEXT.index("<output>") - 1
    pieces = tokenizer.encode(TEXT[:half], add_special_tokens=False) + tokenizer.encode(
        TEXT[half:], add_special_tokens=False
    )
    assert pieces == ids


def test_unknown_characters_map_to_unk(tokenizer) -> None:
    assert tokenizer.encode("é", add_special_tokens=False) == [tokenizer.unk_token_id]


def test_parameter_count_in_range(tokenizer) -> None:
    model = build_tiny_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 <= n_params <= 700_000, n_params
    assert model.config.vocab_size == len(tokenizer)
    small = build_tiny_model(tokenizer, num_hidden_layers=2)
    assert sum(p.numel() for p in small.parameters()) < n_params


def test_seed_determines_weights(tokenizer) -> None:
    a, b, c = (build_tiny_model(tokenizer, seed=s) for s in (0, 0, 1))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_bad_size_override_says_what_is_valid(tokenizer) -> None:
    with pytest.raises(ValueError, match="valid keys"):
        tiny_config(tokenizer, hidden=3)
    with pytest.raises(ValueError, match="divisible"):
        tiny_config(tokenizer, hidden_size=90, num_attention_heads=4)
    assert set(DEFAULT_SIZE) <= set(tiny_config(tokenizer).to_dict())


def test_save_load_round_trip_gives_identical_logits(tokenizer, tmp_path: Path) -> None:
    model = build_tiny_model(tokenizer, seed=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded_tok.encode(TEXT) == tokenizer.encode(TEXT)
    assert loaded_tok.decode(loaded_tok.encode(TEXT, add_special_tokens=False)) == TEXT
    ids = torch.tensor([tokenizer.encode(TEXT)])
    with torch.no_grad():
        # Same weights, same code, same input: bit-identical.
        assert torch.equal(model(ids).logits, loaded(ids).logits)
