"""The stall watchdog: a run whose step or evaluation never ends is stopped, not left waiting forever.

Env steps (graders, tools, a user's environment) run inside the trainer process with the sync driver and
in every evaluation. A grader that never returns (one seen in a real run:
``Fraction("1537640e412537443412")``, a power of ten with 4e11 digits) would hold a run for ever at full CPU.
:class:`StallWatchdog` bounds each *phase* of a run (one training step, one evaluation) by ``seconds``; when a
phase outlasts it the process ends with :data:`STALL_EXIT_CODE`. Checkpoints already written are untouched, so
the run continues with ``resume=true`` once what hung is fixed.

Two stages, because a hang can hold the GIL:

1. a Python thread prints one line (the phase, the limit, how to continue), every thread's stack
   (:func:`faulthandler.dump_traceback`), and calls ``os._exit(STALL_EXIT_CODE)``;
2. ``backstop_s`` later, :func:`faulthandler.dump_traceback_later` (a C thread, which runs even while a
   C call holds the GIL, as a big-integer power does and no Python thread then can) prints
   ``Timeout (h:mm:ss)!`` and the stacks, and exits with status 1.

Waits that have their own bound are not phases: the async driver's wait for a batch is bounded by
``driver.batch_timeout_s`` (the worker is restarted), so the loop disarms the watchdog while it waits;
with that limit off (0) the watchdog bounds the wait too.
Only one watchdog may be armed per process (faulthandler's timer is process-wide).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

__all__ = ["STALL_EXIT_CODE", "StallWatchdog"]

#: Exit status of a process the watchdog stopped (the convention of coreutils' ``timeout``).
STALL_EXIT_CODE = 124
#: Seconds after the limit at which faulthandler's C timer ends the process if the Python thread could not.
BACKSTOP_S = 60.0
#: The stacks go to file descriptor 2 itself (``sys.stderr`` may be a capture without a descriptor).
_STDERR_FD = 2


class StallWatchdog:
    """Ends the process when one phase lasts longer than ``seconds`` (module docstring); 0 = never.

    Use :meth:`phase` around each phase; phases nest (an evaluation inside a step), and leaving an inner
    one re-arms the outer one with a fresh limit. :meth:`close` disarms for good.
    """

    def __init__(self, seconds: float, *, resume_hint: str = "", backstop_s: float = BACKSTOP_S) -> None:
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"stall_timeout_s must be finite and >= 0 (0 = no limit), got {seconds!r}")
        self.seconds, self.resume_hint, self.backstop_s = float(seconds), resume_hint, float(backstop_s)
        self._phases: list[str] = []
        self._deadline: float | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Arm for ``name`` for the block; on leaving, re-arm for the enclosing phase (or disarm)."""
        self._phases.append(name)
        self._arm()
        try:
            yield
        finally:
            self._phases.pop()
            self._arm()

    def paused(self) -> AbstractContextManager[None]:
        """Disarm for the block (a wait bounded elsewhere); re-arm the current phase afterwards. An unnamed
        phase is one with no limit."""
        return self.phase("")

    def close(self) -> None:
        """Disarm and stop the thread (idempotent)."""
        self._phases.clear()
        self._arm()
        with self._wake:
            self._closed = True
            self._wake.notify()

    # --------------------------------------------------------------------------------------- inner
    def _arm(self) -> None:
        if not self.enabled:
            return
        current = self._phases[-1] if self._phases else ""
        with self._wake:
            self._deadline = time.monotonic() + self.seconds if current else None
            if self._thread is None and current:
                self._thread = threading.Thread(target=self._watch, name="copc-stall-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()
        if current:
            faulthandler.dump_traceback_later(self.seconds + self.backstop_s, exit=True, file=_STDERR_FD)
        else:
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                if self._deadline is None:
                    self._wake.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                self._fire(self._phases[-1] if self._phases else "?")

    def _fire(self, phase: str) -> None:
        hint = f" once what hangs is fixed: {self.resume_hint}" if self.resume_hint else ""
        print(f"error: {phase} did not end within {self.seconds:.0f} s (stall_timeout_s): stopping the "
              f"process; the stack of every thread follows. Checkpoints already written are kept; "
              f"continue{hint}, or raise stall_timeout_s "
              "(0 = no limit) if the phase is just slow", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=_STDERR_FD, all_threads=True)
        os._exit(STALL_EXIT_CODE)
