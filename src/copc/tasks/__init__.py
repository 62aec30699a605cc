"""copc.tasks."""
