"""copc.tools.sandbox: a jailed Python sandbox for model-written code (``docs/sandbox.md``).

- :mod:`.config`: ``SandboxConfig``, ``SandboxResult`` (with its ``fault``), ``PROTECTIONS``,
  ``format_observation``;
- :mod:`.python_sandbox`: ``PythonSandbox`` (fails closed);
- :mod:`.protections`: the probe, ``active_protections``, ``require_protections``, ``write_protections``;
- :mod:`.runner`: running one request and classifying how it ended; :mod:`.pool`: the fork server's
  host side; :mod:`.forkserver`: the program inside the jail; :mod:`.jail`: bwrap and seccomp;
  :mod:`.cgroups`: whole-tree limits; :mod:`.identity`: machine-wide uid leases.
"""

from copc.tools.sandbox.config import (
    ALLOW_MISSING_ENV,
    PROTECTIONS,
    Fault,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
    allow_missing_from_env,
    format_observation,
)
from copc.tools.sandbox.protections import active_protections, require_protections, write_protections
from copc.tools.sandbox.python_sandbox import PythonSandbox, shared_sandbox

__all__ = [
    "ALLOW_MISSING_ENV",
    "PROTECTIONS",
    "Fault",
    "PythonSandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "active_protections",
    "allow_missing_from_env",
    "format_observation",
    "require_protections",
    "shared_sandbox",
    "write_protections",
]
