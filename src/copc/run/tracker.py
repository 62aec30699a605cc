"""The writer of a run's metrics: ``metrics.jsonl`` (the record), mirrored to TensorBoard and, with
``wandb=true``, to Weights & Biases; rendered episodes to ``samples.jsonl`` and TensorBoard's text tab.
Metric names are :mod:`copc.tracking`'s one namespace (unknown names warn, or fail with ``strict``)."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

import torch

from copc.config import ConfigError
from copc.tracking import SAMPLES_FILE, TENSORBOARD_DIR, is_known, read_metrics

__all__ = ["MetricsMirror", "Tracker", "histogram_record"]


class SummaryWriterLike(Protocol):
    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...
    def add_histogram(self, tag: str, values: torch.Tensor, global_step: int) -> None: ...
    def add_text(self, tag: str, text_string: str, global_step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class Tracker:
    """Appends one JSON line per :meth:`log` call to ``run_dir/metrics.jsonl`` and mirrors to TensorBoard.

    Args:
        run_dir: the run directory (created if needed).
        tensorboard: mirror scalars to ``run_dir/tb`` (skipped with a warning if unavailable).
        strict: raise on a metric name not in the namespace (default: warn once per name).
        resume_step: when resuming from the checkpoint of this step, drop records with ``step >=
            resume_step`` first (they belong to steps the resumed run will redo), then append.
        keep_resume_evaluation: keep the evaluation records of ``resume_step`` itself (the final
            evaluation of an earlier process that finished there: a run continued past it keeps it).
        mirror: a :class:`MetricsMirror` that gets every record's finite scalars too (Weights & Biases:
            ``wandb=true``), finished when the tracker closes; metrics.jsonl stays the record.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        tensorboard: bool = True,
        strict: bool = False,
        resume_step: int | None = None,
        keep_resume_evaluation: bool = False,
        mirror: MetricsMirror | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.strict = strict
        self._warned: set[str] = set()
        self.samples_path = self.run_dir / SAMPLES_FILE
        if resume_step is not None:
            for path in (self.path, self.samples_path):
                if path.exists():
                    _truncate_from(path, resume_step, keep_evaluation=keep_resume_evaluation)
        self._file: IO[str] | None = self.path.open("a")
        # TensorBoard hides what the steps redone after a resume logged before, as metrics.jsonl drops them
        # above; the kept final evaluation at resume_step is purged with them and written again from the
        # files.
        self._tb: SummaryWriterLike | None = self._open_tensorboard(resume_step) if tensorboard else None
        if resume_step is not None and keep_resume_evaluation:
            self._rewrite_tensorboard(resume_step)
        self._mirror = mirror

    def _rewrite_tensorboard(self, step: int) -> None:
        """TensorBoard's scalars and sample text of the records kept at ``step`` (a finished run's final
        evaluation), which the purge at ``step`` removed."""
        if self._tb is None:
            return
        with _naming(self._tb_file()):
            for record in (r for r in read_metrics(self.path) if int(r.get("step", -1)) == step):
                for name, value in record.items():
                    if name not in ("step", "time") and isinstance(value,
                                                                   int | float) and math.isfinite(value):
                        self._tb.add_scalar(name, float(value), step)
            if self.samples_path.exists():
                kept = [r for r in read_metrics(self.samples_path) if int(r.get("step", -1)) == step]
                if kept:
                    self._tb.add_text("samples/eval", "\n\n---\n\n".join(_markdown(e) for e in kept), step)
            self._tb.flush()

    def _open_tensorboard(self, purge_step: int | None) -> SummaryWriterLike | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # tensorboard is a core dependency, but keep JSONL working without it
            warnings.warn(f"TensorBoard mirror off ({err}); metrics.jsonl is still written", stacklevel=3)
            return None
        log_dir = str(self.run_dir / TENSORBOARD_DIR)
        if os.path.lexists(log_dir) and not os.path.isdir(log_dir):
            raise ConfigError(f"{log_dir} is not a folder (TensorBoard's events go there): move it away, "
                              "then run the same command again")
        return SummaryWriter(log_dir=log_dir, purge_step=purge_step)  # type: ignore[no-any-return]

    def _check(self, name: str) -> None:
        if is_known(name):
            return
        message = (
            f"metric {name!r} is not in copc.tracking.METRICS; add it there with a one-line "
            "doc (one namespace, defined once)"
        )
        if self.strict:
            raise KeyError(message)
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(message, stacklevel=3)

    def log(
        self,
        step: int,
        metrics: Mapping[str, float | int | bool | torch.Tensor],
        *,
        histograms: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
    ) -> dict[str, float]:
        """Write one record for ``step``; returns it. Tensors must be scalars (``.item()`` happens here,
        never in the losses). Histograms go to TensorBoard; JSONL keeps :func:`histogram_record` of them."""
        if self._file is None:
            raise RuntimeError("Tracker is closed")
        record: dict[str, float] = {}
        for name, value in metrics.items():
            self._check(name)
            record[name] = _scalar(name, value)
        line: dict[str, object] = {"step": int(step), "time": time.time(), **record}
        for name, values in (histograms or {}).items():
            self._check(name)
            tensor = torch.as_tensor(values).detach().flatten().cpu()
            line[name] = histogram_record(tensor)
            if self._tb is not None and tensor.numel() > 0:
                self._tb.add_histogram(name, tensor.double(), int(step))
        with _naming(self.path):
            self._file.write(json.dumps(line, allow_nan=True) + "\n")
            self._file.flush()
        if self._tb is not None:
            with _naming(self._tb_file()):
                for name, value in record.items():
                    if math.isfinite(value):
                        self._tb.add_scalar(name, value, int(step))
                self._tb.flush()
        if self._mirror is not None:
            self._mirror.log({k: v for k, v in record.items() if math.isfinite(v)}, step=int(step))
        return record

    def _tb_file(self) -> Path:
        """The TensorBoard event file being written (its directory where the writer hides it)."""
        name = getattr(getattr(getattr(self._tb, "file_writer", None), "event_writer", None), "_file_name",
                       None)
        return Path(name) if isinstance(name, str) else self.run_dir / TENSORBOARD_DIR

    def log_samples(self, step: int, source: str, episodes: Sequence[Mapping[str, object]], *,
                    final: bool | None = None) -> None:
        """Append rendered episodes (:func:`copc.rollout.samples.render_episode`) of ``step`` to
        ``samples.jsonl``, tagged with ``source`` (``train``, ``eval``) and, for evaluations, ``final`` (the
        run's final evaluation, or one made during training), and to TensorBoard's text tab."""
        if not episodes:
            return
        tags: dict[str, object] = {"step": int(step), "source": source}
        if final is not None:
            tags["final"] = final
        with _naming(self.samples_path), self.samples_path.open("a") as out:
            for episode in episodes:
                out.write(json.dumps({**tags, **episode}) + "\n")
        if self._tb is not None:
            with _naming(self._tb_file()):
                self._tb.add_text(f"samples/{source}", "\n\n---\n\n".join(_markdown(e) for e in episodes),
                                  int(step))
                self._tb.flush()

    def records(self) -> Iterator[dict[str, float]]:
        """Records written so far (re-read from disk)."""
        return iter(read_metrics(self.path))

    def close(self) -> None:
        file, tb, self._file = self._file, self._tb, None
        mirror, self._mirror = self._mirror, None
        if mirror is not None:
            mirror.finish()
        try:
            if file is not None:
                with _naming(self.path):
                    file.close()
        finally:
            if tb is not None:
                with _naming(self._tb_file()):
                    self._tb = None
                    tb.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class MetricsMirror(Protocol):
    """Another place a :class:`Tracker` copies every record's scalars to (a ``wandb`` run:
    :class:`copc.run.wandb_mirror.WandbMirror`)."""

    def log(self, data: dict[str, float], step: int) -> None: ...
    def finish(self) -> None: ...


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Give an ``OSError`` raised while writing ``path`` that file's name: a failed ``write`` (a full disk)
    carries none, and TensorBoard's writer thread re-raises its error without one."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or str(err), str(path)) from None


def _truncate_from(path: Path, step: int, *, keep_evaluation: bool = False) -> None:
    """Keep only the JSON lines of ``path`` whose ``step`` is below ``step`` and, with ``keep_evaluation``,
    the evaluation records of ``step`` itself (atomic replace)."""
    kept = [r for r in read_metrics(path) if int(r.get("step", -1)) < step
            or (keep_evaluation and int(r.get("step", -1)) == step and _is_evaluation(r))]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as handle:
        for record in kept:
            handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _is_evaluation(record: Mapping[str, object]) -> bool:
    """A record of a final evaluation alone: a sample of ``source`` eval not made during training (a sample
    written before the ``final`` tag existed counts as final), or metrics that are all ``eval/`` (an
    evaluation during training shares its step's record)."""
    if "source" in record:
        return record["source"] == "eval" and record.get("final", True) is not False
    names = [k for k in record if k not in ("step", "time")]
    return bool(names) and all(k.startswith("eval/") for k in names)


def _markdown(episode: Mapping[str, object]) -> str:
    """One rendered episode as TensorBoard markdown: the prompt, each piece (policy / forced) as code."""
    lines = [f"**{episode.get('prompt_id', '')}**: reward {episode.get('reward')}, stop "
             f"{episode.get('stop_reason')}",
             "", "prompt:", "", "    " + str(episode.get("prompt", "")).replace("\n", "\n    ")]
    for turn in episode.get("turns", []) or []:  # type: ignore[attr-defined]
        lines += ["", f"{turn['source']}:", "", "    " + str(turn["text"]).replace("\n", "\n    ")]
    return "\n".join(lines)


def histogram_record(values: torch.Tensor) -> dict[str, object]:
    """Compact JSONL form of a histogram's values ``[N]``: for small non-negative integers (staleness)
    the exact counts ``{"counts": [c_0, c_1, ...]}`` (``c_k`` = number of values equal to k); otherwise
    ``{"n", "min", "max", "mean"}``."""
    if values.numel() == 0:
        return {"counts": []}
    integral = not values.is_floating_point() or bool((values == values.round()).all())
    if integral and int(values.min()) >= 0 and int(values.max()) < 100_000:
        return {"counts": torch.bincount(values.long()).tolist()}
    as_double = values.double()
    return {
        "n": int(values.numel()),
        "min": float(as_double.min()),
        "max": float(as_double.max()),
        "mean": float(as_double.mean()),
    }


def _scalar(name: str, value: float | int | bool | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().item())
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")
