"""copc.rollout: the generation engine and the multi-turn episode loop."""

from copc.rollout.engine import (
    Engine,
    FinishReason,
    Generation,
    SamplingConfig,
    sample_inverse_cdf,
    truncated_logprobs,
)

__all__ = [
    "Engine",
    "FinishReason",
    "Generation",
    "SamplingConfig",
    "sample_inverse_cdf",
    "truncated_logprobs",
]
