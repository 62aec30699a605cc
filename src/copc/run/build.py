"""Building a run's pieces from its :class:`~copc.run.config.RunConfig`: the policy folder (warm start,
tiny model or an HF folder), the run directory (never reused by accident, and held by one process at a
time), the seeds, the check that every training prompt fits the context, and the driver's batch source.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import yaml
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc.config import ConfigError
from copc.models.hf import ValueModel, load_policy
from copc.rollout.generator import RolloutGenerator
from copc.run.config import RunConfig, resolve_rollout
from copc.runtime.async_local import AsyncSource
from copc.runtime.ray_workers import RayOptions, ray_transport
from copc.runtime.sync import SyncSource
from copc.runtime.workers import TransportFactory, WorkerSpec, local_transport, process_gone
from copc.tasks import Task
from copc.tasks.datasets import DataError
from copc.tools.sandbox import SandboxUnavailable
from copc.trainer.checkpoint import list_checkpoints

__all__ = [
    "RUN_ENTRIES", "build_source", "capped_context_limit", "check_prompts_fit", "check_sandbox",
    "check_writable", "claimed_run_dir",
    "policy_path", "quiet_transformers", "run_dir_holder", "seed_everything",
]

LOCK_NAME = ".lock"
"""The file in a run directory whose exclusive ``flock`` the one process training there holds."""

#: What ``copc train`` writes into a run directory (``overwrite=true`` removes exactly these).
RUN_ENTRIES = (
    "config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "rollouts", "tb", "plots", "tiny_init",
    "sandbox_protections.json",
)


def check_sandbox(task: Task, run_dir: Path) -> None:
    """For a task whose tool runs model-written code: refuse to start (one line) when a required sandbox
    protection is missing, and record the protections in force in ``run_dir/sandbox_protections.json``."""
    config_of = getattr(task, "sandbox_config", None)
    if config_of is None:
        return
    from copc.tools.sandbox import require_protections, write_protections

    config = config_of()
    active = require_protections(config)
    write_protections(run_dir, config)
    print(f"sandbox: {sum(active.values())} protections in force "
          f"({', '.join(k for k, v in active.items() if v)})")


def policy_path(cfg: RunConfig, scratch: Path) -> Path:
    """The HF folder the policy starts from (warm start built and cached on first use)."""
    if cfg.model.policy == "warmstart":
        from copc.run.warmstart import build_warmstart, is_complete, run_warmstart, warmstart_dir

        try:
            req = run_warmstart(cfg.task, task_options=cfg.task_options,
                                sft_overrides=cfg.model.warmstart_sft,
                                seed=cfg.model.warmstart_seed)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        target = warmstart_dir(req.task, seed=req.seed, task_config=req.task_config, sft=req.sft)
        if not is_complete(target):  # it is built there: refuse before minutes of SFT, not after
            check_writable(target.parent, "the warm-start cache",
                           "set COPC_CACHE to a writable directory (default ~/.cache/copc)")
        return Path(build_warmstart(req.task, seed=req.seed, task_config=req.task_config, sft=req.sft))
    if cfg.model.policy == "tiny":
        from copc.models import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer, seed=cfg.model.tiny_seed)
        out = scratch / "tiny_init"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return out
    path = Path(cfg.model.policy)
    if not path.is_dir():
        raise ConfigError(f"model.policy: {cfg.model.policy!r} is not 'warmstart', 'tiny' or an existing HF "
                          f"folder")
    return path


def build_critic(cfg: RunConfig, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> ValueModel:
    """The critic ``model.critic`` names: a copy of the policy's backbone, or a backbone loaded from a
    folder whose vocabulary covers every id of the policy's tokenizer (it reads the policy's tokens)."""
    if cfg.model.critic == "policy":
        return ValueModel.from_policy(policy)
    path = Path(cfg.model.critic)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.critic={cfg.model.critic!r}: no HF model folder there (config.json "
                          "missing); pass a folder written by save_pretrained, or 'policy'")
    critic = ValueModel.from_pretrained(path)
    vocab = int(critic.backbone.config.vocab_size)
    if vocab < len(tokenizer):
        raise ConfigError(f"model.critic={cfg.model.critic!r}: its vocabulary has {vocab} ids but the "
                          f"policy's tokenizer has {len(tokenizer)}; the "
                          "critic must share the policy's tokenizer")
    return critic


@contextmanager
def claimed_run_dir(cfg: RunConfig) -> Iterator[Path]:
    """The run directory, created and held by this process for the block; an existing run there is
    continued (``resume=true``), replaced (``overwrite=true``) or refused (:class:`ConfigError`): a run is
    never overwritten by accident, nor trained by two processes at once (a second claim of a directory
    another process holds is refused, naming that process). The hold is an exclusive ``flock`` on
    ``<run_dir>/.lock``: the kernel drops it when the process ends, however it ends."""
    if cfg.resume and not cfg.run_dir:
        raise ConfigError("resume=true needs run_dir=<the run directory to continue>")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("resume=true and overwrite=true contradict each other: continue the run or replace "
                          "it")
    if cfg.run_dir:
        path = Path(cfg.run_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{stamp}-{cfg.method}-{cfg.task}-s{cfg.staleness.staleness}-seed{cfg.seed}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir {path} is a file, not a directory")
    if cfg.resume and not path.exists():  # a mistyped path must not start a new run where none was asked for
        raise ConfigError(f"resume=true: no run to resume at {path} (no such directory); check the path, or "
                          "drop resume=true to start a new run there")
    created = not path.exists()
    foreign = [name for name in RUN_ENTRIES if (path / name).exists()] if not _made_by_copc(path) else []
    if foreign:  # a folder of the user's whose files share names with a run's: nothing is written there
        raise ConfigError(
            f"run_dir {path} is not a copc run directory (no {LOCK_NAME}, no checkpoint, no copc "
            f"config.yaml) but holds {', '.join(foreign)}, which "
            "a run would write over; choose another run_dir"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:  # a read-only filesystem, no permission: one line, not a traceback
        raise ConfigError(unwritable(path, err, "run_dir",
                                     "give a run_dir on a writable filesystem")) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(_held_message(path, fd)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        existing = [name for name in RUN_ENTRIES if (path / name).exists()]
        if existing and not cfg.resume:
            if not cfg.overwrite:
                raise ConfigError(
                    f"run_dir {path} already holds a run ({', '.join(existing)}); pass resume=true to "
                    "continue it, overwrite=true to replace it, or choose another run_dir"
                )
            for name in existing:
                target = path / name
                shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        fresh = not existing and not cfg.resume
        try:
            yield path
        except (ConfigError, DataError, SandboxUnavailable):
            # An input error found while the run was being built (a prompt too long for the model, a bad
            # row, no sandbox): a fresh run leaves nothing behind, so the corrected command runs as typed.
            if fresh and not list_checkpoints(path):
                _remove_new_run(path, remove_dir=created)
            raise
    finally:
        os.close(fd)  # releases the flock


def _made_by_copc(path: Path) -> bool:
    """Whether ``path`` is a run directory copc made: it holds the ``.lock`` of an accepted claim (a folder
    of the user's is refused before one is created there), a checkpoint, or a ``config.yaml`` whose
    top-level keys are a copc run config's (runs made before ``.lock`` existed)."""
    if (path / LOCK_NAME).exists() or list_checkpoints(path):
        return True
    try:
        saved = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and {"method", "task", "rollout", "trainer"} <= set(saved)


def _remove_new_run(path: Path, *, remove_dir: bool) -> None:
    """Remove what a fresh run wrote into ``path`` (:data:`RUN_ENTRIES`), and ``path`` itself when this run
    created it and nothing else is in it."""
    for name in RUN_ENTRIES:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists() or target.is_symlink():
            target.unlink(missing_ok=True)
    if remove_dir and {p.name for p in path.iterdir()} <= {LOCK_NAME}:
        shutil.rmtree(path, ignore_errors=True)


def unwritable(path: Path, err: OSError, what: str, fix: str) -> str:
    """One line for a directory copc must write into but cannot: which, why (the OS's reason) and ``fix``."""
    return f"{what} {path} is not writable ({err.strerror or err}): {fix}"


def check_writable(path: Path, what: str, fix: str) -> None:
    """Create ``path`` and a file in it (removed at once); :class:`ConfigError` in one line when either fails,
    before any time is spent on what would be written there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".copc-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(unwritable(path, err, what, fix)) from None


def _stored_pid(fd: int) -> int | None:
    """The pid the claimant wrote into the lock file (None if none is there yet)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _lock_holders(lock: Path) -> list[int] | None:
    """Pids of the other processes whose open ``lock`` carries its flock (a ``lock:`` line in
    ``/proc/<pid>/fdinfo/<fd>``: the claimant, and any process that inherited its open file; not a process
    that only has the file open); None where ``/proc`` cannot tell (not Linux)."""
    proc = Path("/proc")
    if not (proc / "self" / "fdinfo").is_dir():
        return None
    target, found = str(lock.resolve()), []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) == target and "\nlock:" in (entry / "fdinfo" / fd.name).read_text():
                    found.append(int(entry.name))
                    break
        except OSError:  # the process ended, or its fds are not ours to read
            continue
    return sorted(found)


def _holder(lock: Path, fd: int) -> tuple[int | None, int | None]:
    """``(holder, claimant)`` of a held lock: the claimant is the pid written in the file; the holder is
    the claimant while its open file carries the lock, else a process whose does (a child that inherited
    it, say); None where unknown."""
    claimant = _stored_pid(fd)
    holders = _lock_holders(lock)
    if not holders or claimant in holders:
        return claimant, claimant
    return holders[0], claimant


def _held_message(path: Path, fd: int) -> str:
    holder, claimant = _holder(path / LOCK_NAME, fd)
    if holder is not None and claimant is not None and holder != claimant:
        state = "has ended" if process_gone(claimant) else "no longer holds it"
        return (f"run_dir {path} is held by pid {holder}: the copc train that claimed it (pid {claimant}) "
                f"{state}, and pid {holder}, a process it started, still holds the directory's lock; end pid "
                f"{holder}, or choose another run_dir")
    return (f"run_dir {path} is in use by another copc train (pid {holder if holder is not None else '?'}); "
            "wait for it to end or choose another run_dir")


def run_dir_holder(path: Path) -> int | None:
    """The pid of the process holding ``path`` now (:func:`claimed_run_dir`; -1 when it cannot be told),
    or None when none is."""
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder, _ = _holder(path / LOCK_NAME, fd)
        return -1 if holder is None else holder
    else:
        return None
    finally:
        os.close(fd)


def model_context(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's positions cover (``max_position_embeddings``, GPT-2's
    ``n_positions``); None when its config names none."""
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(model.config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def capped_context_limit(context_limit: int, model: PreTrainedModel) -> int:
    """``rollout.context_limit`` capped by the model's own context (:func:`model_context`): past it the model
    has no positions, so an episode there would be sampled and trained on garbage. Says so once on stderr
    when the cap applies (callers call it once per run)."""
    own = model_context(model)
    if own is None or context_limit <= own:
        return context_limit
    print(f"note: rollout.context_limit={context_limit} is above the model's own context "
          f"(max_position_embeddings={own}); "
          f"episodes are limited to {own} tokens", file=sys.stderr, flush=True)
    return own


def check_prompts_fit(task: Task, tokenizer: PreTrainedTokenizerBase, context_limit: int,
                      *, configured: int | None = None) -> int:
    """Refuse (one line, file and line named) training prompts of ``context_limit`` tokens or more.

    Such a prompt leaves no room for a single sampled token: every episode of it would be empty. The
    check runs once at start-up on the train split; returns the number of prompts checked. ``configured``:
    ``rollout.context_limit`` when the model's own context capped it to ``context_limit``.
    """
    prompts = task.prompts("train")
    too_long = []
    for start in range(0, len(prompts), 256):
        chunk = prompts[start : start + 256]
        encoded = tokenizer([p.text for p in chunk], add_special_tokens=True)["input_ids"]
        too_long += [(p, len(ids)) for p, ids in zip(chunk, encoded,
                                                     strict=True) if len(ids) >= context_limit]
    if too_long:
        prompt, length = too_long[0]
        where = str(prompt.meta.get("where", f"prompt {prompt.id}"))
        if configured is not None and configured > context_limit:
            limit = (f"the model's own context of {context_limit} tokens (max_position_embeddings; "
                     f"rollout.context_limit={configured} is capped to it)")
            fix = "shorten or remove them, or use a model with a longer context"
        else:
            limit = f"rollout.context_limit={context_limit}"
            fix = "shorten or remove them, or raise rollout.context_limit"
        raise DataError(
            f"{where}: prompt is {length} tokens, >= {limit} "
            f"({len(too_long)} of {len(prompts)} train prompts are too long); {fix}"
        )
    return len(prompts)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_source(
    cfg: RunConfig, *, model_dir: Path, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
    task: Task,
    run_dir: Path, context_limit: int | None = None,
) -> SyncSource | AsyncSource:
    """The driver's batch source: in-process generation (sync), worker processes (async) or Ray actors (ray).
    ``context_limit``: the episodes' limit when it is not ``rollout.context_limit``
    (:func:`capped_context_limit`)."""
    weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    # the method's dynamic sampling / overlong shaping where rollout leaves them unset
    rollout = resolve_rollout(cfg)
    if context_limit is not None:
        rollout = replace(rollout, context_limit=context_limit)
    if cfg.driver.kind == "sync":
        gen_model, _ = load_policy(model_dir)
        source = SyncSource(RolloutGenerator(gen_model, tokenizer, task, rollout, seed=cfg.seed),
                            cfg.staleness)
        source.publish(0, weights)
        return source
    spec = WorkerSpec(
        model_path=str(model_dir), task=cfg.task, task_options=dict(cfg.task_options), rollout=rollout,
        seed=cfg.seed,
        partial_chunk_tokens=cfg.driver.partial_chunk_tokens if cfg.driver.partial_rollouts else None,
        nice=cfg.driver.worker_nice if cfg.driver.kind == "async" else 0,
    )
    transport: TransportFactory = local_transport
    if cfg.driver.kind == "ray":  # the same driver over Ray actors (ray is imported only when they are built)
        transport = ray_transport(RayOptions(address=cfg.driver.address,
                                             cpus_per_worker=cfg.driver.ray_cpus_per_worker,
                                             gpus_per_worker=cfg.driver.ray_gpus_per_worker))
    return AsyncSource(spec, cfg.staleness, weights, num_workers=cfg.driver.num_workers,
                       journal_dir=run_dir / "rollouts", max_restarts=cfg.driver.max_worker_restarts,
                       batch_timeout_s=cfg.driver.batch_timeout_s or None,
                       silent_warn_s=cfg.driver.silent_worker_warn_s or None,
                       silent_restart_s=cfg.driver.silent_worker_restart_s or None, transport=transport)


def quiet_transformers() -> None:
    """No per-load progress bars: the command's own progress bar and table are the output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
