"""copc.models."""
