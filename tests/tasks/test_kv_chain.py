"""The long-horizon task kv_chain: its world, splits, search keys, demonstrations and run budgets."""

from __future__ import annotations

import statistics

import pytest

from copc.models.tiny import build_tiny_tokenizer
from copc.run.config import apply_run_overrides, default_config
from copc.tasks import get_task
from copc.tasks.kv_chain import ROLLOUT_DEFAULTS, KVChainConfig, key


@pytest.fixture(scope="module")
def task():
    return get_task("kv_chain")


def test_splits_are_disjoint_and_answers_follow_the_chain(task) -> None:
    world = task.world()
    train, evals = task.prompts("train"), task.prompts("eval")
    assert len(evals) == 300 and len(train) == 400 * 5 - 300
    assert not {p.text for p in train} & {p.text for p in evals}
    for p in evals[:50]:
        start = p.text.split()[2].rstrip(".")
        hops = int(p.meta["hops"])
        assert 4 <= hops <= 8
        entity = start
        for _ in range(hops):
            entity = world.links[entity]
        assert p.answers == (world.codes[entity],)


def test_a_key_finds_its_own_fact_and_never_the_link_that_points_to_it(task) -> None:
    world = task.world()
    tool = task.tool()
    pointed_at = {target for target in world.links.values()}
    checked = 0
    for entity in world.entities:
        if entity not in pointed_at:
            continue
        text, bad = tool.call(key(entity, "next"))
        assert not bad and text == f"{key(entity, 'next')}: {world.links[entity]}"
        text, _ = tool.call(key(entity, "code"))
        assert text == f"{key(entity, 'code')}: {world.codes[entity]}"
        checked += 1
        if checked == 30:
            break
    assert checked == 30
    assert tool.call("ZZ00_next")[0].startswith("No results")


def test_episodes_are_long_and_demonstrations_mix_good_and_flawed_chains(task) -> None:
    tok = build_tiny_tokenizer()
    demos = task.sft_demos(300, seed=0)
    kinds = {d.kind for d in demos}
    assert kinds == {"tool", "direct", "key_typo", "miscount", "copy_slip"}
    good = [d for d in demos if d.kind == "tool"]
    policy_tokens = [
        sum(len(tok(s.text,
                    add_special_tokens=False)["input_ids"]) for s in d.segments if s.is_action) for d in good
    ]
    turns = [sum(s.is_action for s in d.segments) for d in good]
    assert statistics.median(policy_tokens) >= 200
    assert min(turns) >= 6  # 4+ hops, the code search, the answer
    longest = max(len(tok(d.text)["input_ids"]) for d in demos)
    assert longest <= ROLLOUT_DEFAULTS["context_limit"]
    assert max(policy_tokens) <= ROLLOUT_DEFAULTS["max_total_tokens"]


def test_naming_the_task_sets_its_rollout_budgets_and_later_overrides_win() -> None:
    cfg = apply_run_overrides(default_config(), ["task=kv_chain"])
    assert cfg.rollout.max_turns == ROLLOUT_DEFAULTS["max_turns"]
    assert cfg.rollout.context_limit == ROLLOUT_DEFAULTS["context_limit"]
    cfg = apply_run_overrides(default_config(), ["task=kv_chain", "rollout.max_turns=7"])
    assert cfg.rollout.max_turns == 7
    assert apply_run_overrides(default_config(),
                               ["task=kv_search"]).rollout.max_turns == default_config().rollout.max_turns


def test_bad_settings_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="max_hops=3 is below min_hops=4"):
        KVChainConfig(max_hops=3)
    with pytest.raises(ValueError, match="eval_size=2000 is over half"):
        KVChainConfig(eval_size=2000)
