"""copc.trainer."""
