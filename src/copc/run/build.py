"""Building a run's pieces from its :class:`~copc.run.config.RunConfig`: the policy folder (warm start,
tiny model or an HF folder), the run directory, the seeds, and the driver's batch source.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc.config import ConfigError
from copc.models.hf import load_policy
from copc.rollout.generator import RolloutGenerator
from copc.run.config import RunConfig, resolve_rollout
from copc.runtime.async_local import AsyncSource, WorkerSpec
from copc.runtime.sync import SyncSource
from copc.tasks import Task

__all__ = ["build_source", "make_run_dir", "policy_path", "quiet_transformers", "seed_everything"]


def policy_path(cfg: RunConfig, scratch: Path) -> Path:
    """The HF folder the policy starts from (warm start built and cached on first use)."""
    if cfg.model.policy == "warmstart":
        from copc.run.warmstart import build_warmstart, run_warmstart

        try:
            req = run_warmstart(cfg.task, task_options=cfg.task_options, sft_overrides=cfg.model.warmstart_sft,
                                seed=cfg.model.warmstart_seed)
        except ValueError as err:
            raise ConfigError(str(err)) from None
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
        raise ConfigError(f"model.policy: {cfg.model.policy!r} is not 'warmstart', 'tiny' or an existing HF folder")
    return path


def make_run_dir(cfg: RunConfig) -> Path:
    if cfg.run_dir:
        path = Path(cfg.run_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{stamp}-{cfg.method}-{cfg.task}-s{cfg.staleness.staleness}-seed{cfg.seed}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_source(
    cfg: RunConfig, *, model_dir: Path, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task,
    run_dir: Path,
) -> SyncSource | AsyncSource:
    """The driver's batch source: in-process generation (sync) or worker processes (async)."""
    weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    rollout = resolve_rollout(cfg)  # the method's dynamic sampling / overlong shaping where rollout leaves them unset
    if cfg.driver.kind == "sync":
        gen_model, _ = load_policy(model_dir)
        source = SyncSource(RolloutGenerator(gen_model, tokenizer, task, rollout, seed=cfg.seed), cfg.staleness)
        source.publish(0, weights)
        return source
    spec = WorkerSpec(
        model_path=str(model_dir), task=cfg.task, task_options=dict(cfg.task_options), rollout=rollout,
        seed=cfg.seed,
    )
    return AsyncSource(spec, cfg.staleness, weights, num_workers=cfg.driver.num_workers,
                       journal_dir=run_dir / "rollouts")


def quiet_transformers() -> None:
    """No per-load progress bars: the command's own progress bar and table are the output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
