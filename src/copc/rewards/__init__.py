"""copc.rewards."""
