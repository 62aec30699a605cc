"""Interruptible decoding (partial rollouts): weights swapped between decode chunks of running rows.

- a swap after chunk k stamps tokens 0..k-1 with the old version and the rest with the new one, and every
  token's behaviour log-prob equals its log-prob under the weights of its stamped version, recomputed by a
  slow loop (one unpadded forward of the whole prefix per token);
- refreshing without new weights changes nothing (same tokens, same log-probs);
- at the episode level, versions are picked up at turn boundaries and inside turns, observation tokens
  stay -1, and no token is lost or duplicated.
"""

from __future__ import annotations

import torch
from tests.rollout.test_episode import ScriptedEnv

from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine
from copc.rollout.episode import run_episodes
from copc.rollout.sampling import SamplingConfig

# KV-cached padded decoding vs one unpadded full forward in fp32: summation order differs, ~1e-6.
ATOL = 1e-5
TEMPERATURE = 1.3


class ScriptedRefresh:
    """Loads ``weights[c]`` (as version ``c + 1``) ... at the refresh calls listed in ``at_calls``."""

    def __init__(self, engine: Engine, weights: list[dict[str, torch.Tensor]], at_calls: list[int]) -> None:
        self.engine, self.weights, self.at_calls = engine, weights, at_calls
        self.calls = 0

    def __call__(self) -> bool:
        call, self.calls = self.calls, self.calls + 1
        if call not in self.at_calls:
            return False
        self.engine.load_weights(self.weights[self.at_calls.index(call)])
        return True


def _slow_logp(model: torch.nn.Module, prompt: list[int], generated: list[int], t: int) -> float:
    """log pi(generated[t] | prompt + generated[:t]) at TEMPERATURE, from one forward of that prefix alone."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated[:t]])).logits[0, -1].float()
    return float(torch.log_softmax(logits / TEMPERATURE, dim=-1)[generated[t]])


def test_swap_after_chunk_k_stamps_versions_and_exact_logp() -> None:
    tok = build_tiny_tokenizer()
    models = [build_tiny_model(tok, seed=s) for s in (0, 5, 9)]  # versions 0, 1, 2
    engine = Engine(build_tiny_model(tok, seed=0), tok)
    prompts = [tok.encode(p) for p in ("Compute 3+4.", "hi", "<python>print(1)</python>\n")]
    k, n_tokens = 3, 10
    # Refresh calls: 0 before the prefill, 1 after chunk 1 (step 3), 2 after chunk 2 (step 6), 3 at step 9.
    refresh = ScriptedRefresh(engine, [models[1].state_dict(), models[2].state_dict()], at_calls=[1, 2])
    config = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=n_tokens, ignore_eos=True)
    gens = engine.generate(prompts, config, seeds=[1, 2, 3], refresh=refresh, chunk_tokens=k)
    assert refresh.calls == 4
    expected = [0] * k + [1] * k + [2] * (n_tokens - 2 * k)
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.versions.tolist() == expected
        assert gen.token_ids.shape == gen.logp.shape == gen.versions.shape == (n_tokens,)
        ids = gen.token_ids.tolist()
        slow = [_slow_logp(models[v], prompt, ids, t) for t, v in enumerate(expected)]
        torch.testing.assert_close(gen.logp, torch.tensor(slow), atol=ATOL, rtol=0)


def test_a_swap_with_rows_that_finish_early_keeps_every_row_consistent() -> None:
    tok = build_tiny_tokenizer()
    new = build_tiny_model(tok, seed=5)
    engine = Engine(build_tiny_model(tok, seed=0), tok)
    prompts = [tok.encode(p) for p in ("Q: 2+2?\n", "x", "Compute 17*3 please.\n", "ab")]
    refresh = ScriptedRefresh(engine, [new.state_dict()], at_calls=[1])
    config = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=12, stop_strings=("\n",))
    gens = engine.generate(prompts, config, seeds=[4, 5, 6, 7], refresh=refresh, chunk_tokens=2,
                           return_kv=True)
    old = build_tiny_model(tok, seed=0)
    for prompt, gen in zip(prompts, gens, strict=True):
        ids, versions = gen.token_ids.tolist(), gen.versions.tolist()
        assert versions == [0] * min(2, len(ids)) + [1] * max(0, len(ids) - 2)
        slow = [_slow_logp(old if v == 0 else new, prompt, ids, t) for t, v in enumerate(versions)]
        torch.testing.assert_close(gen.logp, torch.tensor(slow), atol=ATOL, rtol=0)
        if gen.kv is not None:  # a row's cache is from the version that fed its last tokens
            assert gen.kv.version == versions[-1] and gen.kv.length == len(prompt) + len(ids) - 1


def test_refresh_without_new_weights_changes_nothing() -> None:
    tok = build_tiny_tokenizer()
    engine = Engine(build_tiny_model(tok, seed=0), tok)
    prompts = [tok.encode(p) for p in ("Compute 3+4.", "hi")]
    config = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=9)
    plain = engine.generate(prompts, config, seeds=[1, 2])
    chunked = engine.generate(prompts, config, seeds=[1, 2], refresh=lambda: False, chunk_tokens=2)
    for a, b in zip(plain, chunked, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.versions, b.versions)
        torch.testing.assert_close(a.logp, b.logp, atol=0, rtol=0)


def test_episodes_pick_up_versions_between_and_inside_turns() -> None:
    tok = build_tiny_tokenizer()
    models = [build_tiny_model(tok, seed=s) for s in (2, 6, 8, 11)]
    engine = Engine(build_tiny_model(tok, seed=2), tok)
    refresh = ScriptedRefresh(engine, [m.state_dict() for m in models[1:]], at_calls=[1, 3, 4])
    prompts = ["Q: 2+2?\n", "Compute 17*3 please.\n", "x\n"]
    envs = [ScriptedEnv(p, answer_turn=3) for p in prompts]
    trajs = run_episodes(engine, envs, max_turns=5, max_new_tokens_per_turn=20, max_total_tokens=60,
                         context_limit=400, seed=2, refresh=refresh, chunk_tokens=4,
                         sampling=SamplingConfig(temperature=TEMPERATURE))
    spanning = 0
    for traj, env in zip(trajs, envs, strict=True):
        versions = traj.policy_version
        assert torch.all(versions[~traj.action_mask] == -1)
        sampled = versions[traj.action_mask].tolist()
        assert sampled == sorted(sampled)  # a version never goes back inside a trajectory
        spanning += len(set(sampled)) > 1
        # Nothing lost or duplicated: the sampled tokens are exactly the turns the env saw.
        assert traj.num_action_tokens == traj.info["gen_tokens"]
        assert len(env.actions) == traj.info["policy_turns"] or traj.truncated
        ids, mask = traj.token_ids.tolist(), traj.action_mask.tolist()
        for t in range(traj.prompt_len, traj.num_tokens):
            if mask[t]:
                lp = _slow_logp(models[versions[t]], [], ids, t)  # the prefix ids[:t] holds the prompt
                assert abs(lp - float(traj.logp_behav[t])) <= ATOL
    assert spanning >= 1
    assert engine.version == 3
