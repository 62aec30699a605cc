"""copc.models: the tiny local model and tokenizer, any HF causal LM as policy, the value model."""

from copc.models.tiny import build_tiny_model, build_tiny_tokenizer, tiny_config

__all__ = ["build_tiny_model", "build_tiny_tokenizer", "tiny_config"]
