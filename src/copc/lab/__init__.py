"""copc.lab."""
