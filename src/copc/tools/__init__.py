"""copc.tools: the Python sandbox and the BM25 retriever that the agentic tasks call."""

from copc.tools.retriever import BM25Retriever, Hit
from copc.tools.sandbox import (
    PythonSandbox,
    SandboxConfig,
    SandboxResult,
    active_protections,
    format_observation,
)

__all__ = [
    "BM25Retriever",
    "Hit",
    "PythonSandbox",
    "SandboxConfig",
    "SandboxResult",
    "active_protections",
    "format_observation",
]
