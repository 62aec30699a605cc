"""copc: asynchronous RL post-training of language models that stays correct on stale rollouts."""

__version__ = "0.1.0"
