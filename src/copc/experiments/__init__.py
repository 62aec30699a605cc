"""copc.experiments."""
