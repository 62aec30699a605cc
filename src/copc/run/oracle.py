"""The Monte-Carlo advantage oracle inside a run: the ``mc_oracle`` estimator's inputs and the diagnostic.

Before each step the loop hands the batch to :class:`OracleScorer` (the trainer's weights are then the
current policy, version ``step``):

- when the method's estimator reads the oracle (``mc_oracle``), every trajectory of the batch gets the
  current policy's chunk advantages from ``oracle.samples`` continuations per turn boundary
  (:func:`copc.rollout.oracle.mc_oracle`); a trajectory that cannot be replayed gets 0 and is counted;
- every ``oracle.every`` steps, on ``oracle.trajectories`` trajectories drawn from the batch, the stale
  advantage estimates of async PPO 3a (GAE), of COPC's advantage channel (clipped TD, R1's settings) and of
  V-trace are compared chunk by chunk with the oracle: bias, mean squared error, correlation
  (``oracle/<estimator>_<stat>``); with ``oracle.lag0`` the same on fresh episodes of the same prompts
  sampled by the current weights (``oracle/lag0_<estimator>_<stat>``: each estimator's own error, without
  staleness). The off-policy statistics of the whole batch (``offpolicy/*``: the summed |log(cur/mu)|
  and the clipped trace products per trajectory, where the advantage clip bites) are logged with it.

The continuations are sampled and thrown away: nothing the oracle samples is trained on. Estimators are
compared on raw (not whitened) advantages, each chunk's estimate being the mean over its action tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from copc import tracking as m
from copc.channels import AdvantageChannelConfig, compute_advantages, get_method
from copc.config import check_at_least
from copc.ops import chunk_errors, chunk_means, log_ratio
from copc.rollout.chat import ChatFormat
from copc.rollout.engine import Engine
from copc.rollout.episode import run_episodes
from copc.rollout.generator import GeneratedBatch, RolloutConfig
from copc.rollout.oracle import OracleEstimate, mc_oracle
from copc.rollout.sampling import SamplingConfig
from copc.tasks import Task
from copc.trainer.batching import TrainBatch, collate
from copc.trainer.common import eval_mode
from copc.trainer.trainer import ActorCriticTrainer
from copc.types import Prompt, Trajectory

__all__ = ["OracleConfig", "OracleScorer"]


@dataclass(frozen=True)
class OracleConfig:
    """The Monte-Carlo advantage oracle (module docstring of copc.run.oracle)."""

    samples: int = 4
    """Continuations sampled by the current policy from each turn boundary (M)."""
    every: int = 0
    """Compare the advantage estimates with the oracle every this many steps (0 = never)."""
    first: int = 0
    """No comparison before this step (at step 0 no batch is stale yet, so a staleness study starts later)."""
    trajectories: int = 8
    """Trajectories of the batch the comparison scores (drawn at random, seeded by the step)."""
    lag0: bool = True
    """Also score fresh episodes of the same prompts sampled by the current weights (error without
    staleness)."""

    def __post_init__(self) -> None:
        check_at_least("oracle", 1, samples=self.samples, trajectories=self.trajectories)
        check_at_least("oracle", 0, every=self.every, first=self.first)

    def diagnoses(self, step: int) -> bool:
        """Whether the comparison runs before ``step``."""
        return self.every > 0 and step >= self.first and step % self.every == 0


#: The estimators the diagnostic compares, each as its preset computes it, raw (not whitened).
COMPARED: dict[str, str] = {"gae": "async_ppo", "clipped_td": "copc_behaviour", "vtrace": "vtrace"}


def compared_estimators(run: AdvantageChannelConfig) -> dict[str, AdvantageChannelConfig]:
    """Each compared estimator as its preset computes it, raw (not whitened), at the run's discount and
    lambdas: the diagnostic then scores the estimator the run trains with (GAE at lambda 0.95 in a run at
    0.95), not the preset's default horizon."""
    return {name: replace(get_method(preset).advantage, whiten=False, gamma=run.gamma,
                          lam_actor=run.lam_actor, lam_critic=run.lam_critic)
            for name, preset in COMPARED.items()}


class OracleScorer:
    """Computes the oracle for a batch before the step (module docstring); ``needed`` says whether it
    ever does anything under this run's settings."""

    def __init__(self, cfg: OracleConfig, *, trainer: ActorCriticTrainer, task: Task, rollout: RolloutConfig,
                 tokenizer: object, chat: ChatFormat | None, seed: int,
                 estimator: AdvantageChannelConfig) -> None:
        self.cfg, self.trainer, self.task, self.rollout = cfg, trainer, task, rollout
        self.chat, self.seed = chat, seed
        self.tokenizer = tokenizer
        self.for_estimator = estimator.needs_oracle
        self.compared = compared_estimators(estimator)
        self._prompts: dict[str, Prompt] | None = None

    @property
    def needed(self) -> bool:
        return self.for_estimator or self.cfg.every > 0

    def _prompt(self, prompt_id: str) -> Prompt:
        if self._prompts is None:
            self._prompts = {p.id: p for split in ("train", "eval") for p in self.task.prompts(split)}
        return self._prompts[prompt_id]

    def _sampling(self) -> SamplingConfig:
        r = self.rollout
        return SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)

    def _oracle(self, engine: Engine, trajs: Sequence[Trajectory], salt: int) -> list[OracleEstimate | None]:
        r = self.rollout
        return mc_oracle(
            engine, lambda t: self.task.make_env(self._prompt(t.prompt_id)), trajs, samples=self.cfg.samples,
            max_turns=r.max_turns, max_new_tokens_per_turn=r.max_new_tokens_per_turn,
            max_total_tokens=r.max_total_tokens, context_limit=r.context_limit, sampling=self._sampling(),
            seed=self.seed * 1_000_003 + salt, chat=self.chat,
        )

    def __call__(self, step: int, batch: GeneratedBatch,
                 train: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        if not self.needed:
            return train, {}
        start, out = time.perf_counter(), {}
        # the engine puts the policy in eval mode; eval_mode restores the trainer's mode afterwards
        with eval_mode(self.trainer.policy), torch.no_grad():
            policy, version = self.trainer.policy, self.trainer.version
            engine = Engine(policy, self.tokenizer, version=version)  # type: ignore[arg-type]
            if self.for_estimator:
                estimates = self._oracle(engine, batch.trajectories, salt=2 * step)
                train = replace(train, oracle_advantages=_stack_adv(estimates, train))
                out[m.ORACLE_FAILED_FRAC] = sum(e is None for e in estimates) / len(estimates)
            if self.cfg.diagnoses(step):
                out |= self._diagnose(engine, step, batch, train)
        out[m.ORACLE_SECONDS] = time.perf_counter() - start
        return train, out

    def _forwards(self, train: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log cur [B, T], V [B, T] or None)`` of the current weights on ``train``, no grad."""
        fwd, trainer = self.trainer.fwd, self.trainer
        with eval_mode(trainer.policy, trainer.critic):
            cur = fwd.full(fwd.logp_of(trainer.policy), train)
            values = None if trainer.critic is None else fwd.full(partial(fwd.values, trainer.critic), train)
        return cur, values

    def _diagnose(self, engine: Engine, step: int, batch: GeneratedBatch,
                  train: TrainBatch) -> dict[str, float]:
        gen = torch.Generator().manual_seed(self.seed * 7_919 + step)
        rows = torch.randperm(train.batch_size, generator=gen)[: self.cfg.trajectories].sort().values
        cur, values = self._forwards(train)
        out = offpolicy_stats(log_ratio(cur, train.logp_behav, train.action_mask), train.action_mask)
        picked = [batch.trajectories[int(i)] for i in rows]
        out |= self._compare(engine, picked, train.rows(rows), cur[rows],
                             None if values is None else values[rows],
                             prefix="", salt=2 * step + 1)
        if self.cfg.lag0:
            fresh = run_episodes(
                engine, [self.task.make_env(self._prompt(t.prompt_id)) for t in picked],
                max_turns=self.rollout.max_turns,
                max_new_tokens_per_turn=self.rollout.max_new_tokens_per_turn,
                max_total_tokens=self.rollout.max_total_tokens, context_limit=self.rollout.context_limit,
                prompt_ids=[t.prompt_id for t in picked], sampling=self._sampling(),
                seed=self.seed * 1_000_033 + step, chat=self.chat,
            )
            fresh_train = collate(fresh, pad_id=_pad_id(self.tokenizer))
            f_cur, f_values = self._forwards(fresh_train)
            out |= self._compare(engine, fresh, fresh_train, f_cur, f_values, prefix="lag0_",
                                 salt=2 * step + 3)
        return out | contrasts_of(out)

    def _compare(self, engine: Engine, trajs: list[Trajectory], train: TrainBatch, cur: torch.Tensor,
                 values: torch.Tensor | None, *, prefix: str, salt: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if values is None:  # no critic (the oracle arm): nothing to compare, so no continuations either
            return out
        estimates = self._oracle(engine, trajs, salt=salt)
        kept = [i for i, e in enumerate(estimates) if e is not None]
        if not kept:
            return out
        k_max = max(int(estimates[i].chunk_ids.max()) + 1 for i in kept)  # type: ignore[union-attr]
        ids = torch.full(train.input_ids.shape, -1, dtype=torch.long)
        oracle_v = torch.zeros(len(trajs), k_max)
        noise = torch.zeros(len(trajs), k_max)
        for i in kept:
            est = estimates[i]
            assert est is not None
            k_n = len(est.values)
            ids[i, : len(est.chunk_ids)] = est.chunk_ids
            oracle_v[i, :k_n] = est.values
            nxt = torch.cat([est.value_var[1:], torch.zeros(1)])
            noise[i, :k_n] = est.value_var + nxt
        mask = train.action_mask
        oracle_adv, counts = chunk_means(_stack_adv(estimates, train), ids, mask, k_max)
        live = counts > 0
        live[[i for i in range(len(trajs)) if i not in kept]] = False
        out[m.ORACLE_CHUNKS if not prefix else f"oracle/{prefix}chunks"] = float(live.sum())
        out[m.ORACLE_NOISE_VAR if not prefix else f"oracle/{prefix}noise_var"] = float(noise[live].mean())
        out[m.ORACLE_VALUE_PROMPT if not prefix else f"oracle/{prefix}value_prompt"] = float(
            oracle_v[kept, 0].mean())
        log_w = log_ratio(cur, train.logp_behav, mask)
        for name, cfg in self.compared.items():
            adv = compute_advantages(cfg, rewards=train.token_rewards, values=values, log_w=log_w,
                                     action_mask=mask,
                                     scores=train.scores, group_ids=train.group_ids).advantages
            est_chunks, _ = chunk_means(adv, ids, mask, k_max)
            err = chunk_errors(est_chunks[live], oracle_adv[live])
            out |= {f"oracle/{prefix}{name}_bias": float(err.bias),
                    f"oracle/{prefix}{name}_mse": float(err.mse),
                    f"oracle/{prefix}{name}_corr": float(err.corr)}
        first = _first_action_values(values, ids, mask, k_max)
        err = chunk_errors(first[live], oracle_v[live])
        out |= {f"oracle/{prefix}critic_value_mse": float(err.mse),
                f"oracle/{prefix}critic_value_corr": float(err.corr)}
        return out


def contrasts_of(out: dict[str, float]) -> dict[str, float]:
    """The differences the long-horizon hypotheses are about, at one diagnostic step (where both sides were
    measured): GAE's error on the stale batch beyond its error on fresh episodes, and the clipped-TD and
    V-trace errors against GAE's on the same trajectories."""
    pairs = {m.ORACLE_GAE_EXCESS: (m.ORACLE_GAE_MSE, m.ORACLE_LAG0_GAE_MSE),
             m.ORACLE_CLIPPED_TD_GAIN: (m.ORACLE_CLIPPED_TD_MSE, m.ORACLE_GAE_MSE),
             m.ORACLE_VTRACE_GAIN: (m.ORACLE_VTRACE_MSE, m.ORACLE_GAE_MSE)}
    return {key: out[a] - out[b] for key, (a, b) in pairs.items() if a in out and b in out}


def _pad_id(tokenizer: object) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _stack_adv(estimates: Sequence[OracleEstimate | None], train: TrainBatch) -> torch.Tensor:
    """The oracle's per-token chunk advantages as ``[B, T]`` (0 for a row it could not score)."""
    adv = torch.zeros(train.input_ids.shape, dtype=torch.float32)
    for row, est in enumerate(estimates):
        if est is not None:
            adv[row, : len(est.advantages)] = est.advantages
    return adv


def _first_action_values(values: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                         k_max: int) -> torch.Tensor:
    """``[B, K]``: the critic's V at the first action token of each chunk (the state at its boundary)."""
    out = torch.zeros(values.shape[0], k_max)
    for row in range(values.shape[0]):
        seen: set[int] = set()
        for t in torch.nonzero(mask[row] & (ids[row] >= 0)).flatten().tolist():
            k = int(ids[row, t])
            if k not in seen:
                seen.add(k)
                out[row, k] = values[row, t]
    return out


def offpolicy_stats(log_w: torch.Tensor, mask: torch.Tensor, *, low: float = 0.8,
                    high: float = 1.2) -> dict[str, float]:
    """Per-trajectory off-policy statistics of a batch (``offpolicy/*``): sum |log w|, the product of
    clip(w, low, high) (COPC's clipped weights) and of min(1, w) (V-trace's traces), where the clip bites."""
    rows = mask.any(dim=1)
    if not bool(rows.any()):
        return {}
    lw = torch.where(mask, log_w, 0.0)[rows]
    mk = mask[rows]
    total = lw.abs().sum(dim=1)
    log_low, log_high = math.log(low), math.log(high)
    clip_prod = torch.where(mk, lw.clamp(log_low, log_high), 0.0).sum(dim=1).exp()
    vtrace_prod = torch.where(mk, lw.clamp(max=0.0), 0.0).sum(dim=1).exp()
    outside = ((lw < log_low) | (lw > log_high)) & mk
    return {
        m.OFFPOLICY_SUM_ABS_LOG_W: float(total.median()),
        m.OFFPOLICY_SUM_ABS_LOG_W_P90: float(torch.quantile(total, 0.9)),
        m.OFFPOLICY_TRACE_CLIP_MEDIAN: float(clip_prod.median()),
        m.OFFPOLICY_TRACE_CLIP_P10: float(torch.quantile(clip_prod, 0.1)),
        m.OFFPOLICY_TRACE_VTRACE_MEDIAN: float(vtrace_prod.median()),
        m.OFFPOLICY_ADV_CLIP_FRAC: float(outside.sum() / mk.sum()),
    }
