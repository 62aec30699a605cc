"""One actor-critic training step on a batch of (possibly stale) trajectories (docs/formulas.md#ppo,
#async-ppo, #one-step).

Notation: ``B`` trajectories, ``T`` tokens; ``mu`` = behaviour log-probs recorded by the sampler,
``old`` = the policy at the start of this step (no-grad forward), ``cur`` = the policy being optimised.

One step, in order:

1. no-grad forwards in eval mode (no dropout): ``old_t`` from ``trainer.proximal`` (only when the method
   needs it; otherwise ``old := mu``, async PPO 3a; copc.trainer.proximal: the step-start policy by
   default, each token's own version, an EWMA of the weights, or A-3PO's interpolation) and the critic's
   ``V_t = V(s_t)`` (when the method has a critic); log-probs under the sampler's transform (temperature,
   top-k, top-p). With ``old_forward_reuse`` the first actor minibatch's forward runs here instead (train
   mode, with grad, kept for its update) and gives ``old`` of its rows (docs/algorithms.md);
2. rewards folded onto policy tokens, behaviour log-ratio ``log w_t = clamp(old_t - mu_t, +-20)``;
3. the advantage channel: ``advantages`` (normalised once over the loss tokens of the whole batch when
   the method says so) and critic targets ``returns``;
4. ``K_critic`` epochs over critic minibatches (clipped value loss against ``V_old``);
5. unless in critic warm-up: ``ppo_epochs`` passes over ``actor_minibatches`` minibatches of the
   policy channel's loss (+ optional k3 KL to a reference, - entropy bonus), each optimizer step
   accumulating micro-batches that all divide by the minibatch's **global** token count (the actor
   loss by its denominator, all or kept tokens; the KL and entropy terms by the valid tokens);
   for methods without an ``old`` forward the ``ratio/...`` diagnostics are those of ``cur/mu`` on
   the first minibatch (``cur`` is then still the step-start policy);
6. ``version += 1``: the new weights are what a driver publishes next (and what ``snapshot`` stores).

Truncated trajectories (``truncation``): ``terminal`` (V after the last token = 0), ``bootstrap`` (V
after it := the pre-update critic's value at the last position), or ``mask`` (out of both losses).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from copc import tracking as m
from copc.channels import (
    PolicyInputs,
    ValueInputs,
    compute_advantages,
    count_loss_tokens,
    policy_loss,
    value_loss,
)
from copc.channels.methods import MethodConfig
from copc.models.hf import TokenLogProbs
from copc.ops import explained_variance, k3_from_log, log_ratio, masked_mean, masked_var, zero_where_not
from copc.trainer.batching import Minibatch, TrainBatch, split_minibatches
from copc.trainer.common import accumulate, clip_grad, eval_mode, make_optimizer, trim_length
from copc.trainer.config import TrainerConfig
from copc.trainer.diagnostics import current_ratio_stats, minibatch_ess, step_diagnostics
from copc.trainer.forwards import Forwards
from copc.trainer.memory import PEAKS, use_gradient_checkpointing
from copc.trainer.old_sources import OldInputs, OldLogp, check_proximal_source, make_source
from copc.trainer.proximal import loglinear_logp, train_eval_equivalent
from copc.trainer.weight_files import Weights

__all__ = ["ActorCriticTrainer", "StepTensors"]


@dataclass(frozen=True)
class StepTensors:
    """Per-token constants of one step, computed once before any update (all ``[B, T]`` float32).

    Attributes:
        logp_old: log pi_old(a_t | s_t) (= ``logp_behav`` when the method skips the old forward).
        values_old: pre-update V(s_t); 0 without a critic.
        log_w: behaviour log-ratio ``clamp(old - mu)``, 0 off the action mask.
        advantages: the advantage channel's output (whitened when the method whitens).
        returns: critic targets.
        loss_mask: ``[B, T] bool``, the action tokens that enter the losses (truncation = mask drops rows).
        adv_stats: the advantage channel's detached diagnostics (``adv/...``, ``returns/...``, ``ratio/...``).
        alpha: ``trainer.proximal = loglinear``: A-3PO's ``[B, T]`` weights; the actor loss then takes
            ``old`` from each micro-batch's own forward (``logp_old`` is only the step-start value).
        ratio_from_first: ``logp_old`` is ``mu`` (no step-start old): ``ratio/...`` come from the first
            minibatch.
        reused_rows: rows whose ``logp_old`` is their first actor forward (``old_forward_reuse``).
    """

    logp_old: torch.Tensor
    values_old: torch.Tensor
    log_w: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    loss_mask: torch.Tensor
    adv_stats: dict[str, torch.Tensor]
    alpha: torch.Tensor | None = None
    ratio_from_first: bool = False
    reused_rows: int = 0


class ActorCriticTrainer:
    """Owns the policy, the critic and their optimizers; :meth:`step` runs one training step.

    Args:
        policy: a causal LM (HF ``PreTrainedModel``) being trained.
        critic: the value model (``values [B, T]`` = V of the state before token t), or None when the
            method has no critic.
        method: the two channel configs (``copc.channels.methods.get_method(name)`` or built directly).
        config: optimisation settings.
        reference: frozen reference policy for the KL loss (needed iff ``config.kl_coef > 0``).
    """

    def __init__(
        self,
        policy: nn.Module,
        critic: nn.Module | None,
        method: MethodConfig,
        config: TrainerConfig,
        *,
        reference: nn.Module | None = None,
    ) -> None:
        if method.needs_critic and critic is None:
            raise ValueError(f"method {method.name!r} needs a critic: pass a value model")
        if config.kl_coef > 0 and reference is None:
            raise ValueError("trainer.kl_coef > 0 needs a reference policy; pass reference= or set kl_coef=0")
        check_proximal_source(method, config.proximal)
        self.policy, self.critic, self.reference = policy, critic if method.needs_critic else None, reference
        self.method, self.config = method, config
        self.checkpointing = (use_gradient_checkpointing(policy, config.gradient_checkpointing),
                              use_gradient_checkpointing(self.critic, config.gradient_checkpointing))
        opt = partial(make_optimizer, kind=config.optimizer, weight_decay=config.weight_decay,
                      eps=config.adam_eps)
        self.actor_optimizer = opt(policy, lr=config.actor_lr)
        self.critic_optimizer = opt(self.critic, lr=config.critic_lr) if self.critic is not None else None
        self.version = 0
        self.steps_done = 0
        self.proximal = make_source(config.proximal, policy, version=0, decay=config.proximal_decay,
                                    max_bytes=config.proximal_max_bytes)
        self._early: dict[tuple[int, ...], TokenLogProbs] = {}  # actor forwards kept from the step start
        self._early_values: dict[tuple[int, ...], torch.Tensor] = {}  # critic_forward_reuse
        self.fwd = Forwards(config.temperature, config.top_k, config.top_p, config.micro_batch_size,
                            by_length=config.micro_batch_by_length,
                            vocab_size=int(getattr(getattr(policy, "config", None), "vocab_size", 0) or 0))

    # ------------------------------------------------------------------ state
    def state_dict(self, *, optimizers: bool = True) -> dict[str, object]:
        """Everything to continue training exactly; ``optimizers=False``: no AdamW moments (then
        :meth:`load_state_dict` returns False and the moments start from zero)."""
        return {
            "policy": Weights(self.policy.state_dict()),
            "critic": Weights(self.critic.state_dict()) if self.critic is not None else None,
            "actor_optimizer": self.actor_optimizer.state_dict() if optimizers else None,
            "critic_optimizer": self.critic_optimizer.state_dict() if optimizers and self.critic_optimizer
            else None,
            "version": self.version, "steps_done": self.steps_done,
            "proximal": self.proximal.state_dict(),
        }

    def load_state_dict(self, state: dict[str, object]) -> bool:
        self.policy.load_state_dict(state["policy"])  # type: ignore[arg-type]
        if self.critic is not None and state.get("critic") is not None:
            self.critic.load_state_dict(state["critic"])  # type: ignore[arg-type]
        if has_optimizers := state.get("actor_optimizer") is not None:
            self.actor_optimizer.load_state_dict(state["actor_optimizer"])  # type: ignore[arg-type]
        critic_moments = state.get("critic_optimizer")
        if self.critic_optimizer is not None and critic_moments is not None:
            self.critic_optimizer.load_state_dict(critic_moments)  # type: ignore[arg-type]
        self.version = int(state["version"])  # type: ignore[call-overload]
        self.steps_done = int(state["steps_done"])  # type: ignore[call-overload]
        proximal = state.get("proximal")
        self.proximal.load_state_dict(proximal, self.policy, version=self.version)  # type: ignore[arg-type]
        return has_optimizers

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """Detached policy weights to publish as :attr:`version`."""
        return {k: v.detach() for k, v in self.policy.state_dict().items()}

    # ------------------------------------------------------------------ forwards
    def _old_logp(self, batch: TrainBatch, loss_mask: torch.Tensor) -> OldLogp:
        """``old`` at the step start from the ``trainer.proximal`` source (copc.trainer.old_sources);
        ``logp_behav`` itself for methods without a proximal policy (async PPO 3a)."""
        self._early.clear()  # a prepare() outside step() must not leave graphs for the next step
        if not self.method.needs_old_forward:
            return OldLogp(batch.logp_behav)
        return self.proximal.old(OldInputs(
            batch=batch, policy=self.policy, version=self.version, fwd=self.fwd,
            advantage_reads_old=self.method.advantage.needs_old_forward,
            policy_logp=partial(self._policy_logp, batch, loss_mask),
        ))

    def _policy_logp(self, batch: TrainBatch, loss_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The step-start policy's log-probs ``[B, T]`` and how many rows came from their first actor
        forward (``old_forward_reuse``: train mode, with grad, kept for the first update)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        rest = torch.arange(batch.batch_size)
        if self._reuses_first_forward():
            first = self._minibatches(loss_mask, self._actor_minibatch_count(), salt=100)[0].index

            def actor_forward(b: TrainBatch, rows: torch.Tensor) -> tuple[TokenLogProbs, torch.Tensor]:
                forward = self.fwd.logp_entropy(self.policy, b, rows, entropy=self.config.entropy_coef != 0)
                return forward, forward.logp

            self._early, rest = self.fwd.keep_first(actor_forward, batch, first, out)  # train mode, with grad
        with eval_mode(self.policy):
            self.fwd.full(self.fwd.logp_of(self.policy), batch, rest, out)
        return out, batch.batch_size - len(rest)

    def _values_old(self, batch: TrainBatch, loss_mask: torch.Tensor) -> torch.Tensor:
        """Pre-update ``V(s_t)`` ``[B, T]`` (0 without a critic); with ``critic_forward_reuse`` the first
        critic minibatch's rows come from their own first critic forward, kept for their update."""
        self._early_values.clear()
        if self.critic is None:
            return torch.zeros_like(batch.logp_behav)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        rest = torch.arange(batch.batch_size)
        if self.config.critic_forward_reuse and train_eval_equivalent(self.critic):
            first = self._minibatches(loss_mask, self.config.critic_minibatches, salt=1)[0].index
            critic = self.critic.train()

            def critic_forward(b: TrainBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                values = self.fwd.values(critic, b, rows)
                return values, values

            # kept for the update
            self._early_values, rest = self.fwd.keep_first(critic_forward, batch, first, out)
        with eval_mode(self.critic):
            self.fwd.full(partial(self.fwd.values, self.critic), batch, rest, out)
        return zero_where_not(batch.action_mask, out)

    def _reuses_first_forward(self) -> bool:
        """``old_forward_reuse`` applies this step (only recompute asks for the step-start policy's forward):
        the actor trains, and a train-mode forward equals the eval-mode one (no dropout, no batch norm;
        else the separate forward is kept)."""
        return (self.config.old_forward_reuse and self.steps_done >= self.warmup_steps
                and train_eval_equivalent(self.policy))

    def _actor_minibatch_count(self) -> int:
        return self.config.actor_minibatches or self.method.policy.minibatches

    def prepare(self, batch: TrainBatch) -> StepTensors:
        """Steps 1-3 of the algorithm: no-grad forwards, behaviour ratios, the advantage channel."""
        action_mask = batch.action_mask
        loss_mask = action_mask
        if self.config.truncation == "mask":
            loss_mask = action_mask & ~batch.truncated[:, None]
        if self.config.void_turns == "mask":  # SimpleTIR: a void-turn episode gives no gradient
            loss_mask = loss_mask & ~batch.void[:, None]
        logp_old, alpha, reused = self._old_logp(batch, loss_mask)
        values_old = self._values_old(batch, loss_mask)
        log_w = log_ratio(logp_old, batch.logp_behav, action_mask)
        bootstrap = None
        if self.config.truncation == "bootstrap" and self.critic is not None:
            with eval_mode(self.critic):
                bootstrap = torch.where(batch.truncated, self.fwd.last_values(self.critic, batch), 0.0)
        adv = compute_advantages(
            self.method.advantage,
            rewards=batch.token_rewards,
            values=values_old if self.critic is not None else None,
            log_w=log_w,
            action_mask=action_mask,
            scores=batch.scores,
            group_ids=batch.group_ids,
            bootstrap_value=bootstrap,
            stats_mask=loss_mask,
            oracle=batch.oracle_advantages,
        )
        return StepTensors(
            logp_old=logp_old.detach(),
            values_old=values_old.detach(),
            log_w=log_w.detach(),
            advantages=zero_where_not(loss_mask, adv.advantages.detach()),
            returns=zero_where_not(loss_mask, adv.returns.detach()),
            loss_mask=loss_mask,
            adv_stats=adv.stats,
            alpha=alpha,
            ratio_from_first=(not self.method.needs_old_forward
                              or (alpha is not None and not self.method.advantage.needs_old_forward)),
            reused_rows=reused,
        )

    # ------------------------------------------------------------------ updates
    def _generator(self, salt: int) -> torch.Generator | None:
        if not self.config.shuffle:
            return None
        return torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.steps_done * 1_009 + salt)

    def _minibatches(self, mask: torch.Tensor, count: int, salt: int) -> list[Minibatch]:
        return split_minibatches(mask, count, generator=self._generator(salt))

    def _critic_updates(self, batch: TrainBatch, st: StepTensors) -> dict[str, float]:
        assert self.critic is not None and self.critic_optimizer is not None
        critic_cfg = self.method.critic
        assert critic_cfg is not None  # a trainer with a critic has a method with a CriticConfig
        epochs = self.config.critic_updates or critic_cfg.updates_per_step
        losses, norms = [], []
        stats_acc: dict[str, float] = {}
        tokens = 0
        seen_returns: list[torch.Tensor] = []  # the loss tokens' G and V as each minibatch's forward saw them
        seen_values: list[torch.Tensor] = []
        for epoch in range(epochs):
            for mb in self._minibatches(st.loss_mask, self.config.critic_minibatches, salt=1 + epoch):
                self.critic_optimizer.zero_grad(set_to_none=True)
                for rows in self.fwd.pieces(batch, mb.index):
                    length = trim_length(rows, batch.attention_mask)
                    kept = self._early_values.pop(tuple(rows.tolist()), None)
                    values = (kept if kept is not None else self.fwd.values(self.critic, batch, rows)).float()
                    mask = st.loss_mask[rows, :length]
                    res = value_loss(critic_cfg, ValueInputs(
                        values=values,
                        values_old=st.values_old[rows, :length],
                        returns=st.returns[rows, :length],
                        action_mask=mask,
                        num_tokens=mb.num_tokens,
                        num_seqs=mb.num_seqs,
                    ))
                    res.loss.backward()
                    losses.append(float(res.loss.detach()))
                    local = int(mask.sum())
                    tokens += local
                    accumulate(stats_acc, {k: v for k, v in res.stats.items() if k != m.VALUE_EXPLAINED_VAR},
                               weight=local)
                    seen_returns.append(st.returns[rows, :length][mask])
                    seen_values.append(values.detach()[mask])
                norms.append(clip_grad(self.critic, self.config.critic_max_grad_norm))
                self.critic_optimizer.step()
        if self._early_values:
            raise RuntimeError("critic_forward_reuse: a kept critic forward was not used; the minibatch "
                               "split changed")
        # token means over the whole step (every minibatch made, every epoch), whatever the minibatch and
        # micro-batch sizes; the loss is the mean over the optimizer steps taken
        out = {k: v / max(tokens, 1) for k, v in stats_acc.items()}
        if seen_returns:
            flat_g, flat_v = torch.cat(seen_returns)[None], torch.cat(seen_values)[None]
            every = torch.ones_like(flat_g, dtype=torch.bool)
            out[m.VALUE_EXPLAINED_VAR] = float(explained_variance(flat_g, flat_v, every))
        out[m.LOSS_VALUE] = sum(losses) / max(len(norms), 1)
        out[m.GRAD_CRITIC_NORM] = sum(norms) / max(len(norms), 1)
        return out

    def _actor_loss(
        self, batch: TrainBatch, st: StepTensors, rows: torch.Tensor, mb: Minibatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The actor loss of micro-batch ``rows``, its stats, and what the first-minibatch ``ratio/...``
        diagnostics read (``[b, t]`` detached): ``cur``, or the micro-batch's ``old`` under ``loglinear``.

        The forward is the one kept from the step start when ``old_forward_reuse`` took ``old`` from it."""
        length = trim_length(rows, batch.attention_mask)
        mask = st.loss_mask[rows, :length]
        early = self._early.pop(tuple(rows.tolist()), None)
        if early is None:
            early = self.fwd.logp_entropy(self.policy, batch, rows, entropy=self.config.entropy_coef != 0)
        logp, entropy = early
        logp_old = st.logp_old[rows, :length]
        if st.alpha is not None:  # A-3PO: interpolate towards this forward's own (detached) log-probs
            logp_old = loglinear_logp(batch.logp_behav[rows, :length], logp, st.alpha[rows, :length],
                                      batch.action_mask[rows, :length])
        res = policy_loss(self.method.policy, PolicyInputs(
            logp=logp,
            logp_old=logp_old if self.method.needs_old_forward else None,
            logp_behav=batch.logp_behav[rows, :length],
            advantages=st.advantages[rows, :length],
            action_mask=mask,
            num_tokens=mb.actor_tokens,
            num_seqs=mb.num_seqs,
        ))
        loss, stats = res.loss, dict(res.stats)
        # stats are this micro-batch's own token means (the caller weights them by its token share); the
        # loss terms divide by the minibatch's global count
        local = max(int(mask.sum()), 1)
        if self.config.kl_coef > 0:
            assert self.reference is not None
            with torch.no_grad():
                logp_ref = self.fwd.logp(self.reference, batch, rows)
            # k3 estimator of KL(pi || ref) on action tokens: r - 1 - log r >= 0 with r = ref / cur.
            kl = k3_from_log(log_ratio(logp_ref, logp, mask)).sum()
            loss = loss + self.config.kl_coef * kl / max(mb.num_tokens, 1)
            stats[m.LOSS_KL] = kl.detach() / local
        if entropy is not None:
            ent = zero_where_not(mask, entropy).sum()
            loss = loss - self.config.entropy_coef * (ent / max(mb.num_tokens, 1))
            stats[m.LOSS_ENTROPY] = ent.detach() / local
        return loss, stats, (logp_old if st.alpha is not None else logp).detach()

    def _actor_updates(self, batch: TrainBatch, st: StepTensors) -> dict[str, float]:
        count = self._actor_minibatch_count()
        stats_acc: dict[str, float] = {}
        tokens = 0
        losses, norms = [], []
        ratio_stats: dict[str, float] = {}
        for epoch in range(self.config.ppo_epochs):
            for mb in self._minibatches(st.loss_mask, count, salt=100 + epoch):
                mb = self._actor_denominator(batch, st, mb)
                first = (epoch == 0 and not ratio_stats and st.ratio_from_first
                         and bool(st.loss_mask[mb.index].any()))
                cur = torch.zeros(batch.input_ids.shape) if first else None  # by row: pieces may reorder
                self.actor_optimizer.zero_grad(set_to_none=True)
                for rows in self.fwd.pieces(batch, mb.index):
                    loss, stats, probe = self._actor_loss(batch, st, rows, mb)
                    loss.backward()
                    losses.append(float(loss.detach()))
                    local = int(st.loss_mask[rows].sum())
                    tokens += local
                    accumulate(stats_acc, stats, weight=local)
                    if cur is not None:
                        cur[rows, : probe.shape[1]] = probe.float()
                if cur is not None:
                    adv = self.method.advantage
                    ratio_stats = current_ratio_stats(cur[mb.index], batch.logp_behav[mb.index],
                                                      st.loss_mask[mb.index],
                                                      clip_low=adv.ratio_low, clip_high=adv.ratio_high)
                norms.append(clip_grad(self.policy, self.config.max_grad_norm))
                self.actor_optimizer.step()
                self.proximal.after_actor_update(self.policy)
        if self._early:
            raise RuntimeError("old_forward_reuse: a kept first forward was not used; the minibatch split "
                               "changed")
        # token means over the whole step (every minibatch made, every epoch); the loss is the mean over
        # the optimizer steps taken (fewer than asked when the batch has fewer rows than minibatches)
        out = {k: v / max(tokens, 1) for k, v in stats_acc.items()} | ratio_stats
        out[m.LOSS_POLICY] = sum(losses) / max(len(norms), 1)
        out[m.GRAD_ACTOR_NORM] = sum(norms) / max(len(norms), 1)
        return out

    @property
    def warmup_steps(self) -> int:
        """Critic warm-up steps: the config's when set (>= 0), else the method preset's."""
        if self.config.critic_warmup_steps >= 0:
            return self.config.critic_warmup_steps
        return self.method.critic.warmup_steps if self.method.critic is not None else 0

    def _actor_denominator(self, batch: TrainBatch, st: StepTensors, mb: Minibatch) -> Minibatch:
        """The minibatch with its GLOBAL actor denominator (``policy.denominator``: all or kept tokens)."""
        idx = mb.index
        tokens = count_loss_tokens(
            self.method.policy,
            logp_old=st.logp_old[idx] if self.method.needs_old_forward else None,
            logp_behav=batch.logp_behav[idx],
            action_mask=st.loss_mask[idx],
        )
        return replace(mb, loss_tokens=int(tokens))

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One training step (module docstring); returns its metrics and advances :attr:`version`."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        self.policy.train()
        try:
            with PEAKS.phase("prepare"):
                st = self.prepare(batch)
            metrics = step_diagnostics(batch, loss_mask=st.loss_mask, returns=st.returns,
                                       values_old=st.values_old,
                                       log_w=st.log_w, critic=self.critic is not None)
            metrics.update({k: float(v) for k, v in st.adv_stats.items()})
            actor_trains = self.steps_done >= self.warmup_steps
            if st.ratio_from_first or not bool(st.loss_mask.any()):
                # old := mu here (or no loss token), so the advantage channel's ratio/... and the value bias
                # are 0 and 1 by construction: the actor's first minibatch with loss tokens measures the
                # ratio/..., and the value bias (a whole-batch weighting) is left out
                metrics = {k: v for k, v in metrics.items()
                           if not k.startswith("ratio/") and k not in (m.CRITIC_VALUE_BIAS,
                                                                       m.CRITIC_VALUE_BIAS_GAP)}
            # ESS per actor minibatch, as the first-minibatch methods measure it (diagnostics.minibatch_ess)
            else:
                metrics.update(minibatch_ess(st.log_w, st.loss_mask,
                                             self._minibatches(st.loss_mask, self._actor_minibatch_count(),
                                                               salt=100)))
            if self.critic is not None:
                self.critic.train()
                with PEAKS.phase("critic"):
                    metrics.update(self._critic_updates(batch, st))
            metrics[m.TRAIN_ACTOR_FROZEN] = float(not actor_trains)
            counted = st.loss_mask
            metrics[m.ADV_MEAN] = float(masked_mean(st.advantages, counted))
            metrics[m.ADV_STD] = float(masked_var(st.advantages, counted).sqrt())
            if actor_trains:
                with PEAKS.phase("actor"):
                    metrics.update(self._actor_updates(batch, st))
        finally:
            self._early.clear()  # never hold a graph past its step
            self._early_values.clear()
        if self.config.old_forward_reuse:
            metrics[m.PROXIMAL_REUSED_ROWS_FRAC] = st.reused_rows / batch.batch_size
        self.version += 1
        self.steps_done += 1
        metrics[m.TRAIN_VERSION] = float(self.version)
        self.proximal.after_step(self.version, self.policy)
        metrics.update(self.proximal.metrics())
        elapsed = time.perf_counter() - start
        metrics[m.TIME_TRAIN] = elapsed
        metrics[m.TIME_TRAIN_CPU] = time.thread_time() - cpu_start
        metrics[m.PERF_TRAIN_TOKENS_PER_S] = int(batch.attention_mask.sum()) / max(elapsed, 1e-9)
        return metrics
