"""Supervised warm-start of the tiny policy on a built-in task's mixed demonstrations (cached).

The demonstrations (:meth:`sft_demos` of the task) mix good tool use with direct guesses and flawed
tool use, so the warm-started policy calls the tool only part of the time and sometimes slips: its
starting accuracy is modest and RL has room to make tool use reliable.

Training is teacher forcing with the loss on the policy's own tokens only. A demonstration is encoded
exactly as the episode loop lays out an episode: the prompt with ``<bos>`` (``add_special_tokens=True``),
then each turn and each observation without special tokens, concatenated. With ``a_t`` True on tokens
of action segments,

    loss = - sum_t a_t log p(x_t | x_<t) / sum_t a_t        (prompt and tool-output tokens excluded)

summed over the batch before dividing (each action token weighs the same).

Cache: ``$COPC_CACHE/warmstart/<task>-<hash>`` (``~/.cache/copc`` when ``COPC_CACHE`` is unset), the
hash covering the task config, the SFT config, the seed and the model size. A build writes into a
temporary sibling directory, writes the completion marker ``warmstart.json`` last, then renames the
directory into place, so a killed build never leaves a directory that :func:`load_warmstart` accepts; a
directory without the marker is deleted and rebuilt.

Pinned warm starts: SFT of 3000 steps is chaotic in float rounding, so the same build on another CPU
gives other weights (on kv_search hard, greedy EM 0.82 on one machine and 0.435 on another, same code).
Runs compared by seed must start from the same weights, so an experiment pins them: with
``$COPC_WARMSTART_PINNED`` set (``copc sweep`` sets it to ``<results>/warmstarts``, committed with the
records), a complete ``<pinned>/<task>-<hash>`` is used instead of the cache, and :func:`pin_warmstart`
copies a freshly built one there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from copc.config import CommandParser, ConfigValue
from copc.eval.evaluate import EvalConfig, evaluate
from copc.rollout.generator import RolloutConfig
from copc.tasks.base import Demo, SupportsSFT, get_task, stable_hash

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

MARKER = "warmstart.json"
#: Part of the cache key: bump it when demonstrations or training change, so old caches are not reused.
WARMSTART_VERSION = 2


@dataclass(frozen=True)
class SFTConfig:
    n_examples: int = 3000
    """Demonstrations drawn from the task (the mix is set in the task config)."""
    steps: int = 500
    """Optimizer steps."""
    batch_size: int = 32
    """Demonstrations per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, then cosine decay to 10%)."""
    warmup_steps: int = 25
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    model_seed: int = 0
    """Initialisation seed of the tiny model."""

    def __post_init__(self) -> None:
        for key in ("n_examples", "steps", "batch_size", "lr"):
            if not getattr(self, key) > 0:
                raise ValueError(f"SFTConfig.{key} must be > 0, got {getattr(self, key)!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"SFTConfig.warmup_steps must be in [0, steps), got {self.warmup_steps}")


#: Per-task SFT settings, tuned so the warm-started policy lands in the target accuracy band (sampled
#: accuracy in [0.2, 0.6], greedy < 0.8). Measured on 200 eval prompts through the engine, episode loop,
#: tools and reward (``pytest -m slow tests/run/test_warmstart.py``; ``measure_accuracy``):
#:   arith_tool: greedy 0.67, sampled 0.33 (tool use 0.47); 91 s CPU on one thread.
#:   kv_search:  greedy 0.72, sampled 0.275 (tool use 0.54); 139 s CPU on one thread (top_k=1).
#: Small batches matter: 500 steps of 32 (the same tokens) left arith_tool at accuracy 0.
DEFAULT_SFT: dict[str, SFTConfig] = {
    "arith_tool": SFTConfig(batch_size=8, steps=1500, lr=2e-3, warmup_steps=50),
    "kv_search": SFTConfig(batch_size=8, steps=1500, lr=2e-3, warmup_steps=50),
    "kv_chain": SFTConfig(batch_size=8, steps=1500, lr=2e-3, warmup_steps=50),
}


@dataclass(frozen=True)
class EncodedDemo:
    """``token_ids``: ``[L] int64``; ``action_mask``: ``[L] bool``, True on the policy's own tokens."""

    token_ids: torch.Tensor
    action_mask: torch.Tensor


def encode_demo(tokenizer: PreTrainedTokenizerFast, demo: Demo) -> EncodedDemo:
    """Token ids and action mask of one demonstration, laid out like an episode (see module docstring)."""
    ids: list[int] = []
    mask: list[bool] = []
    for i, segment in enumerate(demo.segments):
        piece = tokenizer(segment.text, add_special_tokens=(i == 0))["input_ids"]
        ids.extend(piece)
        mask.extend([segment.is_action] * len(piece))
    return EncodedDemo(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def pad_batch(batch: Sequence[EncodedDemo], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to ``[B, T]``: token ids, attention mask (bool), action mask (bool, False on padding)."""
    length = max(item.token_ids.shape[0] for item in batch)
    ids_B_T = torch.full((len(batch), length), pad_id, dtype=torch.long)
    attention_B_T = torch.zeros((len(batch), length), dtype=torch.bool)
    action_B_T = torch.zeros((len(batch), length), dtype=torch.bool)
    for row, item in enumerate(batch):
        n = item.token_ids.shape[0]
        ids_B_T[row, :n] = item.token_ids
        attention_B_T[row, :n] = True
        action_B_T[row, :n] = item.action_mask
    return ids_B_T, attention_B_T, action_B_T


def action_nll(logits_B_T_V: torch.Tensor, ids_B_T: torch.Tensor, action_B_T: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of action tokens: token t is predicted from position t-1.

    ``logits_B_T_V``: ``[B, T, V]``; ``ids_B_T``: ``[B, T] int64``; ``action_B_T``: ``[B, T] bool``.
    Returns a float32 scalar; position 0 (``<bos>``) is never a target.
    """
    logp_B_T_V = torch.log_softmax(logits_B_T_V[:, :-1].float(), dim=-1)
    target_logp_B_T = logp_B_T_V.gather(-1, ids_B_T[:, 1:, None]).squeeze(-1)
    mask_B_T = action_B_T[:, 1:]
    total = torch.where(mask_B_T, -target_logp_B_T, torch.zeros_like(target_logp_B_T)).sum()
    return total / mask_B_T.sum().clamp(min=1)


def _lr_at(step: int, config: SFTConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to 0.1 * lr at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps - 1)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def shuffled_batches(n: int, batch_size: int, generator: torch.Generator) -> list[list[int]]:
    """One epoch of index batches in random order (a last partial batch is dropped).

    Batches are deliberately not bucketed by length: length follows the demonstration kind (a direct
    guess is short, a tool call long), so length buckets make single-kind batches, and with them the
    warm start did not learn to copy at all (arith_tool: accuracy 0 instead of 0.3).
    """
    if n < batch_size:
        raise ValueError(f"{n} demonstrations cannot fill one batch of {batch_size}; draw more")
    order = torch.randperm(n, generator=generator).tolist()
    return [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)][::-1]


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    demos: Sequence[Demo],
    config: SFTConfig,
    *,
    seed: int,
) -> dict[str, float]:
    """Teacher-forced training on ``demos`` (loss on action tokens only); returns summary stats."""
    encoded = [encode_demo(tokenizer, demo) for demo in demos]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    losses: list[float] = []
    batches: list[list[int]] = []
    for step in range(config.steps):
        if not batches:
            batches = shuffled_batches(len(encoded), config.batch_size, generator)
        batch = [encoded[i] for i in batches.pop()]
        ids_B_T, attention_B_T, action_B_T = pad_batch(batch, tokenizer.pad_token_id)
        logits = model(input_ids=ids_B_T, attention_mask=attention_B_T.long()).logits
        loss = action_nll(logits, ids_B_T, action_B_T)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return {"loss_first": losses[0], "loss_last": sum(tail) / len(tail)}


# ------------------------------------------------------------------------------------------- cache


def cache_root() -> Path:
    """``$COPC_CACHE`` (default ``~/.cache/copc``) / ``warmstart``."""
    return Path(os.environ.get("COPC_CACHE", "~/.cache/copc")).expanduser() / "warmstart"


#: A folder of pinned warm starts (module docstring), checked before the cache.
PINNED_ENV = "COPC_WARMSTART_PINNED"


def pinned_root() -> Path | None:
    """``$COPC_WARMSTART_PINNED``, or None when unset."""
    value = os.environ.get(PINNED_ENV, "")
    return Path(value).expanduser() if value else None


def pin_warmstart(path: Path) -> Path | None:
    """Copy the complete warm start ``path`` into the pinned folder (if one is set and it is not there
    yet); the pinned copy, or None without a pinned folder."""
    root = pinned_root()
    if root is None or not is_complete(path):
        return None
    target = root / path.name
    if target.resolve() != path.resolve() and not is_complete(target):
        staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(path, staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    return target


def _sft_task(task_name: str, task_config: Mapping[str, ConfigValue]) -> SupportsSFT:
    task = get_task(task_name, **task_config)
    if not isinstance(task, SupportsSFT):
        raise ValueError(f"task {task_name!r} has no warm-start demonstrations; use arith_tool or kv_search")
    return task


def warmstart_dir(
    task_name: str,
    *,
    seed: int = 0,
    task_config: Mapping[str, ConfigValue] | None = None,
    sft: SFTConfig | None = None,
) -> Path:
    """Directory of a warm start: its pinned copy when there is one (module docstring), else its cache
    directory (whether or not it is built yet)."""
    task = _sft_task(task_name, task_config or {})
    sft = sft or DEFAULT_SFT.get(task_name, SFTConfig())
    from copc.models.tiny import DEFAULT_SIZE

    key = {
        "task": dataclasses.asdict(task.config),  # type: ignore[attr-defined]
        "sft": dataclasses.asdict(sft),
        "seed": seed,
        "size": DEFAULT_SIZE,
        "version": WARMSTART_VERSION,
    }
    name = f"{task_name}-{stable_hash(key)}"
    pinned = pinned_root()
    if pinned is not None and is_complete(pinned / name):
        return pinned / name
    return cache_root() / name


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a finished warm start (its completion marker exists)."""
    return (path / MARKER).is_file()


def build_warmstart(
    task_name: str,
    *,
    seed: int = 0,
    out_dir: str | Path | None = None,
    force: bool = False,
    task_config: Mapping[str, ConfigValue] | None = None,
    sft: SFTConfig | None = None,
) -> Path:
    """Warm-start the tiny model on ``task_name`` and return the checkpoint directory (cached).

    Deterministic in (task config, ``sft``, ``seed``). Returns at once when the completed checkpoint
    exists (unless ``force``); a directory without the completion marker is rebuilt. Runs on one torch
    thread (the previous thread count is restored).
    """
    sft = sft or DEFAULT_SFT.get(task_name, SFTConfig())
    task = _sft_task(task_name, task_config or {})
    path = Path(out_dir) if out_dir is not None else warmstart_dir(task_name, seed=seed,
                                                                   task_config=task_config, sft=sft)
    if is_complete(path) and not force:
        return path
    from copc.models.tiny import build_tiny_model, build_tiny_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer, seed=sft.model_seed)
        demos = task.sft_demos(sft.n_examples, seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            stats = train_sft(model, tokenizer, demos, sft, seed=seed)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        torch.set_num_threads(threads)
    kinds = Counter(demo.kind for demo in demos)
    marker = {
        "task": task_name,
        "task_config": dataclasses.asdict(task.config),  # type: ignore[attr-defined]
        "sft": dataclasses.asdict(sft),
        "seed": seed,
        "train_seconds": round(seconds, 2),
        "train_cpu_seconds": round(cpu_seconds, 2),
        "demo_mix": {kind: count / len(demos) for kind, count in sorted(kinds.items())},
        **stats,
    }
    _publish(path, model, tokenizer, marker)
    return path


def _publish(path: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
             marker: dict[str, object]) -> None:
    """Save into a temporary sibling, write the marker last, then move it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))
    if path.exists():
        shutil.rmtree(path)  # incomplete (no marker) or forced rebuild
    try:
        os.replace(staging, path)
    except OSError:
        if not is_complete(path):  # a concurrent build did not finish it either: surface the error
            raise
        shutil.rmtree(staging, ignore_errors=True)  # another process published the same build first


def load_warmstart(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Model (eval mode) and tokenizer of a completed warm start."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a completed warm start (no {MARKER}); run `copc sft --task "
                                f"NAME`")
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval(), tokenizer


def warmstart_info(path: str | Path) -> dict[str, object]:
    """The completion marker of a warm start (config, training time, demo mix, losses)."""
    return dict(json.loads((Path(path) / MARKER).read_text()))


@dataclass(frozen=True)
class WarmstartRequest:
    """Which warm start to build: everything its cache key holds (:func:`build_warmstart`'s arguments)."""

    task: str
    seed: int
    task_config: Mapping[str, ConfigValue]
    sft: SFTConfig


def resolve_sft(task_name: str, overrides: Mapping[str, int | float]) -> SFTConfig:
    """The task's :data:`DEFAULT_SFT` with ``overrides`` applied; a bad key or value fails naming the valid
    keys."""
    sft = DEFAULT_SFT.get(task_name, SFTConfig())
    try:
        return dataclasses.replace(sft, **overrides)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        valid = ", ".join(f.name for f in dataclasses.fields(SFTConfig))
        raise ValueError(f"model.warmstart_sft: {' '.join(str(err).split())}; valid keys: {valid}") from None


def run_warmstart(
    task_name: str,
    *,
    task_options: Mapping[str, ConfigValue],
    sft_overrides: Mapping[str, int | float],
    seed: int,
) -> WarmstartRequest:
    """The warm start a run with these settings starts from (``copc train``'s ``model.policy=warmstart``:
    its ``task``, ``task_options``, ``model.warmstart_sft`` and ``model.warmstart_seed``); ``copc sft``
    builds the same one from the default run config, so the two share one cache entry."""
    return WarmstartRequest(task_name, seed, dict(task_options), resolve_sft(task_name, sft_overrides))


def cli_request(task_name: str, seed: int | None = None) -> WarmstartRequest:
    """What ``copc sft --task NAME`` builds: for the default run's task, the default ``copc train`` run's
    warm start (task options, SFT overrides and seed of :func:`copc.run.config.default_config`); for
    another task, that task's own defaults (the default run's task options and SFT tuning are its task's)."""
    from copc.run.config import default_config

    run = default_config()
    if task_name == run.task:
        options, overrides = run.task_options, run.model.warmstart_sft
    else:  # the default run's task options and SFT tuning are its own task's: this task's defaults
        options, overrides = {}, {}
    return run_warmstart(task_name, task_options=options, sft_overrides=overrides,
                         seed=run.model.warmstart_seed if seed is None else seed)


def sft_cli(argv: list[str]) -> int:
    """``copc sft --task NAME [--seed S] [--force] [--out-dir DIR]``: build (or find) a warm start.

    For the default run's task (arith_tool) it builds exactly the warm start ``copc train`` uses.
    """
    parser = CommandParser(prog="copc sft", description="Warm-start the tiny model on a built-in task.")
    parser.add_argument("--task", required=True, help="built-in task: arith_tool or kv_search")
    parser.add_argument("--seed", type=int, default=None,
                        help="demonstration / training seed (default: the run's model.warmstart_seed)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a completed checkpoint exists")
    parser.add_argument("--out-dir", default=None, help="checkpoint directory (default: the cache)")
    args = parser.parse_args(argv)
    try:
        req = cli_request(args.task, args.seed)
        path = build_warmstart(req.task, seed=req.seed, out_dir=args.out_dir, force=args.force,
                               task_config=req.task_config, sft=req.sft)
    except (KeyError, ValueError) as error:
        print(f"copc sft: {error}")
        return 2
    info = warmstart_info(path)
    print(f"warm start ready: {path}")
    print(f"  train_seconds={info['train_seconds']} cpu={info['train_cpu_seconds']} "
          f"loss_last={info['loss_last']:.4f} mix={info['demo_mix']}")
    return 0


# ------------------------------------------------------------------------------------- measurement


#: The budgets the warm start is scored with (roomier than the default run's, so a cut turn is rare).
SCORING_ROLLOUT = RolloutConfig(max_turns=4, max_new_tokens_per_turn=48, max_total_tokens=160,
                                context_limit=1024)


def measure_accuracy(
    task_name: str,
    path: str | Path,
    *,
    n: int = 200,
    seed: int = 0,
    task_config: Mapping[str, ConfigValue] | None = None,
) -> dict[str, float]:
    """:func:`copc.eval.evaluate.evaluate` of the warm start at ``path`` on the first ``n`` eval prompts.

    Sampled (temperature 1, no top-k / top-p) avg@1 as ``eval/accuracy``, greedy as
    ``eval/greedy_accuracy``, and ``eval/tool_use_rate``, with :data:`SCORING_ROLLOUT`'s budgets.
    """
    model, tokenizer = load_warmstart(path)
    task = get_task(task_name, **(task_config or {}))
    return evaluate(model, tokenizer, task, SCORING_ROLLOUT, EvalConfig(prompts=n, samples=1, greedy=True),
                    seed=seed)
