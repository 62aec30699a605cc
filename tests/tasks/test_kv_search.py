"""kv_search: seeded knowledge base, disjoint question splits, per-turn env behaviour with real BM25,
demos."""

import pickle
from collections import Counter

import pytest

from copc.tasks import get_task
from copc.tasks.kv_search import build_knowledge_base, fact_text, pool_size
from copc.types import StopReason


@pytest.fixture(scope="module")
def task():
    return get_task("kv_search", top_k=3)


def test_knowledge_base_is_seeded_and_partners_are_pairs():
    kb = build_knowledge_base(2, "world/0")
    assert kb == build_knowledge_base(2, "world/0")
    assert kb.facts != build_knowledge_base(2, "world/1").facts
    assert len(set(kb.entities)) == len(kb.entities) == 300
    for entity in kb.entities:
        partner = kb.facts[(entity, "partner")]
        assert partner != entity and kb.facts[(partner, "partner")] == entity
    docs = kb.documents()
    assert len(docs) == 300 * 3 and len({d["id"] for d in docs}) == len(docs)
    assert {"id": "kb-0", "contents": fact_text(*sorted(kb.facts)[0],
                                                kb.facts[sorted(kb.facts)[0]])} == docs[0]


def test_splits_are_disjoint_deterministic_and_answers_follow_the_facts(task):
    evals, train = task.prompts("eval"), task.prompts("train")
    assert len(evals) == 300 and len(evals) + len(train) == pool_size(2)
    assert not {p.text for p in evals} & {p.text for p in train}
    assert evals == get_task("kv_search", top_k=3).prompts("eval")
    assert {p.text for p in evals} != {p.text for p in get_task("kv_search", seed=1).prompts("eval")}
    hops = Counter(p.meta["hops"] for p in evals)
    assert 0.2 < hops[2] / len(evals) < 0.4  # difficulty 2: about 30% multi-hop
    kb = task.knowledge_base()
    for prompt in evals[:50]:
        entity = prompt.text.removesuffix("?\n").split(" of ")[-1]
        if prompt.meta["hops"] == 2:
            entity = kb.facts[(entity, "partner")]
        assert prompt.answers == (kb.facts[(entity, prompt.meta["attribute"])],)


def test_difficulty_levels_grow():
    sizes = [pool_size(level) for level in (1, 2, 3, 4)]
    assert sizes == sorted(sizes)
    hard = get_task("kv_search", hard=True)
    assert hard.config.effective_top_k == 3 and get_task("kv_search").config.effective_top_k == 1
    assert hard.config.level == 4 and Counter(p.meta["hops"] for p in hard.prompts("eval"))[2] > 100
    kb = hard.knowledge_base()
    lookalikes = sum(
        1 for a in kb.entities for b in kb.entities if a < b and len(a) == len(b) and sum(x != y for x,
                                                                                          y in zip(a, b)) == 1
    )
    assert lookalikes > 50  # names one letter apart: a typo in a query retrieves someone else


def _single_and_multi(task):
    evals = task.prompts("eval")
    return next(p for p in evals if p.meta["hops"] == 1), next(p for p in evals if p.meta["hops"] == 2)


def test_single_hop_search_then_answer(task):
    single, _ = _single_and_multi(task)
    entity = single.text.removesuffix("?\n").split(" of ")[-1]
    attribute = single.meta["attribute"]
    env = task.make_env(single)
    assert env.stop_strings == ("</search>", "</answer>")
    step = env.step(f"<search>{attribute} of {entity}</search>")
    assert not step.done and step.observation.startswith("<information>")
    lines = step.observation.removeprefix("<information>").removesuffix("</information>").split("\n")
    assert len(lines) == 3  # top_k passages, best first
    assert lines[0] == fact_text(entity, attribute, single.answers[0])
    final = env.step(f"<answer>{single.answers[0]}</answer>")
    assert final.done and final.reward == 1.0 and final.info["tool_calls"] == 1


def test_multi_hop_needs_two_searches(task):
    _, multi = _single_and_multi(task)
    entity = multi.text.removesuffix("?\n").split(" of ")[-1]
    partner = task.knowledge_base().facts[(entity, "partner")]
    env = task.make_env(multi)
    first = env.step(f"<search>partner of {entity}</search>").observation
    assert f"{entity} partner: {partner}" in first
    second = env.step(f"<search>{multi.meta['attribute']} of {partner}</search>").observation
    assert fact_text(partner, multi.meta["attribute"], multi.answers[0]) in second
    assert env.step(f"<answer>{partner}</answer>").reward == 0.0  # stopping after one hop is wrong


def test_bad_turns_do_not_crash(task):
    single, _ = _single_and_multi(task)
    env = task.make_env(single)
    empty = env.step("<search> </search>")
    assert "empty query" in empty.observation and empty.info["tool_errors"] == 1
    nothing = env.step("<search>zzqx</search>")
    assert nothing.observation == "<information>No results; try other words.</information>"
    void = env.step("the answer is")
    assert void.done and void.reward == 0.0 and void.info["void_turn"] == 1.0
    assert task.make_env(single).finish(StopReason.MAX_TOKENS).reward == 0.0


def test_task_pickles_and_rebuilds_its_index(task):
    single, _ = _single_and_multi(task)
    clone = pickle.loads(pickle.dumps(task))
    entity = single.text.removesuffix("?\n").split(" of ")[-1]
    query = f"<search>{single.meta['attribute']} of {entity}</search>"
    assert clone.make_env(single).step(query).observation == task.make_env(single).step(query).observation


def test_demos_use_another_world_and_mix_kinds(task):
    demos = task.sft_demos(600, seed=0)
    assert [d.text for d in demos] == task.sft_examples(600, seed=0)
    kinds = Counter(d.kind for d in demos)
    # sft_tool_frac 0.55, sft_error_frac 0.3: about 270 direct, 230 good searches, 100 flawed.
    assert 220 < kinds["direct"] < 320 and 180 < kinds["tool"] < 280
    assert 60 < kinds["query_typo"] + kinds["copy_error"] + kinds["early_stop"] < 140
    eval_entities = set(task.knowledge_base().entities)
    demo_entities = {d.segments[0].text.removesuffix("?\n").split(" of ")[-1] for d in demos}
    assert len(demo_entities & eval_entities) < 0.05 * len(demo_entities)  # a separate world
    for demo in demos:
        assert not demo.segments[0].is_action
        for segment in demo.segments[1:]:
            assert segment.is_action == (not segment.text.startswith("<information>"))
        answer = demo.segments[-1].text
        assert answer.startswith("<answer>") and answer.endswith("</answer>")


def test_good_demos_answer_correctly_in_their_world(task):
    demos = [d for d in task.sft_demos(200, seed=0) if d.kind == "tool"]
    for demo in demos:
        answer = demo.segments[-1].text.removeprefix("<answer>").removesuffix("</answer>")
        assert f": {answer}" in demo.segments[-2].text  # copied from the retrieved passages


@pytest.mark.parametrize("fields", [{}, {"hard": True}])
def test_a_correct_query_always_ranks_the_needed_fact_first(fields):
    """The world is built so that BM25 with the right query finds the fact (documents of equal length)."""
    task = get_task("kv_search", top_k=2, **fields)
    kb = task.knowledge_base()
    tool = task.tool()
    for prompt in task.prompts("eval", 150):
        entity = prompt.text.removesuffix("?\n").split(" of ")[-1]
        if prompt.meta["hops"] == 2:
            links = tool.call(f"partner of {entity}")[0].split("\n")
            partner = kb.facts[(entity, "partner")]
            assert sorted(links[:2]) == sorted([f"{entity} partner: {partner}",
                                                f"{partner} partner: {entity}"])
            entity = partner
        first = tool.call(f"{prompt.meta['attribute']} of {entity}")[0].split("\n")[0]
        assert first == fact_text(entity, prompt.meta["attribute"], prompt.answers[0])
