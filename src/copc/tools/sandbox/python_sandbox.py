"""``PythonSandbox``: the public face of the sandbox. It refuses to start without the protections its
config requires, then hands each run to a :class:`~copc.tools.sandbox.runner.Runner`."""

from __future__ import annotations

import os
import threading

from copc.tools.sandbox.config import SandboxConfig, SandboxResult
from copc.tools.sandbox.protections import active_protections, require_protections
from copc.tools.sandbox.runner import Runner


class PythonSandbox:
    """Runs model-written Python code under the limits of a :class:`SandboxConfig`. Thread-safe.

    Raises :class:`~copc.tools.sandbox.config.SandboxUnavailable` (one line naming what is missing and
    the opt-out) when a protection the config requires is not in force on this machine. The fork
    server starts on the first run and is restarted if it dies.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        require_protections(self.config)
        self._runner = Runner(self.config)

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as a script; never raises for anything the code does; returns by ``timeout_s + 1``
        after a slot came free (the wait for one is at most ``timeout_s``)."""
        return self._runner.run(code)

    def active_protections(self) -> dict[str, bool]:
        """Which protections are in force for this config on this machine (probed once, cached)."""
        return active_protections(self.config)

    def uids(self) -> list[int]:
        """The uids leased to this sandbox's runs (empty before the first run)."""
        return self._runner.uids()

    def server_cpu_s(self) -> float:
        """CPU seconds used by the fork server and every run so far. ``RUSAGE_CHILDREN`` of the caller
        does not see them (the server is a child that does not exit): add this to measure tool CPU."""
        return self._runner.server_cpu_s()

    def close(self) -> None:
        """End the fork server, release the uids and cgroups (also done at process exit)."""
        self._runner.close()


_SHARED: dict[tuple[int, SandboxConfig], PythonSandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(config: SandboxConfig) -> PythonSandbox:
    """One sandbox per config and process, for callers that make many short-lived tools (one per
    episode): they share its warm fork server and its slots instead of starting one each."""
    key = (os.getpid(), config)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = PythonSandbox(config)
        return _SHARED[key]
