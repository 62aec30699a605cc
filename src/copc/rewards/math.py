"""Maths rewards: extract the final answer, check it against the gold with math-verify.

Reward = 1.0 when the last final answer in the response is mathematically equal to the gold answer
(``math_verify.verify``, which compares with sympy: ``\\frac{1}{2} == 0.5``, ``(x+1)^2 == x^2+2x+1``),
else 0.0. No format bonus (spec ``tasks.md``: binary correctness).

sympy can hang on degenerate answers (``9^{9^{9^{9}}}`` never finishes). math-verify's own timeout uses
``signal.alarm``, which breaks under threads, asyncio and Ray (STYLE.md, point 11), so it is switched
off and the check runs in a persistent worker *process* instead: the caller waits on a pipe with a
timeout and, when it passes, kills the worker and starts a fresh one.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Literal

RewardReason = Literal["correct", "wrong", "no_answer", "timeout", "error"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Test hook: a gold answer equal to this makes the worker sleep (only when the verifier allows it),
# so the timeout path can be tested without relying on sympy's speed.
SLEEP_HOOK_PREFIX = "__copc_test_sleep__:"


@dataclass(frozen=True)
class RewardResult:
    """The reward of one response and why it got it."""

    reward: float
    #: "correct" | "wrong" | "no_answer" | "timeout" | "error"
    reason: RewardReason
    #: The final answer found in the response (None when there is none).
    extracted: str | None


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """(end position, content) of every ``\\boxed{...}`` with balanced braces; unclosed ones are skipped."""
    spans: list[tuple[int, str]] = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                spans.append((i + 1, text[start:i]))
                break
    return spans


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last ``\\boxed{...}`` or ``<answer>...</answer>``, stripped.

    Whichever closes last wins. An answer tag that wraps a box (``<answer>\\boxed{5}</answer>``) gives
    the box's content. Nested braces are kept whole (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``).
    Returns None when there is no complete answer or it is empty.
    """
    candidates = _boxed_spans(text)
    for match in _ANSWER_TAG.finditer(text):
        inner = match.group(1)
        boxed = _boxed_spans(inner)
        candidates.append((match.end(), boxed[-1][1] if boxed else inner))
    if not candidates:
        return None
    answer = max(candidates, key=lambda c: c[0])[1].strip()
    return answer or None


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$|^[+-]?\d+/\d+$")


def _to_fraction(text: str) -> Fraction | None:
    cleaned = text.strip().replace(",", "").replace(" ", "").rstrip(".")
    if cleaned.startswith("$") and cleaned.endswith("$") and len(cleaned) >= 2:
        cleaned = cleaned[1:-1]
    if not _NUMBER.match(cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_equal(pred: str | None, gold: str) -> bool:
    """Exact numeric equality without sympy, for the built-in arithmetic task.

    Both sides are parsed as exact rationals (integers, decimals, ``a/b``, scientific notation;
    thousands separators and surrounding ``$`` ignored): ``"1,000" == "1000.0"``, ``"1/2" == "0.5"``.
    False when either side is not a plain number.
    """
    if pred is None:
        return False
    a, b = _to_fraction(pred), _to_fraction(gold)
    return a is not None and b is not None and a == b


def _as_boxed(answer: str) -> str:
    return answer if "\\boxed" in answer or "$" in answer else f"\\boxed{{{answer}}}"


def _worker_main(conn: Connection, allow_test_hooks: bool) -> None:
    """Worker loop: receive (pred, gold), reply ("ok", bool) or ("error", message). Runs until EOF."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    conn.send(("ready", True))
    while True:
        try:
            pred, gold = conn.recv()
        except EOFError:
            return
        try:
            if allow_test_hooks and gold.startswith(SLEEP_HOOK_PREFIX):
                time.sleep(float(gold[len(SLEEP_HOOK_PREFIX) :]))
                conn.send(("ok", False))
                continue
            gold_parsed = parse(_as_boxed(gold), parsing_timeout=None)  # type: ignore[arg-type]
            pred_parsed = parse(_as_boxed(pred), parsing_timeout=None)  # type: ignore[arg-type]
            conn.send(("ok", bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))))
        except Exception as exc:  # a grader bug must not kill the worker: report it as an error reward
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:300]))


class MathVerifier:
    """Scores responses against gold answers with math-verify in a killable worker process.

    One persistent worker (started lazily, ``spawn`` context so the trainer is never forked) serves the
    calls one at a time; concurrent callers queue on a lock. A check that runs past ``timeout_s`` gets
    reward 0 with reason ``"timeout"``; the worker is killed and the next call starts a fresh one.
    Picklable (only the settings travel; each copy starts its own worker).
    """

    def __init__(self, timeout_s: float = 5.0, *, start_timeout_s: float = 120.0, allow_test_hooks: bool = False):
        if not 0 < timeout_s <= 600:
            raise ValueError(f"MathVerifier: timeout_s={timeout_s} must be in (0, 600] seconds")
        if start_timeout_s <= 0:
            raise ValueError(f"MathVerifier: start_timeout_s={start_timeout_s} must be > 0 seconds")
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.allow_test_hooks = allow_test_hooks
        self._lock = threading.Lock()
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        #: How many workers were killed after a timeout (for metrics).
        self.num_timeouts = 0

    def __getstate__(self) -> dict[str, float | bool]:
        return {"timeout_s": self.timeout_s, "start_timeout_s": self.start_timeout_s,
                "allow_test_hooks": self.allow_test_hooks}

    def __setstate__(self, state: dict[str, float | bool]) -> None:
        self.__init__(  # type: ignore[misc]
            float(state["timeout_s"]),
            start_timeout_s=float(state["start_timeout_s"]),
            allow_test_hooks=bool(state["allow_test_hooks"]),
        )

    def score(self, response_text: str, gold: str) -> RewardResult:
        """Reward 1.0 when the final answer of ``response_text`` equals ``gold``, else 0.0 (with why)."""
        extracted = extract_answer(response_text)
        if extracted is None:
            return RewardResult(0.0, "no_answer", None)
        with self._lock:
            conn = self._ensure_worker()
            conn.send((extracted, gold))
            if not conn.poll(self.timeout_s):
                self.num_timeouts += 1
                self._stop_worker()
                return RewardResult(0.0, "timeout", extracted)
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):  # the worker died (out of memory, killed): replace it next call
                self._stop_worker()
                return RewardResult(0.0, "error", extracted)
        if kind != "ok":
            return RewardResult(0.0, "error", extracted)
        return RewardResult(1.0, "correct", extracted) if value else RewardResult(0.0, "wrong", extracted)

    def _ensure_worker(self) -> Connection:
        if self._proc is not None and self._conn is not None and self._proc.is_alive():
            return self._conn
        self._stop_worker()
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child_conn, self.allow_test_hooks), daemon=True)
        proc.start()
        child_conn.close()
        self._proc, self._conn = proc, parent_conn
        try:
            if not parent_conn.poll(self.start_timeout_s):
                raise TimeoutError(f"no reply within {self.start_timeout_s}s")
            parent_conn.recv()
        except (TimeoutError, EOFError, OSError) as exc:
            self._stop_worker()
            raise RuntimeError(
                f"MathVerifier: the math-verify worker did not start ({exc}); check that math-verify "
                "imports (`python -c 'import math_verify'`) or raise start_timeout_s"
            ) from exc
        return parent_conn

    def _stop_worker(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)
        self._proc, self._conn = None, None

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
        if proc is not None and proc.is_alive():
            proc.kill()
