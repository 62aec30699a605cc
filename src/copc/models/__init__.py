"""copc.models: the tiny local model and tokenizer, any HF causal LM as policy, the value model."""

from copc.models.hf import TokenLogProbs, ValueModel, load_policy, position_ids_from_mask, token_logprobs
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer, tiny_config

__all__ = [
    "TokenLogProbs",
    "ValueModel",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "load_policy",
    "position_ids_from_mask",
    "tiny_config",
    "token_logprobs",
]
