"""copc.rollout."""
