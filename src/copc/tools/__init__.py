"""copc.tools."""
