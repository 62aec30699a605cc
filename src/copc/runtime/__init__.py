"""copc.runtime."""
