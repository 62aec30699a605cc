"""copc.rollout: the generation engine and the multi-turn episode loop."""

from copc.rollout.engine import Engine, FinishReason, Generation, PrefixKV
from copc.rollout.episode import run_episodes
from copc.rollout.sampling import SamplingConfig, sample_inverse_cdf, truncated_logprobs

__all__ = [
    "Engine",
    "FinishReason",
    "Generation",
    "PrefixKV",
    "SamplingConfig",
    "run_episodes",
    "sample_inverse_cdf",
    "truncated_logprobs",
]
