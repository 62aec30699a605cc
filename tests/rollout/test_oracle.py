"""Continue-from-prefix replay and the Monte-Carlo advantage oracle (tiny model, scripted and real envs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine
from copc.rollout.episode import continue_episodes, run_episodes
from copc.rollout.oracle import mc_oracle
from copc.rollout.sampling import SamplingConfig
from copc.rollout.turns import ReplayError, boundary_lengths
from copc.tasks import get_task
from copc.types import EnvStep, StopReason, Trajectory


class ScriptedEnv:
    """Deterministic env: each turn's observation is its length; the 4th turn answers (reward 1), each
    earlier one earns 0.25, and ``finish`` costs 0.5."""

    def __init__(self, prompt: str, *, answer_turn: int = 4) -> None:
        self.prompt, self.answer_turn = prompt, answer_turn
        self.actions: list[str] = []
        self.observations: list[str] = []

    stop_strings = tuple("aeiou etn")  # the random tiny model ends a turn after a few tokens

    def initial_text(self) -> str:
        return self.prompt

    def step(self, action_text: str) -> EnvStep:
        self.actions.append(action_text)
        if len(self.actions) >= self.answer_turn:
            return EnvStep(observation=None, done=True, reward=1.0, info={})
        self.observations.append(obs := f"<output>{len(action_text)}\n</output>")
        return EnvStep(observation=obs, done=False, reward=0.25, info={})

    def finish(self, reason: StopReason) -> EnvStep:
        return EnvStep(observation=None, done=True, reward=-0.5, info={})

LIMITS = {"max_turns": 5, "max_new_tokens_per_turn": 40, "max_total_tokens": 120, "context_limit": 400}
PROMPTS = ["Q: 2+2?\n", "Compute 17*3 please.\n", "x\n", "Count the vowels.\n"]
GREEDY = SamplingConfig(top_k=1)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture()
def engine(tok):
    return Engine(build_tiny_model(tok, seed=2), tok)


def _record(engine, sampling=None) -> list[Trajectory]:
    envs = [ScriptedEnv(p, answer_turn=4) for p in PROMPTS]
    return run_episodes(engine, envs, seed=5, sampling=sampling, **LIMITS)


def test_continuing_from_every_boundary_with_the_recorded_seeds_gives_the_recorded_episode(engine) -> None:
    recorded = _record(engine)
    for i, traj in enumerate(recorded):
        bounds = boundary_lengths(engine, traj, ScriptedEnv("").stop_strings)
        assert bounds[0] == traj.prompt_len and bounds[-1] == traj.num_tokens
        for k in range(len(bounds) - 1):
            (again,) = continue_episodes(engine, [ScriptedEnv(PROMPTS[i], answer_turn=4)], [traj], [k],
                                         indices=[i],
                                         seed=5, **LIMITS)
            assert torch.equal(again.token_ids, traj.token_ids), (i, k)
            assert torch.equal(again.action_mask, traj.action_mask)
            assert torch.equal(again.token_rewards, traj.token_rewards)
            assert again.reward == traj.reward and again.stop_reason == traj.stop_reason


def test_replay_feeds_the_env_the_recorded_turns(engine) -> None:
    (traj,) = run_episodes(engine, [ScriptedEnv(PROMPTS[1], answer_turn=4)], seed=5, **LIMITS)
    first = ScriptedEnv(PROMPTS[1], answer_turn=4)
    run_episodes(engine, [first], seed=5, **LIMITS)
    replayed = ScriptedEnv(PROMPTS[1], answer_turn=4)
    continue_episodes(engine, [replayed], [traj], [2], seed=99, **LIMITS)
    assert replayed.actions[:2] == first.actions[:2]
    assert replayed.observations[:2] == first.observations[:2]


def test_a_changed_observation_is_refused(engine, tok) -> None:
    (traj,) = run_episodes(engine, [ScriptedEnv(PROMPTS[0], answer_turn=4)], seed=5, **LIMITS)
    ids = traj.token_ids.clone()
    obs = [i for i in range(traj.prompt_len, traj.num_tokens) if not bool(traj.action_mask[i])]
    ids[obs[1]] = tok.convert_tokens_to_ids("9") if int(ids[obs[1]]) != tok.convert_tokens_to_ids("9") else 5
    broken = dataclasses.replace(traj, token_ids=ids)
    with pytest.raises(ReplayError, match="observation after turn 1 differs"):
        continue_episodes(engine, [ScriptedEnv(PROMPTS[0], answer_turn=4)], [broken], [1], **LIMITS)
    assert mc_oracle(engine, lambda t: ScriptedEnv(PROMPTS[0], answer_turn=4), [broken, traj], samples=2,
                     **LIMITS)[0] is None


def test_greedy_oracle_values_are_the_episode_returns(engine) -> None:
    recorded = _record(engine, GREEDY)
    by_id = {str(i): p for i, p in enumerate(PROMPTS)}
    estimates = mc_oracle(engine, lambda t: ScriptedEnv(by_id[t.prompt_id], answer_turn=4), recorded,
                          samples=2,
                          sampling=GREEDY, seed=11, **LIMITS)
    for traj, est in zip(recorded, estimates, strict=True):
        assert est is not None
        # V(prompt) of a deterministic policy = its return
        assert float(est.values[0]) == pytest.approx(traj.reward)
        bounds = boundary_lengths(engine, traj, ScriptedEnv("").stop_strings)
        for k, start in enumerate(bounds[:-1]):
            assert float(est.values[k]) == pytest.approx(float(traj.token_rewards[start:].sum()))
        assert torch.equal(est.value_var, torch.zeros_like(est.value_var))
        # A_k = R_k + V_{k+1} - V_k = 0 for every turn the deterministic policy took
        assert float(est.advantages.abs().max()) == pytest.approx(0.0, abs=1e-6)


def test_sampled_chunk_advantages_sum_to_the_return_minus_the_prompt_value(engine) -> None:
    recorded = _record(engine)
    by_id = {str(i): p for i, p in enumerate(PROMPTS)}
    estimates = mc_oracle(engine, lambda t: ScriptedEnv(by_id[t.prompt_id], answer_turn=4), recorded,
                          samples=3,
                          seed=3, **LIMITS)
    for traj, est in zip(recorded, estimates, strict=True):
        assert est is not None
        k_n = int(est.chunk_ids.max()) + 1
        per_chunk = [float(est.advantages[(est.chunk_ids == k) & traj.action_mask][0]) for k in range(k_n)]
        assert sum(per_chunk) == pytest.approx(traj.reward - float(est.values[0]), abs=1e-5)


def _demo_trajectory(tok, demo) -> Trajectory:
    """A recorded trajectory laid out exactly as the episode loop lays out this demonstration."""
    ids, mask = [], []
    for j, seg in enumerate(demo.segments):
        piece = tok(seg.text, add_special_tokens=(j == 0))["input_ids"]
        ids += piece
        mask += [seg.is_action] * len(piece)
    n = len(ids)
    action = torch.tensor(mask)
    return Trajectory(prompt_id="demo", token_ids=torch.tensor(ids),
                      prompt_len=len(tok(demo.segments[0].text)["input_ids"]),
                      action_mask=action, logp_behav=torch.zeros(n), policy_version=torch.where(action, 0,
                                                                                                -1),
                      reward=0.0, token_rewards=torch.zeros(n), stop_reason=StopReason.ANSWER)


def test_kv_chain_replays_its_real_search_observations(engine, tok) -> None:
    task = get_task("kv_chain")
    demos = [d for d in task.sft_demos(40, seed=0) if d.kind == "tool"][:3]
    assert demos
    from copc.tasks.kv_chain import _search_tool  # the demonstrations' own world (sft_demos' stream)

    stream = f"sft/{task.config.seed}/0"
    tool = _search_tool(task.config, stream)
    from copc.tasks.tooling import search_env
    from copc.types import Prompt

    for demo in demos:
        traj = _demo_trajectory(tok, demo)
        prompt = Prompt(id="demo", text=demo.segments[0].text, answers=("0",))
        turns = sum(seg.is_action for seg in demo.segments) - 1  # every search turn (the answer ends it)
        (again,) = continue_episodes(engine, [search_env(prompt, tool, max_tool_calls=11)], [traj], [turns],
                                     seed=0, max_turns=12, max_new_tokens_per_turn=48, max_total_tokens=400,
                                     context_limit=900)
        prefix = boundary_lengths(engine, traj, ("</search>", "</answer>"))[turns]
        assert torch.equal(again.token_ids[:prefix], traj.token_ids[:prefix])
