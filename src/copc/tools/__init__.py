"""copc.tools: the Python sandbox and the BM25 retriever that the agentic tasks call."""

from copc.tools.sandbox import (
    PythonSandbox,
    SandboxConfig,
    SandboxResult,
    active_protections,
    format_observation,
)

__all__ = [
    "PythonSandbox",
    "SandboxConfig",
    "SandboxResult",
    "active_protections",
    "format_observation",
]
