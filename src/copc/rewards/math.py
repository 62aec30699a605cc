"""Maths rewards: extract the final answer, check it against the gold with math-verify.

Reward = 1.0 when the last final answer in the response is mathematically equal to the gold answer
(``math_verify.verify``, which compares with sympy: ``\\frac{1}{2} == 0.5``, ``(x+1)^2 == x^2+2x+1``),
else 0.0. No format bonus: the reward is binary correctness.

sympy can hang on degenerate answers (``9^{9^{9^{9}}}`` never finishes). math-verify's own timeout uses
``signal.alarm``, which breaks under threads, asyncio and Ray (CONTRIBUTING.md#waiting), so it is switched
off and the check runs in a persistent worker *process* instead (a fresh interpreter, never a fork of
the trainer): the caller waits on a socket pair with a timeout and, when it passes, kills the worker
and starts a fresh one.

Whose fault a check that does not end is: the limit is ``timeout_s`` of the worker's *CPU*. A check
that used it all was sent into a loop by the answer (``9^{9^{9^{9}}}``, a megabyte of digits): the
answer's cost, graded 0 as ``too_costly``, not a grader failure, so a policy cannot make its wrong
answers look undecided. A check that reaches ``WALL_FACTOR * timeout_s`` of wall time without using its
CPU (a starved or stalled worker: the machine's fault) is a ``timeout``, the grader's failure.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Literal

from copc.rewards.qa import answer_tag_span

RewardReason = Literal["correct", "wrong", "no_answer", "too_costly", "timeout", "error"]

#: A check gets ``timeout_s`` of CPU within ``WALL_FACTOR * timeout_s`` of wall time (module docstring).
WALL_FACTOR = 3.0

_BRACE_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")


@dataclass(frozen=True)
class RewardResult:
    """The reward of one response and why it got it."""

    reward: float
    #: "correct" | "wrong" | "no_answer" | "too_costly" (the check used its CPU: the answer's cost) |
    #: "timeout" (the worker got no CPU in time: the grader's failure) | "error"
    reason: RewardReason
    #: The final answer found in the response (None when there is none).
    extracted: str | None


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """(end position, content) of every ``\\boxed{...}`` with balanced braces; unclosed ones are skipped.

    One left-to-right pass over braces with a stack of open boxes (linear time: a degenerate response
    with thousands of unclosed boxes must not cost a quadratic scan).
    """
    spans: list[tuple[int, str]] = []
    open_boxes: list[tuple[int, int]] = []  # (brace depth outside the box, content start)
    depth = 0
    for token in _BRACE_TOKENS.finditer(text):
        if token.group() == "}":
            depth -= 1
            if open_boxes and open_boxes[-1][0] == depth:
                _, start = open_boxes.pop()
                spans.append((token.end(), text[start : token.start()]))
        else:
            if token.group() != "{":
                open_boxes.append((depth, token.end()))
            depth += 1
    return spans  # in order of their closing brace


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last ``\\boxed{...}`` or ``<answer>...</answer>``, stripped.

    Whichever closes last wins. An answer tag that wraps a box (``<answer>\\boxed{5}</answer>``) gives
    the box's content. Nested braces are kept whole (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``).
    Returns None when there is no complete answer or it is empty.
    """
    candidates = _boxed_spans(text)
    tag = answer_tag_span(text)
    if tag is not None:
        boxed = _boxed_spans(tag[1])
        candidates.append((tag[0], boxed[-1][1] if boxed else tag[1]))
    if not candidates:
        return None
    answer = max(candidates, key=lambda c: c[0])[1].strip()
    return answer or None


_DECIMAL = re.compile(r"(?P<sign>[+-]?)(?P<mantissa>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?")
_RATIO = re.compile(r"(?P<sign>[+-]?)(?P<num>\d+)/(?P<den>\d+)")


def _decimal(m: int, e: int) -> tuple[str, int, int]:
    """``m * 10**e`` in its one spelling: ``m`` not a multiple of 10, zero as ``(0, 0)``."""
    if m == 0:
        return ("dec", 0, 0)
    while m % 10 == 0:
        m, e = m // 10, e + 1
    return ("dec", m, e)


_BOXED = re.compile(r"\\boxed\{(?P<inner>[^{}]*)\}")
_UNIT_WORD = re.compile(r"(?P<number>[^\s]+)\s+[A-Za-z]+\.?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def _plain_spelling(text: str) -> str | None:
    """``text`` as a bare number's spelling, or None: a ``\\boxed{}`` wrapper, one trailing unit word
    (``1234 jars``), surrounding or leading ``$`` and a final period are dropped, a Unicode minus is
    ``-``, and commas are read only as thousands separators (``12,345``). Any other comma or inner space
    (``12, 34``, ``12 34``, ``1,5``) is not a number: deleting them graded those as 1234 and 15."""
    cleaned = text.strip().replace("\u2212", "-")
    if boxed := _BOXED.fullmatch(cleaned):
        cleaned = boxed["inner"].strip()
    if unit := _UNIT_WORD.fullmatch(cleaned):
        cleaned = unit["number"]
    cleaned = cleaned.rstrip(".")
    if cleaned.startswith("$"):
        cleaned = cleaned[1:-1] if cleaned.endswith("$") and len(cleaned) >= 2 else cleaned[1:]
    if "," in cleaned:
        if not _THOUSANDS.fullmatch(cleaned):
            return None
        cleaned = cleaned.replace(",", "")
    return None if any(c.isspace() for c in cleaned) else cleaned


def _exact_number(text: str) -> tuple[str, int, int] | None:
    """The exact value of a plain number as a canonical tuple: ``("dec", m, e)`` for ``m * 10**e``
    (every terminating decimal, whether written ``0.125``, ``1.25e-1`` or ``1/8``), ``("frac", p, q)``
    for a reduced ``p/q`` that no decimal equals; ``None`` when ``text`` is not a plain number.

    Equal numbers give equal tuples. No power of ten is ever built from the exponent, so a model's
    ``1e412537443412`` costs what its characters cost (``Fraction`` would compute ``10**412537443412``,
    and an episode's grading would never end). Numbers beyond Python's 4300-digit limit are not numbers.
    """
    cleaned = _plain_spelling(text)
    if cleaned is None:
        return None
    try:
        if ratio := _RATIO.fullmatch(cleaned):
            num, den = int(ratio["num"]), int(ratio["den"])
            if den == 0:
                return None
            value = Fraction(-num if ratio["sign"] == "-" else num, den)
            q, twos, fives = value.denominator, 0, 0
            while q % 2 == 0:
                q, twos = q // 2, twos + 1
            while q % 5 == 0:
                q, fives = q // 5, fives + 1
            if q != 1:
                return ("frac", value.numerator, value.denominator)
            k = max(twos, fives)  # p / (2^a 5^b) = p * 2^(k-a) 5^(k-b) / 10^k
            return _decimal(value.numerator * 2 ** (k - twos) * 5 ** (k - fives), -k)
        if decimal := _DECIMAL.fullmatch(cleaned):
            whole, _, frac = decimal["mantissa"].partition(".")
            m = int(whole + frac or "0")
            return _decimal(-m if decimal["sign"] == "-" else m, int(decimal["exp"] or 0) - len(frac))
    except ValueError:  # more digits than int() takes
        return None
    return None


def numeric_equal(pred: str | None, gold: str) -> bool:
    """Exact numeric equality without sympy, for the built-in arithmetic task.

    Both sides are parsed as exact rationals (integers, decimals, ``a/b``, scientific notation;
    thousands separators and surrounding ``$`` ignored): ``"1,000" == "1000.0"``, ``"1/2" == "0.5"``.
    False when either side is not a plain number. Time is linear in the answer's length, whatever its
    exponent (:func:`_exact_number`).
    """
    if pred is None:
        return False
    a, b = _exact_number(pred), _exact_number(gold)
    return a is not None and a == b


def _as_boxed(answer: str) -> str:
    """``answer`` as math-verify parses it: inside ``\\boxed{}`` unless it is boxed or a ``$...$`` span
    already. An escaped ``\\$`` (MATH's money answers, ``\\$18.90``) is text, not math mode: such an
    answer is boxed too (left bare, math-verify would parse nothing and mark every answer wrong)."""
    return answer if "\\boxed" in answer or "$" in answer.replace("\\$", "") else f"\\boxed{{{answer}}}"


def _worker_main(fd: int) -> None:
    """Worker loop on socket ``fd``: receive (pred, gold), reply ("ok", bool) or ("error", message).

    Runs until the caller closes its end (EOF), so a worker never outlives its :class:`MathVerifier`.
    """
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    conn = Connection(fd)
    conn.send(("ready", True))
    while True:
        try:
            pred, gold = conn.recv()
        except EOFError:
            return
        try:
            gold_parsed = parse(_as_boxed(gold), parsing_timeout=None)  # type: ignore[arg-type]
            pred_parsed = parse(_as_boxed(pred), parsing_timeout=None)  # type: ignore[arg-type]
            conn.send(("ok", bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))))
        except Exception as exc:  # a grader bug must not kill the worker: report it as an error reward
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:300]))


class MathVerifier:
    """Scores responses against gold answers with math-verify in a killable worker process.

    One persistent worker (started lazily, a fresh interpreter: the trainer is never forked) serves the
    calls one at a time; concurrent callers queue on a lock. A check that uses ``timeout_s`` of CPU gets
    reward 0 with reason ``"too_costly"``, one starved of CPU for ``WALL_FACTOR * timeout_s`` reason
    ``"timeout"`` (module docstring); the worker is killed and the next call starts a fresh one.
    Picklable (only the settings travel; each copy starts its own worker).
    """

    def __init__(self, timeout_s: float = 5.0, *, start_timeout_s: float = 120.0):
        if not 0 < timeout_s <= 600:
            raise ValueError(f"MathVerifier: timeout_s={timeout_s} must be in (0, 600] seconds")
        if start_timeout_s <= 0:
            raise ValueError(f"MathVerifier: start_timeout_s={start_timeout_s} must be > 0 seconds")
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._ready = False
        #: How many workers were killed after a timeout (for metrics).
        self.num_timeouts = 0

    def __getstate__(self) -> dict[str, float]:
        return {"timeout_s": self.timeout_s, "start_timeout_s": self.start_timeout_s}

    def __setstate__(self, state: dict[str, float]) -> None:
        self.__init__(  # type: ignore[misc]
            float(state["timeout_s"]), start_timeout_s=float(state["start_timeout_s"]))

    def score(self, response_text: str, gold: str) -> RewardResult:
        """Reward 1.0 when the final answer of ``response_text`` equals ``gold``, else 0.0 (with why)."""
        extracted = extract_answer(response_text)
        if extracted is None:
            return RewardResult(0.0, "no_answer", None)
        with self._lock:
            conn = self._ensure_worker()
            try:
                conn.send((extracted, gold))
            except OSError:  # the worker died since the last call: start a fresh one, once
                self._stop_worker()
                conn = self._ensure_worker()
                conn.send((extracted, gold))
            ended = self._wait(conn)
            if ended is not None:
                self.num_timeouts += 1
                self._stop_worker()
                self._spawn_worker()  # the replacement warms up while the caller goes on
                return RewardResult(0.0, ended, extracted)
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):  # the worker died (out of memory, killed): replace it next call
                self._stop_worker()
                return RewardResult(0.0, "error", extracted)
        if kind != "ok":
            return RewardResult(0.0, "error", extracted)
        return RewardResult(1.0, "correct", extracted) if value else RewardResult(0.0, "wrong", extracted)

    def _wait(self, conn: Connection) -> RewardReason | None:
        """Wait for the worker's reply: None once it is there, ``"too_costly"`` when the check used
        ``timeout_s`` of CPU, ``"timeout"`` when ``WALL_FACTOR * timeout_s`` of wall time passed first (module
        docstring). Without ``/proc`` the CPU is not known and the limit is ``timeout_s`` of wall time."""
        start, cpu_before = time.monotonic(), self._cpu_s()
        if cpu_before is None:
            return None if conn.poll(self.timeout_s) else "timeout"
        while True:
            cpu = self._cpu_s()
            cpu_left = self.timeout_s - (cpu - cpu_before) if cpu is not None else 0.0
            wall_left = WALL_FACTOR * self.timeout_s - (time.monotonic() - start)
            if cpu_left <= 0:
                return "too_costly"
            if wall_left <= 0:
                return "timeout"
            # CPU accrues no faster than wall time, so waiting cpu_left cannot overshoot the CPU limit.
            if conn.poll(max(0.01, min(cpu_left, wall_left))):
                return None

    def _cpu_s(self) -> float | None:
        """CPU seconds (user + system) the worker has used, from ``/proc``; None where it cannot be read."""
        if self._proc is None:
            return None
        try:
            with open(f"/proc/{self._proc.pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def start(self) -> None:
        """Start the worker now and wait until it is ready (otherwise the first ``score`` does it)."""
        with self._lock:
            self._ensure_worker()

    def _spawn_worker(self) -> None:
        """Launch a worker without waiting for it (it imports sympy for ~1-2 s meanwhile)."""
        parent_sock, child_sock = socket.socketpair()
        # A fresh interpreter via subprocess rather than multiprocessing's spawn: spawn re-runs the
        # caller's __main__ (a script without `if __name__ == "__main__":` would fail); this does not.
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
        command = [
            sys.executable,
            "-c",
            "import sys; from copc.rewards.math import _worker_main; _worker_main(int(sys.argv[1]))",
            str(child_sock.fileno()),
        ]
        try:
            self._proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, pass_fds=(child_sock.fileno(),), env=env,
                start_new_session=True
            )
        finally:
            child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._ready = False

    def _ensure_worker(self) -> Connection:
        """A live, ready worker's connection: the current one, or a fresh one (waits for its start)."""
        if self._proc is None or self._conn is None or self._proc.poll() is not None:
            self._stop_worker()
            self._spawn_worker()
        assert self._conn is not None
        if not self._ready:
            try:
                if not self._conn.poll(self.start_timeout_s):
                    raise TimeoutError(f"no reply within {self.start_timeout_s}s")
                self._conn.recv()
            except (TimeoutError, EOFError, OSError) as exc:
                self._stop_worker()
                raise RuntimeError(
                    f"MathVerifier: the math-verify worker did not start ({exc}); check that math-verify "
                    "imports (`python -c 'import math_verify'`) or raise start_timeout_s"
                ) from exc
            self._ready = True
        return self._conn

    def _stop_worker(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
        self._proc, self._conn, self._ready = None, None, False

    def close(self) -> None:
        """Stop the worker (a later ``score`` starts a new one)."""
        with self._lock:
            self._stop_worker()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
