"""Atomic, lossless checkpoints: a checkpoint is either complete on disk or invisible to a resume.

Layout under ``run_dir/checkpoints/``::

    step_00000012/         a complete checkpoint
        state.pt           the payload (torch.save of plain data and tensors)
        trainer.policy.safetensors   each :class:`Weights` in the payload, one file per key path
        meta.json          step, sizes and sha256 of every file; written last
    latest                 one line: the name of the newest complete checkpoint
    .tmp-step_.../         a checkpoint being written (ignored, removed by the next save)

Protocol of :func:`save_checkpoint` (one writer per run directory):

1. write every file into a fresh ``.tmp-*`` directory, ``fsync`` each file and the directory;
2. ``os.replace`` the temp directory to ``step_XXXXXXXX`` (atomic on POSIX), ``fsync`` the parent;
3. only then replace ``latest`` atomically (temp file, fsync, ``os.replace``);
4. delete checkpoints older than the last ``keep``, and any of a step after the one just written (an
   abandoned timeline after a resume from an older checkpoint); each is renamed to a ``.tmp-`` name
   first, so a deletion cut short never leaves a partial ``step_*`` directory.

A SIGKILL at any moment leaves either the previous state or the new one. A write that fails (disk
full, permissions) removes its temp directory and raises :class:`CheckpointError` with one line
(``no space left on device at PATH``); the previous checkpoint and ``latest`` are untouched.
:func:`load_latest` follows ``latest`` and verifies the checkpoint's ``meta.json`` (sizes and hashes); if the
pointer is missing, corrupt or points at something invalid, it falls back to the newest ``step_*`` directory
that verifies, and says so through ``on_skip`` (each skipped checkpoint with its reason).

The payload is what the trainer wants back: policy and critic state dicts, optimizer states, RNG
states (:func:`capture_rng_state`), step, version, the buffer's ``state_dict()`` (stored trajectories
and prompts in flight) and the resolved config as plain data. It must be loadable with
``torch.load(weights_only=True)``: tensors, str, int, float, bool, None, lists, tuples and dicts.
A state dict wrapped in :class:`~copc.trainer.weight_files.Weights` (the trainer's policy and critic, the
async driver's weight versions) is written as a safetensors file of its own instead, named by its key path in
the payload (``trainer.policy.safetensors``): the weights load without torch's pickle, by any safetensors
reader, and tied tensors (an embedding shared with the LM head) are stored once and tied again on load.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from copc.trainer.weight_files import WeightFiles, join_weights, split_weights, write_weights

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt (the message names the path and what failed)."""


def checkpoint_root(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_meta(directory: Path, step: int) -> None:
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != META_FILE
    }
    meta = {"step": step, "format": 1, "files": files}
    meta_path = directory / META_FILE
    meta_path.write_text(json.dumps(meta, indent=1))
    _fsync_file(meta_path)


def _remove_tmp_dirs(root: Path) -> None:
    for path in root.glob(".tmp-*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def save_checkpoint(
    run_dir: str | os.PathLike[str], step: int, payload: Mapping[str, object], *, keep: int = 3
) -> Path:
    """Write ``payload`` as the checkpoint of ``step`` atomically; returns its directory.

    Args:
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``).
        step: the trainer step the payload resumes from (the directory is ``step_{step:08d}``).
        payload: plain data and tensors (see the module docstring); ``step`` is added to it.
        keep: how many of the newest checkpoints to keep (>= 1).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the checkpoint just written is always kept), got {keep}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    check_plain(payload)
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_tmp_dirs(root)  # leftovers of a killed writer: never loaded, safe to delete
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        weights = WeightFiles()
        state = split_weights(payload, (), weights)
        for file_name, tensors in weights.files.items():
            write_weights(tensors, tmp / file_name)
        _save_state({**state, "step": step}, tmp / STATE_FILE)  # type: ignore[dict-item]
        _write_meta(tmp, step)
        _fsync_dir(tmp)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        where = Path(err.filename) if err.filename else tmp
        reason = f"no space left on device at {where}" if err.errno == errno.ENOSPC else (
            f"cannot write {where}: {err.strerror or err}")
        previous = list_checkpoints(run_dir)
        kept = f"; the previous checkpoint {step_dir_name(previous[-1])} is intact" if previous else ""
        raise CheckpointError(f"checkpoint of step {step} not saved: {reason}{kept}") from None
    final = root / name
    replaced = None
    if final.exists():  # re-saving a step after a resume: move the old one out of the way first
        replaced = root / f".tmp-old-{name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, replaced)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_latest(root, name)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    _prune(root, keep, current=step)
    return final


class _RecordingFile:
    """A file torch.save writes through, keeping the OSError that torch turns into an opaque RuntimeError."""

    def __init__(self, handle: object) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)  # type: ignore[attr-defined,no-any-return]
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.handle.flush()  # type: ignore[attr-defined]


def _save_state(payload: Mapping[str, object], path: Path) -> None:
    """``torch.save`` to ``path`` and ``fsync``; a failed write raises the OSError itself (with the path)."""
    with path.open("wb") as handle:
        writer = _RecordingFile(handle)
        try:
            torch.save(dict(payload), writer)  # type: ignore[arg-type]
            handle.flush()
            os.fsync(handle.fileno())
        except RuntimeError:
            if writer.error is not None:
                raise OSError(writer.error.errno, writer.error.strerror, str(path)) from None
            raise
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(path)) from None


_PLAIN_LEAVES = (
    torch.Tensor,
    str,
    bytes,
    bool,
    int,
    float,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
)


def check_plain(value: object, where: str = "payload") -> None:
    """Raise CheckpointError unless ``value`` is plain data ``torch.load(weights_only=True)`` reads back
    (tensors, numbers, strings, None, and lists/tuples/dicts of those), naming the offending key."""
    if isinstance(value, _PLAIN_LEAVES):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(
                    f"{where} has a key {key!r} of type {type(key).__name__}; use str or int keys"
                )
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    hint = (
        "convert it to a tensor" if isinstance(value, np.ndarray) else "save its state_dict() or plain data"
    )
    raise CheckpointError(f"{where} is a {type(value).__module__}.{type(value).__name__}; {hint}")


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".tmp-latest-{uuid.uuid4().hex[:8]}"
    tmp.write_text(name + "\n")
    _fsync_file(tmp)
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _prune(root: Path, keep: int, current: int) -> None:
    """Keep the ``keep`` newest checkpoints up to ``current``. Checkpoints of steps after ``current``
    belong to a timeline the run abandoned (it resumed from an older one), so they go too: a later
    fallback in :func:`load_latest` must never jump back into that discarded future."""
    steps = sorted(list_checkpoints(root.parent), reverse=True)
    past = [s for s in steps if s <= current]
    doomed_steps = [s for s in steps if s > current] + [s for s in past[keep:] if s != current]
    for step in doomed_steps:
        path = root / step_dir_name(step)
        doomed = root / f".tmp-del-{path.name}-{uuid.uuid4().hex[:8]}"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[int]:
    """Steps of the ``step_*`` directories present (complete by construction; not verified here)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP_RE.match(path.name)
        if match and path.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


def verify_checkpoint(path: str | os.PathLike[str]) -> int:
    """Check ``meta.json`` against the files (sizes and sha256); returns the step or raises
    CheckpointError."""
    path = Path(path)
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {path} has no valid {META_FILE} ({err}); it is incomplete"
        ) from None
    if STATE_FILE not in files:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} does not list {STATE_FILE}")
    for name, info in files.items():
        file_path = path / name
        if not file_path.is_file() or file_path.stat().st_size != info["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} is missing or has the wrong size")
        if _sha256(file_path) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its sha256 (corrupt)")
    return step


def load_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> dict[str, object]:
    """Load the payload of one checkpoint directory (``torch.load(weights_only=True)``).

    Raises:
        CheckpointError: the directory is incomplete or corrupt, or the payload holds objects that
            ``weights_only`` refuses (save plain data: state dicts, lists, dicts, numbers, strings).
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    try:
        payload = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as err:  # a corrupt file can fail in pickle, zipfile or torch: all mean "unusable"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"cannot load {path / STATE_FILE}: {first}") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path / STATE_FILE} does not hold a dict payload")
    try:
        return join_weights(payload, path)  # type: ignore[return-value]
    except Exception as err:  # a weights file missing or unreadable: the checkpoint is unusable
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"cannot load the weights files of {path}: {first}") from None


def load_latest(
    run_dir: str | os.PathLike[str], *, on_skip: Callable[[str], None] | None = None
) -> tuple[int, dict[str, object]] | None:
    """``(step, payload)`` of the newest complete checkpoint of ``run_dir``, or None if there is none.

    Follows the ``latest`` pointer; falls back to the newest ``step_*`` directory that verifies when the
    pointer is missing, unreadable or points at an invalid checkpoint, calling ``on_skip`` with the
    reason of each checkpoint passed over. Temp directories are ignored.
    """
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    candidates: list[Path] = []
    try:
        name = (root / LATEST).read_text().strip()
        if _STEP_RE.match(name):
            candidates.append(root / name)
    except OSError:
        pass
    candidates += [root / step_dir_name(s) for s in sorted(list_checkpoints(run_dir), reverse=True)]
    seen: set[Path] = set()
    for path in candidates:
        if path in seen:
            continue
        seen.add(path)
        try:
            step = verify_checkpoint(path)
            return step, load_checkpoint(path, verify=False)
        except CheckpointError as err:
            if on_skip is not None:
                on_skip(str(err))
            continue
    return None


# ------------------------------------------------------------------------------------ RNG states
def capture_rng_state() -> dict[str, object]:
    """RNG states of python ``random``, numpy's global generator and torch (CPU, and CUDA if present),
    as plain data that ``torch.load(weights_only=True)`` accepts."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, object] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, object]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    py = state["python"]
    assert isinstance(py, Mapping)
    internal = py["internal"]
    assert isinstance(internal, (list, tuple))
    random.setstate((py["version"], tuple(int(x) for x in internal), py["gauss"]))
    npy = state["numpy"]
    assert isinstance(npy, Mapping)
    keys = npy["keys"]
    assert isinstance(keys, torch.Tensor)
    np.random.set_state(
        (
            str(npy["name"]),
            keys.numpy().astype(np.uint32),
            int(npy["pos"]),  # type: ignore[call-overload]
            int(npy["has_gauss"]),  # type: ignore[call-overload]
            float(npy["gauss"]),  # type: ignore[arg-type]
        )
    )
    torch_state = state["torch"]
    assert isinstance(torch_state, torch.Tensor)
    torch.set_rng_state(torch_state)
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)  # type: ignore[arg-type]
