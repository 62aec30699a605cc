"""A tiny, download-free causal LM and character-level tokenizer for tests and the embedded default.

The model is a real Hugging Face ``Qwen3ForCausalLM`` (about 0.45M parameters with the defaults), built
from a config in code; the tokenizer is a real ``PreTrainedTokenizerFast`` (``tokenizers`` WordLevel model
over single characters). Both go through ``save_pretrained`` / ``from_pretrained`` like any HF checkpoint,
so everything downstream (engine, trainer, checkpoints) treats them exactly like a large model.

Vocabulary (ids in this order, so they are stable across runs and machines):

- ``0 <pad>``, ``1 <bos>``, ``2 <eos>``, ``3 <unk>``;
- newline, tab, and the 95 printable ASCII characters ``' '`` .. ``'~'``, one token each;
- each of :data:`TAG_TOKENS` (``<python>``, ``</answer>`` ...) as one added token, so a tool
  call or an answer opens and closes on a single sampled token.

Encoding with ``add_special_tokens=True`` (the default) prepends ``<bos>``; observations inserted by the
episode loop are encoded with ``add_special_tokens=False``. Characters outside the vocabulary map to
``<unk>``. Decoding concatenates characters (no spaces are added or cleaned up), so
``decode(encode(s, add_special_tokens=False)) == s`` for any string over the vocabulary.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
#: Newline, tab, then printable ASCII from space to tilde.
CHARACTERS: tuple[str, ...] = ("\n", "\t", *(chr(c) for c in range(32, 127)))

#: Default size of the tiny model: ~0.45M parameters, fast enough for RL on one CPU core.
DEFAULT_SIZE: dict[str, int] = {
    "hidden_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 256,
    "max_position_embeddings": 2048,
}


#: Markup tags the tiny tokenizer makes one token each (the tags of the built-in and dataset-backed tasks,
#: checked in tests/tasks), so a tool call or an answer starts and stops on one sampled token.
TAG_TOKENS: tuple[str, ...] = (
    "<python>",
    "</python>",
    "<output>",
    "</output>",
    "<answer>",
    "</answer>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
    "<think>",
    "</think>",
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: specials, one token per character, each task tag as one token.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``pad/bos/eos/unk`` set, padding side left (for batched
        generation), and ``len(tokenizer) == 4 + 97 + len(TAG_TOKENS)`` (113 with the default tags).
    """
    assert not set(string.printable) - set(CHARACTERS) - {"\r", "\x0b", "\x0c"}
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every single character (newline included: [\s\S] matches any character) becomes its own piece.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    # Tags are ordinary (non-special) added tokens: they decode to their text and are never skipped.
    tokenizer.add_tokens(list(TAG_TOKENS))
    return tokenizer


def tiny_config(tokenizer: PreTrainedTokenizerFast, **size_overrides: int) -> Qwen3Config:
    """Qwen3 config sized by :data:`DEFAULT_SIZE` (override any key, e.g. ``num_hidden_layers=2``).

    Embeddings are tied to the output layer; head dim = hidden / heads; special ids from the tokenizer.
    """
    unknown = set(size_overrides) - set(DEFAULT_SIZE)
    if unknown:
        raise ValueError(f"unknown tiny-model size keys {sorted(unknown)}; "
                         f"valid keys: {sorted(DEFAULT_SIZE)}")
    size = {**DEFAULT_SIZE, **size_overrides}
    if size["hidden_size"] % size["num_attention_heads"]:
        raise ValueError(
            f"hidden_size={size['hidden_size']} must be divisible by "
            f"num_attention_heads={size['num_attention_heads']}"
        )
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=size["hidden_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"],
        num_key_value_heads=size["num_key_value_heads"],
        intermediate_size=size["intermediate_size"],
        max_position_embeddings=size["max_position_embeddings"],
        head_dim=size["hidden_size"] // size["num_attention_heads"],
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0,
                     **size_overrides: int) -> PreTrainedModel:
    """A freshly initialised tiny ``Qwen3ForCausalLM`` (float32, eval mode), deterministic in ``seed``.

    The global torch RNG is left as it was: initialisation runs under ``torch.random.fork_rng``.
    """
    config = tiny_config(tokenizer, **size_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.eval()
