"""copc.eval."""
