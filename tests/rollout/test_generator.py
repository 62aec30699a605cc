"""RolloutGenerator: dynamic sampling (DAPO) and overlong shaping, with the tiny model and a scripted task.

The scripted task decides rewards by the prompt's kind, not by what the model writes, so which groups
are informative is known exactly: ``mixed`` prompts give rewards 0, 1, 0, 1 ... to the episodes of a
group (informative), ``right`` / ``wrong`` give every episode 1 / 0 (no signal). The episode ends after
one turn; its length is whatever the tiny model samples (overlong shaping reads it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from copc import tracking as m
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rewards.shaping import overlong_penalty
from copc.rollout.generator import (
    DynamicSamplingConfig,
    GeneratedBatch,
    OverlongShapingConfig,
    RolloutConfig,
    RolloutGenerator,
    batch_prompts,
    batch_seed,
    round_seed,
)
from copc.tasks.base import Split
from copc.types import Prompt
from reference.scripted_env import ScriptedEnv

REWARD = {"right": 1.0, "wrong": 0.0}


class ScriptedTask:
    """Rewards by prompt kind (module docstring); the k-th env made for a ``mixed`` prompt gets k % 2."""

    name = "scripted"

    def __init__(self, kinds: list[str]) -> None:
        self.pool = [Prompt(id=f"p{i}", text=f"q{i} {kind}:", answers=("1",), meta={"kind": kind})
                     for i, kind in enumerate(kinds)]
        self.calls: Counter[str] = Counter()

    def prompts(self, split: Split, n: int | None = None) -> list[Prompt]:
        return self.pool[:n]

    def make_env(self, prompt: Prompt) -> ScriptedEnv:
        kind = str(prompt.meta["kind"])
        k = self.calls[prompt.id]
        self.calls[prompt.id] += 1
        if kind == "infra":  # informative, but the first episode's tool call failed for the machine
            return ScriptedEnv(prompt, float(k % 2), {"tool_infra_errors": 1.0} if k == 0 else None)
        return ScriptedEnv(prompt, float(k % 2) if kind == "mixed" else REWARD[kind])


def rollout_config(*, ds: bool | None = True, rounds: int = 4, overlong: bool | None = False,
                   **kw: object) -> RolloutConfig:
    base = dict(prompts_per_batch=3, group_size=4, max_turns=1, max_new_tokens_per_turn=8, max_total_tokens=8,
                context_limit=64, dynamic_sampling=DynamicSamplingConfig(enabled=ds, max_rounds=rounds),
                overlong=OverlongShapingConfig(enabled=overlong))
    base.update(kw)
    return RolloutConfig(**base)  # type: ignore[arg-type]


def generator(kinds: list[str], config: RolloutConfig, *, seed: int = 7) -> RolloutGenerator:
    tok = build_tiny_tokenizer()
    return RolloutGenerator(build_tiny_model(tok, seed=0), tok, ScriptedTask(kinds), config,
                            seed=seed)  # type: ignore[arg-type]


def groups_of(batch: GeneratedBatch) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for t in batch.trajectories:
        out.setdefault(t.group, []).append(t.reward)
    return out


def assert_same_batch(a: GeneratedBatch, b: GeneratedBatch) -> None:
    assert len(a.trajectories) == len(b.trajectories)
    for x, y in zip(a.trajectories, b.trajectories, strict=True):
        assert (x.prompt_id, x.group, x.reward) == (y.prompt_id, y.group, y.reward)
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.logp_behav, y.logp_behav)
        assert torch.equal(x.token_rewards, y.token_rewards)
    assert a.info == b.info
    assert [p.id for p in a.rejected] == [p.id for p in b.rejected]


KINDS = ["mixed", "right", "wrong", "right"] * 10  # 40 prompts, a quarter informative


def test_filtered_batch_is_full_of_informative_whole_groups() -> None:
    cfg = rollout_config(rounds=20)
    batch = generator(KINDS, cfg).generate(5)
    groups = groups_of(batch)
    # P whole groups of G, ids j * P + k, every one with differing rewards.
    assert sorted(groups) == [15, 16, 17]
    assert all(len(r) == 4 and len(set(r)) == 2 for r in groups.values())
    assert len({t.prompt_id for t in batch.trajectories}) == 3
    info = batch.info
    assert info[m.ROLLOUT_DYNSAMPLE_SHORT] == 0.0 and info[m.ROLLOUT_DYNSAMPLE_PADDED_GROUPS] == 0.0
    # Bookkeeping: every generated group is either in the batch or dropped, and each dropped
    # trajectory's prompt is handed back.
    generated = 3 + info[m.ROLLOUT_DYNSAMPLE_EXTRA_GROUPS]
    assert info[m.ROLLOUT_DYNSAMPLE_DROPPED_GROUPS] == generated - 3 > 0
    assert len(batch.rejected) == 4 * info[m.ROLLOUT_DYNSAMPLE_DROPPED_GROUPS]
    assert info[m.ROLLOUT_DYNSAMPLE_ROUNDS] >= 2
    assert not {p.id for p in batch.rejected} & {t.prompt_id for t in batch.trajectories}


def test_filtered_batch_is_identical_across_generators_and_orders() -> None:
    cfg = rollout_config(rounds=20)
    first, second = generator(KINDS, cfg), generator(KINDS, cfg)
    a5, a2 = first.generate(5), first.generate(2)
    b2, b5 = second.generate(2), second.generate(5)  # other order, other process state
    assert_same_batch(a5, b5)
    assert_same_batch(a2, b2)
    assert a5.info[m.ROLLOUT_DYNSAMPLE_ROUNDS] >= 2  # the extra rounds were exercised


def test_nothing_dropped_means_the_unfiltered_batch() -> None:
    kinds = ["mixed"] * 12
    on = generator(kinds, rollout_config(ds=True)).generate(3)
    off = generator(kinds, rollout_config(ds=False)).generate(3)
    assert_same_batch(replace(on, info={}), off)
    assert on.info[m.ROLLOUT_DYNSAMPLE_ROUNDS] == 1.0 and on.info[m.ROLLOUT_DYNSAMPLE_EXTRA_GROUPS] == 0.0
    assert off.info == {} and off.rejected == []
    # Round 0 samples with the batch's own seed: batch identity without dynamic sampling is unchanged.
    assert round_seed(7, 3, 0) == batch_seed(7, 3) and round_seed(7, 3, 1) != batch_seed(7, 3)


def test_cap_hit_goes_ahead_padded_with_the_first_flat_groups_and_is_counted() -> None:
    kinds = ["right", "wrong"] * 20  # no informative prompt at all
    off = generator(kinds, rollout_config(ds=False)).generate(1)
    batch = generator(kinds, rollout_config(rounds=3)).generate(1)
    info = batch.info
    # 3 rounds of P = 3 prompts each (no informative group: the shortfall is scaled up to the cap P).
    assert info[m.ROLLOUT_DYNSAMPLE_ROUNDS] == 3.0 and info[m.ROLLOUT_DYNSAMPLE_EXTRA_GROUPS] == 6.0
    assert info[m.ROLLOUT_DYNSAMPLE_SHORT] == 1.0 and info[m.ROLLOUT_DYNSAMPLE_PADDED_GROUPS] == 3.0
    assert info[m.ROLLOUT_DYNSAMPLE_DROPPED_GROUPS] == 6.0 and len(batch.rejected) == 24
    # The padding is round 0's groups, in order: the batch is the unfiltered batch.
    assert_same_batch(replace(batch, info={}, rejected=[]), off)


def test_pool_exhaustion_stops_the_rounds() -> None:
    kinds = ["right", "right", "wrong", "right"]  # P = 3 of 4 prompts; one left for round 1
    batch = generator(kinds, rollout_config(rounds=10)).generate(0)
    assert (
        batch.info[m.ROLLOUT_DYNSAMPLE_ROUNDS] == 2.0 and batch.info[m.ROLLOUT_DYNSAMPLE_EXTRA_GROUPS] == 1.0)
    assert batch.info[m.ROLLOUT_DYNSAMPLE_SHORT] == 1.0
    assert len(batch.trajectories) == 12


def test_partial_shortfall_asks_for_the_scaled_shortfall() -> None:
    # Round 0 of batch 0 has some informative groups; round 1 asks for ceil(shortfall * generated / kept)
    # prompts, capped at P: check the recorded extra groups against that rule, round by round.
    kinds = ["mixed", "right", "right", "wrong"] * 10
    gen = generator(kinds, rollout_config(rounds=2))
    batch = gen.generate(4)
    pool = {p.id: str(p.meta["kind"]) for p in gen.pool}
    first = batch_prompts(gen.pool, 7, 4, 3)
    kept0 = sum(pool[p.id] == "mixed" for p in first)
    want_extra = 0 if kept0 >= 3 else min(3, -(-(3 - kept0) * 3 // max(kept0, 1)))
    assert batch.info[m.ROLLOUT_DYNSAMPLE_EXTRA_GROUPS] == want_extra


def test_overlong_shaping_adds_the_penalty_to_reward_and_last_token() -> None:
    kinds = ["right"] * 12
    cfg = replace(rollout_config(ds=False, max_total_tokens=8),
                  overlong=OverlongShapingConfig(enabled=True, cache_tokens=4))
    assert cfg.overlong_lengths == (8, 4)  # L_max = the rollout budget by default
    shaped = generator(kinds, cfg).generate(0)
    raw = generator(kinds, replace(cfg, overlong=OverlongShapingConfig(enabled=False))).generate(0)
    penalties = []
    for s, r in zip(shaped.trajectories, raw.trajectories, strict=True):
        want = overlong_penalty(r.num_action_tokens, max_len=8, cache_len=4)
        penalties.append(want)
        assert s.reward == pytest.approx(r.reward + want, abs=1e-12)
        delta = s.token_rewards - r.token_rewards
        assert delta[:-1].abs().max() == 0 and float(delta[-1]) == pytest.approx(want, abs=1e-6)
    assert min(penalties) < 0 < len(penalties)  # the tiny model does write long answers here
    assert shaped.info[m.ROLLOUT_OVERLONG_PENALTY] == pytest.approx(sum(penalties) / len(penalties),
                                                                    abs=1e-12)


def test_filtering_reads_the_reward_before_shaping() -> None:
    # All-correct groups stay uninformative even though the length penalty makes their rewards differ.
    kinds = ["right"] * 12
    cfg = replace(rollout_config(rounds=2, max_total_tokens=8),
                  overlong=OverlongShapingConfig(enabled=True, cache_tokens=7))
    batch = generator(kinds, cfg).generate(0)
    assert batch.info[m.ROLLOUT_DYNSAMPLE_SHORT] == 1.0
    assert len({t.reward for t in batch.trajectories}) > 1  # shaped rewards differ


def test_config_rules() -> None:
    with pytest.raises(ValueError, match="group_size >= 2"):
        rollout_config(group_size=1)
    rollout_config(group_size=1, ds=None)  # None: decided later by the method
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSamplingConfig(max_rounds=0)
    with pytest.raises(ValueError, match="cache_tokens"):
        RolloutConfig(max_total_tokens=8, overlong=OverlongShapingConfig(cache_tokens=9))
    unset = RolloutConfig()
    on = unset.with_method_defaults(dynamic_sampling=True, overlong_shaping=True)
    assert on.dynamic_sampling.enabled and on.overlong.enabled
    explicit = replace(unset, dynamic_sampling=DynamicSamplingConfig(enabled=False))
    resolved = explicit.with_method_defaults(dynamic_sampling=True, overlong_shaping=False)
    assert resolved.dynamic_sampling.enabled is False and resolved.overlong.enabled is False


def test_infra_failures_keep_or_drop_their_group_and_are_counted() -> None:
    kinds = ["mixed", "infra", "mixed", "mixed"]
    kept = generator(kinds, rollout_config(ds=False, prompts_per_batch=4)).generate(0)
    assert len(kept.trajectories) == 16
    assert sum(t.info.get("tool_infra_errors", 0.0) for t in kept.trajectories) == 1.0
    dropped = generator(kinds, rollout_config(ds=False, prompts_per_batch=4,
                                              infra_failures="drop")).generate(0)
    assert len(dropped.trajectories) == 12  # the group of the failed episode is gone, whole
    assert all(t.info.get("tool_infra_errors", 0.0) == 0 for t in dropped.trajectories)
    assert dropped.info["rollout/infra_dropped_groups"] == 1.0
    assert len(dropped.rejected) == 4 and {p.meta["kind"] for p in dropped.rejected} == {"infra"}
    with pytest.raises(ValueError, match=r"rollout\.infra_failures must be one of 'keep', 'drop'"):
        rollout_config(infra_failures="ignore")
