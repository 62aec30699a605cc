"""The multi-turn episode loop with a scripted env and the tiny model."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from copc.models.hf import token_logprobs
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine
from copc.rollout.episode import run_episodes
from copc.rollout.episode_state import truncation_stats
from copc.rollout.sampling import SamplingConfig
from copc.types import EnvStep, StopReason, Trajectory

# Frequent characters end a turn after a few sampled tokens (the random tiny model is near-uniform).
SHORT_TURNS = tuple("aeiou etn")
ATOL = 1e-5  # KV-cached sampling vs one full teacher-forced forward, fp32


class ScriptedEnv:
    """Test env: the 'tool' echoes the length of the turn; done with reward 1 at turn ``answer_turn``.

    Records every call so a test can rebuild the trajectory from what the env saw and returned.
    """

    def __init__(
        self,
        prompt: str,
        *,
        stops: tuple[str, ...] = SHORT_TURNS,
        answer_turn: int = 3,
        fail_turn: int | None = None,
        step_reward: float = 0.25,
    ) -> None:
        self.prompt, self.stops, self.answer_turn = prompt, stops, answer_turn
        self.fail_turn, self.step_reward = fail_turn, step_reward
        self.actions: list[str] = []
        self.observations: list[str] = []
        self.finished: list[StopReason] = []

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stops

    def initial_text(self) -> str:
        return self.prompt

    def step(self, action_text: str) -> EnvStep:
        self.actions.append(action_text)
        turn = len(self.actions)
        if turn == self.fail_turn:
            raise RuntimeError("tool crashed")
        if turn >= self.answer_turn:
            return EnvStep(observation=None, done=True, reward=1.0, info={"turns": turn, "correct": 1.0})
        obs = f"<output>{len(action_text)}\n</output>"
        self.observations.append(obs)
        return EnvStep(observation=obs, done=False, reward=self.step_reward, info={"tool_calls": float(turn)})

    def finish(self, reason: StopReason) -> EnvStep:
        self.finished.append(reason)
        return EnvStep(observation=None, done=True, reward=-0.5, info={"correct": 0.0})


PROMPTS = ["Q: 2+2?\n", "Compute 17*3 please.\n", "x\n"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture()
def engine(tok):
    return Engine(build_tiny_model(tok, seed=2), tok)


def _run(engine, envs, **kw) -> list[Trajectory]:
    limits = {"max_turns": 5, "max_new_tokens_per_turn": 40, "max_total_tokens": 120, "context_limit": 400,
              "seed": 2}
    return run_episodes(engine, envs, **{**limits, **kw})


def _segments(traj: Trajectory) -> list[tuple[bool, list[int]]]:
    """Maximal runs of equal action_mask after the prompt: [(is_action, token ids), ...]."""
    out: list[tuple[bool, list[int]]] = []
    for tok_id, m in zip(traj.token_ids[traj.prompt_len :].tolist(),
                         traj.action_mask[traj.prompt_len :].tolist(), strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(tok_id)
        else:
            out.append((m, [tok_id]))
    return out


def test_trajectory_is_exactly_prompt_turns_and_observations(engine, tok) -> None:
    envs = [ScriptedEnv(p) for p in PROMPTS]
    trajs = _run(engine, envs, prompt_ids=["a", "b", "c"], group_ids=[0, 0, 1])
    for env, traj in zip(envs, trajs, strict=True):
        assert traj.stop_reason is StopReason.ANSWER
        assert traj.token_ids[: traj.prompt_len].tolist() == tok.encode(env.prompt)
        assert not traj.action_mask[: traj.prompt_len].any()
        segments = _segments(traj)
        # Alternating: turn, observation, turn, observation, final turn.
        assert [m for m, _ in segments] == [True, False, True, False, True]
        for (_, ids), action in zip(segments[0::2], env.actions, strict=True):
            # the env reads the turn up to the stop string; a tag token ("</python>") may run past it
            assert tok.decode(ids).startswith(action) and len(tok.decode(ids)) - len(action) < len(
                "</python>")
            # every stepped turn stopped on its own (a cut one is not stepped)
            assert action[-1] in SHORT_TURNS
        for (_, ids), obs in zip(segments[1::2], env.observations, strict=True):
            assert ids == tok.encode(obs, add_special_tokens=False)
        assert traj.info["policy_turns"] == 3 and traj.info["turns"] == 3 and traj.info["tool_calls"] == 2
        assert traj.info["gen_tokens"] == traj.num_action_tokens
    assert [t.prompt_id for t in trajs] == ["a", "b", "c"] and [t.group for t in trajs] == [0, 0, 1]


def test_masks_versions_and_logp_match_a_teacher_forced_pass(engine, tok) -> None:
    engine.load_weights(build_tiny_model(tok, seed=9).state_dict(), version=4)
    trajs = _run(engine, [ScriptedEnv(p) for p in PROMPTS])
    for traj in trajs:
        mask = traj.action_mask
        assert (traj.policy_version[mask] == 4).all() and (traj.policy_version[~mask] == -1).all()
        assert (traj.logp_behav[~mask] == 0).all() and (traj.logp_behav[mask] < 0).all()
        ids = traj.token_ids.unsqueeze(0)
        with torch.no_grad():
            forced = token_logprobs(engine.model, ids, torch.ones_like(ids, dtype=torch.bool)).logp[0]
        # The ids are what the model saw, so the recorded log-probs are the teacher-forced ones.
        torch.testing.assert_close(traj.logp_behav[mask], forced[mask], atol=ATOL, rtol=0)


def test_rewards_land_where_they_arrive(engine) -> None:
    (traj,) = _run(engine, [ScriptedEnv(PROMPTS[0], step_reward=0.25)])
    turn_ends = [i for i in range(traj.num_tokens - 1) if traj.action_mask[i] and not traj.action_mask[i + 1]]
    assert traj.token_rewards.nonzero().flatten().tolist() == [*turn_ends, traj.num_tokens - 1]
    assert traj.token_rewards[turn_ends].tolist() == [0.25, 0.25]
    assert traj.token_rewards[-1] == 1.0 and traj.reward == 1.5
    assert traj.token_rewards.sum() == traj.reward


def test_same_seed_same_trajectories_and_batch_independence(engine) -> None:
    a = _run(engine, [ScriptedEnv(p) for p in PROMPTS], seed=3)
    b = _run(engine, [ScriptedEnv(p) for p in PROMPTS], seed=3)
    c = _run(engine, [ScriptedEnv(p) for p in PROMPTS], seed=4)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.logp_behav, y.logp_behav)
    assert any(not torch.equal(x.token_ids, y.token_ids) for x, y in zip(a, c, strict=True))
    # Episode 0 alone draws the same tokens as inside the batch (seeds are per episode and turn).
    (alone,) = _run(engine, [ScriptedEnv(PROMPTS[0])], seed=3)
    assert torch.equal(alone.token_ids, a[0].token_ids)


def test_episodes_are_batched_in_one_engine_call_per_round(engine) -> None:
    sizes: list[int] = []
    original = engine.generate

    def counting_generate(prompts, config, **kw):
        sizes.append(len(prompts))
        return original(prompts, config, **kw)

    engine.generate = counting_generate
    answer_turns = [1, 3, 2]
    envs = [ScriptedEnv(p, answer_turn=k) for p, k in zip(PROMPTS, answer_turns, strict=True)]
    _run(engine, envs)
    assert sizes == [3, 2, 1]


def test_stop_reasons_for_each_budget(engine, tok) -> None:
    (turns,) = _run(engine, [ScriptedEnv(PROMPTS[1], answer_turn=10)], max_turns=2)
    assert turns.stop_reason is StopReason.MAX_TURNS and turns.info["policy_turns"] == 2
    # The episode's token budget (12) cuts the third turn: that turn is not stepped.
    env = ScriptedEnv(PROMPTS[1], stops=("a",), answer_turn=10)
    (tokens,) = _run(engine, [env], max_total_tokens=12, seed=1)
    assert tokens.stop_reason is StopReason.MAX_TOKENS and tokens.num_action_tokens == 12
    assert env.finished == [StopReason.MAX_TOKENS] and len(env.actions) == tokens.info["policy_turns"] - 1
    # the episode's budget, not the turn's
    assert tokens.info["cut_turns"] == 1 and tokens.info["turn_cut"] == 0
    assert tokens.token_rewards[-1] == -0.5 and tokens.reward == len(env.actions) * 0.25 - 0.5
    # Context window: the trajectory never exceeds it.
    prompt_len = len(tok.encode(PROMPTS[1]))
    (ctx,) = _run(engine, [ScriptedEnv(PROMPTS[1], stops=(), answer_turn=10)], context_limit=prompt_len + 20)
    assert ctx.stop_reason is StopReason.CONTEXT_LIMIT and ctx.num_tokens == prompt_len + 20
    (no_room,) = _run(engine, [ScriptedEnv(PROMPTS[1])], context_limit=prompt_len)
    assert no_room.stop_reason is StopReason.CONTEXT_LIMIT and no_room.num_action_tokens == 0


def test_turn_cut_by_the_per_turn_limit_is_truncated_not_graded(engine) -> None:
    # No stop strings: the first turn runs into its per-turn budget of 5 with episode budget to spare.
    env = ScriptedEnv(PROMPTS[1], stops=(), answer_turn=1)
    (traj,) = _run(engine, [env], max_new_tokens_per_turn=5)
    # Not stepped (answer_turn=1 would have graded it as the answer, reward 1): truncated, finish() grades it.
    assert env.actions == [] and env.finished == [StopReason.MAX_TOKENS]
    assert traj.stop_reason is StopReason.MAX_TOKENS and traj.truncated and traj.reward == -0.5
    assert traj.num_action_tokens == 5 and traj.info["cut_turns"] == 1 and traj.info["turn_cut"] == 1


def test_turn_that_reaches_the_per_turn_limit_counts_when_the_episode_budget_ends_at_the_same_token(
        engine) -> None:
    # One-turn budgets (max_total_tokens == max_new_tokens_per_turn): the turn reaches both at token 6.
    env = ScriptedEnv(PROMPTS[1], stops=(), answer_turn=1)
    (traj,) = _run(engine, [env], max_new_tokens_per_turn=6, max_total_tokens=6)
    assert traj.stop_reason is StopReason.MAX_TOKENS and traj.num_action_tokens == 6
    # raising the per-turn limit alone would not help, but it was reached: turn_limit_frac must not read 0
    assert traj.info["cut_turns"] == 1 and traj.info["turn_cut"] == 1


def test_truncation_stats_per_turn_and_per_episode(engine) -> None:
    cut = ScriptedEnv(PROMPTS[0], stops=(), answer_turn=1)  # 1 turn, cut by the per-turn limit
    answered = ScriptedEnv(PROMPTS[1], answer_turn=3)  # 3 turns, answered
    out_of_turns = ScriptedEnv(PROMPTS[2], answer_turn=10)  # 2 turns, MAX_TURNS (truncated, no turn cut)
    trajs = [
        *_run(engine, [cut], max_new_tokens_per_turn=5),
        *_run(engine, [answered]),
        *_run(engine, [out_of_turns], max_turns=2),
    ]
    assert [t.stop_reason for t in trajs] == [StopReason.MAX_TOKENS, StopReason.ANSWER, StopReason.MAX_TURNS]
    stats = truncation_stats(trajs)
    # Episodes: 2 of 3 truncated, 1 of 3 by the per-turn limit; turns: 1 cut of 1 + 3 + 2 = 6.
    assert stats == (2 / 3, 1 / 6, 1 / 3)
    assert truncation_stats([]) == (0.0, 0.0, 0.0)


def test_eos_turn_is_stepped_then_finished(tok) -> None:
    model = build_tiny_model(tok, seed=2)
    # Several EOS ids (as real models have): any vowel ends the sequence.
    model.generation_config.eos_token_id = [tok.eos_token_id, *tok.convert_tokens_to_ids(list("aeiou"))]
    env = ScriptedEnv(PROMPTS[0], stops=(), answer_turn=10)
    (traj,) = _run(Engine(model, tok), [env])
    assert traj.stop_reason is StopReason.EOS and env.finished == [StopReason.EOS]
    # Every turn was stepped; the last one ended on an EOS id, which is in the ids but not in the text.
    assert len(env.actions) == traj.info["policy_turns"]
    last_turn = _segments(traj)[-1]
    assert last_turn[0] and tok.convert_ids_to_tokens(last_turn[1][-1]) in "aeiou"
    assert env.actions[-1] == tok.decode(last_turn[1][:-1])


def test_raising_env_is_contained(engine) -> None:
    reference = _run(engine, [ScriptedEnv(p) for p in PROMPTS])
    envs = [ScriptedEnv(p) for p in PROMPTS]
    envs[1].fail_turn = 2
    trajs = _run(engine, envs)
    bad = trajs[1]
    assert bad.info["env_errors"] == 1 and bad.reward == 0.0 and not bad.token_rewards.any()
    assert bad.stop_reason is StopReason.ENV_ERROR and bad.info["policy_turns"] == 2
    # The failing turn's tokens are kept (what the model sampled); other episodes are untouched.
    assert bad.action_mask[-1]
    for i in (0, 2):
        assert torch.equal(trajs[i].token_ids,
                           reference[i].token_ids) and trajs[i].reward == reference[i].reward


def test_bad_arguments_say_what_to_do(engine) -> None:
    with pytest.raises(ValueError, match="max_turns"):
        _run(engine, [ScriptedEnv("x")], max_turns=0)
    with pytest.raises(ValueError, match="one per env"):
        _run(engine, [ScriptedEnv("x")], group_ids=[0, 1])


def test_sampling_settings_reach_the_engine(engine, tok) -> None:
    (traj,) = _run(engine, [ScriptedEnv(PROMPTS[0])], sampling=SamplingConfig(temperature=0.7, top_k=1))
    # top_k = 1: every sampled token had probability 1 under the truncated distribution.
    assert (traj.logp_behav[traj.action_mask] == 0).all()


def test_budget_invariants_on_random_configurations(engine, tok) -> None:
    """Whatever the budgets: never more turns, generated tokens or context than allowed; masks consistent."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(6):
        def draw(lo: int, hi: int) -> int:
            return int(torch.randint(lo, hi, (1,), generator=rng))

        max_turns, per_turn, total, extra_ctx = draw(1, 4), draw(1, 10), draw(1, 25), draw(1, 40)
        envs = [ScriptedEnv(p, answer_turn=draw(1, 5)) for p in PROMPTS]
        context = max(len(tok.encode(p)) for p in PROMPTS) + extra_ctx
        limits = {"max_turns": max_turns, "max_new_tokens_per_turn": per_turn, "max_total_tokens": total}
        trajs = _run(engine, envs, context_limit=context, seed=trial, **limits)
        for env, traj in zip(envs, trajs, strict=True):
            assert traj.info["policy_turns"] <= max_turns
            assert traj.num_action_tokens == traj.info["gen_tokens"] <= total
            assert traj.num_tokens <= context
            assert (traj.policy_version[~traj.action_mask] == -1).all()
            assert (traj.policy_version[traj.action_mask] == engine.version).all()
            # The env saw exactly the turns it was stepped with, and grading happened exactly once.
            assert len(env.finished) + (traj.stop_reason is StopReason.ANSWER) == 1
            assert traj.token_rewards.sum().item() == pytest.approx(traj.reward)


def test_kv_reuse_across_turns_changes_nothing(engine) -> None:
    reused = _run(engine, [ScriptedEnv(p) for p in PROMPTS], seed=3, reuse_kv=True)
    fresh = _run(engine, [ScriptedEnv(p) for p in PROMPTS], seed=3, reuse_kv=False)
    for a, b in zip(reused, fresh, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.action_mask, b.action_mask)
        torch.testing.assert_close(a.logp_behav, b.logp_behav, atol=ATOL, rtol=0)
    # Several turns, so the reuse path really ran.
    assert all(t.info["policy_turns"] >= 2 for t in reused)



class _SlowEnv(ScriptedEnv):
    """A ScriptedEnv whose tool takes a while (as a sandboxed interpreter does); records overlap."""

    lock = threading.Lock()
    in_flight = 0
    max_in_flight = 0

    def step(self, action_text: str):  # type: ignore[no-untyped-def]
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        time.sleep(0.05)
        with cls.lock:
            cls.in_flight -= 1
        return super().step(action_text)


def test_env_steps_of_a_round_run_concurrently_and_change_nothing(engine) -> None:
    sequential = _run(engine, [_SlowEnv(p) for p in PROMPTS], env_workers=1)
    assert _SlowEnv.max_in_flight == 1
    concurrent = _run(engine, [_SlowEnv(p) for p in PROMPTS], env_workers=8)
    assert _SlowEnv.max_in_flight > 1  # the round's tool calls overlapped
    for a, b in zip(sequential, concurrent, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logp_behav, b.logp_behav)
        assert a.reward == b.reward and a.stop_reason == b.stop_reason
