"""Built-in task ``kv_search``: answer questions about a generated knowledge base with a BM25 search tool.

The knowledge base (one per seed and difficulty) holds one short document per fact::

    KX17 code: 4821            KX17 room: 305            KX17 partner: QT42

Questions are single-hop ("What is the code of KX17?", answered by one document) or multi-hop ("What is
the code of the partner of KX17?", answered by two: the partner link, then the partner's fact).
Episode format::

    What is the code of the partner of KX17?                       <- prompt
    <search>partner of KX17</search>                               <- turn, stops at </search>
    -> <information>KX17 partner: QT42\\n...</information>   <- top-k from the real BM25Retriever
    <search>code of QT42</search>
    -> <information>QT42 code: 1234\\n...</information>
    <answer>1234</answer>                                           <- reward: exact match (SQuAD-normalised)

The question pool (entity x attribute x hops) is shuffled once per seed; the eval split takes its first
questions and the train split the rest, so no question is in both. Facts are shared (it is one world:
at ``hard`` 88% of the eval questions end on a fact some train question also asks for, docs/testbed.md);
warm-start demonstrations are drawn from a separate world, so they reveal no eval fact.

Difficulty: 1: codes only, single-hop, 600 entities; 2 (default): codes and rooms, 30% multi-hop, 300
entities; 3: three attributes, 40% multi-hop, 300 entities; 4 (``hard=True``): four attributes, 50%
multi-hop, 400 entities, half of them look-alike names one digit apart (a query typo finds the wrong one).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from copc.config import check_fraction, check_positive
from copc.tasks.base import (
    Demo,
    PerProcess,
    Segment,
    Split,
    check_split,
    prompt_text,
    register_task,
    split_pool,
    take,
)
from copc.tasks.envs import SEARCH_TAGS
from copc.tasks.tooling import CorpusLoader, RetrieverTool, search_env
from copc.types import Env, Prompt

if TYPE_CHECKING:
    pass

LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
#: Attributes in the order levels add them; every value is a number of a fixed width per attribute.
ATTRIBUTES: tuple[str, ...] = ("code", "room", "year", "pin")

#: level -> (number of attributes, multi-hop fraction, entities, look-alike names)
LEVELS: dict[int, tuple[int, float, int, bool]] = {
    1: (1, 0.0, 600, False),
    2: (2, 0.3, 300, False),
    3: (3, 0.4, 300, False),
    4: (4, 0.5, 400, True),
}


@dataclass(frozen=True)
class KVSearchConfig:
    seed: int = 0
    """Seed of the knowledge base, the question split and the demonstrations."""
    difficulty: int = 2
    """1 (easiest) .. 4; see the module docstring."""
    hard: bool = False
    """Hard setting for long RL runs: difficulty 4 (overrides ``difficulty``)."""
    eval_size: int = 300
    """Number of eval questions (the rest of the pool is the train split)."""
    top_k: int = 1
    """Passages returned per search (the hard setting uses at least 3). 1 by default: the tiny model's
    warm start (3 min of CPU) learns to read one passage, not yet to pick the right one of two."""
    max_obs_chars: int = 400
    """Retrieved text shown to the policy is cut to this many characters."""
    max_tool_calls: int = 4
    """Searches allowed per episode; later ones get an error observation."""
    sft_tool_frac: float = 0.55
    """Warm-start mix: fraction of demonstrations that search (the rest guess directly)."""
    sft_error_frac: float = 0.3
    """Warm-start mix: fraction of search demonstrations with a mistake (query typo, copy slip, early
    stop)."""

    def __post_init__(self) -> None:
        if self.difficulty not in LEVELS:
            raise ValueError(
                f"KVSearchConfig.difficulty must be one of {sorted(LEVELS)}, got {self.difficulty}")
        check_positive("KVSearchConfig", eval_size=self.eval_size, top_k=self.top_k)
        check_positive("KVSearchConfig", max_obs_chars=self.max_obs_chars, max_tool_calls=self.max_tool_calls)
        check_fraction("KVSearchConfig", sft_tool_frac=self.sft_tool_frac, sft_error_frac=self.sft_error_frac)
        pool = pool_size(self.level)
        if self.eval_size > pool // 2:
            raise ValueError(
                f"KVSearchConfig.eval_size={self.eval_size} is over half the question pool ({pool}); lower it"
            )

    @property
    def level(self) -> int:
        return 4 if self.hard else self.difficulty

    @property
    def effective_top_k(self) -> int:
        """Passages per search: ``top_k``, at least 3 in the hard setting (more distractors to read past)."""
        return max(self.top_k, 3) if self.hard else self.top_k


@dataclass(frozen=True)
class KnowledgeBase:
    entities: tuple[str, ...]
    #: (entity, attribute) -> value; attribute "partner" holds another entity.
    facts: dict[tuple[str, str], str]
    attributes: tuple[str, ...]

    def documents(self) -> list[dict[str, str]]:
        """Corpus rows (``id``, ``contents``), one per fact, in a fixed order."""
        rows = []
        for i, ((entity, attribute), value) in enumerate(sorted(self.facts.items())):
            rows.append({"id": f"kb-{i}", "contents": fact_text(entity, attribute, value)})
        return rows


def fact_text(entity: str, attribute: str, value: str) -> str:
    """One document: ``"KX17 code: 4821"`` (short, since the tiny model reads it character by character)."""
    return f"{entity} {attribute}: {value}"


def entity_name(rng: random.Random) -> str:
    """An identifier like ``"KX17"``: two letters, two digits.

    One word to BM25, so every document has three words (name, attribute, value) and equal length: a
    query's attribute word then decides the ranking (a two-word name would let document length win).
    """
    return f"{rng.choice(LETTERS)}{rng.choice(LETTERS)}{rng.randint(10, 99)}"


def lookalike(rng: random.Random, name: str) -> str:
    """``name`` with one digit changed: a different entity to BM25 (a typo finds the wrong one)."""
    i = rng.choice([i for i, c in enumerate(name) if c.isdigit()])
    low = 1 if i == 2 else 0  # the first digit is never 0
    return name[:i] + rng.choice([str(d) for d in range(low, 10) if str(d) != name[i]]) + name[i + 1 :]


def entity_names(rng: random.Random, n: int, lookalike_frac: float | None) -> list[str]:
    """``n`` distinct names, each after the first a look-alike of an earlier one with probability
    ``lookalike_frac``. ``None``: no look-alikes and no coin drawn for them (a fraction of 0 still draws
    one per name, so from the same seed the two give different worlds)."""
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n:
        name = entity_name(rng)
        if lookalike_frac is not None and names and rng.random() < lookalike_frac:
            name = lookalike(rng, rng.choice(names))
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def _value(rng: random.Random, attribute: str) -> str:
    if attribute == "code":
        return str(rng.randint(1000, 9999))
    if attribute == "room":
        return str(rng.randint(100, 999))
    if attribute == "year":
        return str(rng.randint(1700, 2020))
    return str(rng.randint(10000, 99999))


def pool_size(level: int) -> int:
    """Number of distinct questions at ``level``: single-hop facts plus the multi-hop share."""
    n_attributes, multi_frac, n_entities, _ = LEVELS[level]
    singles = n_attributes * n_entities
    return singles + min(singles, round(singles * multi_frac / (1.0 - multi_frac)))


def build_knowledge_base(level: int, stream: str) -> KnowledgeBase:
    """A seeded world (``stream`` names it): entities, their attribute values, and partners in pairs.

    Partnership is symmetric (entities are paired off), so the two documents that mention a pair,
    ``"A partner: B"`` and ``"B partner: A"``, both name the partner: BM25 scores words, not their
    order, and could not tell "A's partner" from "whose partner is A" if the relation were one-way.
    """
    n_attributes, _, n_entities, lookalikes = LEVELS[level]
    rng = random.Random(f"kv_search/{stream}/{level}/kb")
    names = entity_names(rng, n_entities, 0.5 if lookalikes else None)
    attributes = ATTRIBUTES[:n_attributes]
    facts: dict[tuple[str, str], str] = {}
    for entity in names:
        for attribute in attributes:
            facts[(entity, attribute)] = _value(rng, attribute)
    order = list(names)
    rng.shuffle(order)
    for first, second in zip(order[0::2], order[1::2], strict=True):  # entity counts are even
        facts[(first, "partner")], facts[(second, "partner")] = second, first
    return KnowledgeBase(entities=tuple(names), facts=facts, attributes=attributes)


@dataclass(frozen=True)
class KVQuestion:
    entity: str
    attribute: str
    hops: int

    def text(self) -> str:
        if self.hops == 1:
            return f"What is the {self.attribute} of {self.entity}?"
        return f"What is the {self.attribute} of the partner of {self.entity}?"

    def answer(self, kb: KnowledgeBase) -> str:
        entity = self.entity if self.hops == 1 else kb.facts[(self.entity, "partner")]
        return kb.facts[(entity, self.attribute)]


def question_pool(kb: KnowledgeBase, level: int, stream: str) -> list[KVQuestion]:
    """All questions about ``kb``, shuffled, with about ``multi_frac`` multi-hop ones in every prefix.

    The eval split is the head of this list and the train split the tail, so they share no question.
    """
    rng = random.Random(f"kv_search/{stream}/{level}/questions")
    singles = [KVQuestion(e, a, 1) for e in kb.entities for a in kb.attributes]
    multis = [KVQuestion(e, a, 2) for e in kb.entities for a in kb.attributes]
    rng.shuffle(singles)
    rng.shuffle(multis)
    multis = multis[: pool_size(level) - len(singles)]
    pool: list[KVQuestion] = []
    while singles or multis:
        # Draw multi-hop with the probability that keeps the remaining mix on target.
        p_multi = len(multis) / (len(multis) + len(singles))
        pool.append(multis.pop() if rng.random() < p_multi else singles.pop())
    return pool


@register_task("kv_search", KVSearchConfig)
class KVSearchTask:
    """Search a generated knowledge base with BM25 (see the module docstring)."""

    name = "kv_search"

    def __init__(self, config: KVSearchConfig) -> None:
        self.config = config
        stream = f"world/{config.seed}"
        #: The knowledge base, and the search tool over its corpus every episode shares (one per process).
        self.knowledge_base = PerProcess(partial(build_knowledge_base, config.level, stream))
        self.tool = PerProcess(partial(_search_tool, config, stream))

    def prompts(self, split: Split, n: int | None = None) -> list[Prompt]:
        check_split(split)
        kb = self.knowledge_base()
        pool = question_pool(kb, self.config.level, f"world/{self.config.seed}")
        questions = take(split_pool(pool, split, self.config.eval_size), n, f"{split} questions")
        return [
            Prompt(
                id=f"kv_search/{split}/{i}",
                text=prompt_text(q.text()),
                answers=(q.answer(kb),),
                meta={"hops": q.hops, "attribute": q.attribute, "level": self.config.level},
            )
            for i, q in enumerate(questions)
        ]

    def make_env(self, prompt: Prompt) -> Env:
        return search_env(prompt, self.tool(), max_tool_calls=self.config.max_tool_calls)

    def sft_demos(self, n: int, seed: int) -> list[Demo]:
        """Warm-start demonstrations on a separate world (seeded by ``seed``), so no eval fact is seen.

        The mix: searches that copy the answer (good), direct guesses, and flawed searches (a typo in the
        entity name, a slip copying the answer, or answering a multi-hop question after the first hop).
        """
        stream = f"sft/{self.config.seed}/{seed}"
        kb = build_knowledge_base(self.config.level, stream)
        tool = _search_tool(self.config, stream)
        pool = question_pool(kb, self.config.level, stream)
        rng = random.Random(f"kv_search/{stream}/mix")
        return [_demo(rng, self.config, kb, tool, pool[i % len(pool)]) for i in range(n)]

    def sft_examples(self, n: int, seed: int) -> list[str]:
        return [demo.text for demo in self.sft_demos(n, seed)]


def _kb_documents(level: int, stream: str) -> list[dict[str, str]]:
    return build_knowledge_base(level, stream).documents()


def _search_tool(config: KVSearchConfig, stream: str) -> RetrieverTool:
    return RetrieverTool(CorpusLoader(_kb_documents, config.level, stream), top_k=config.effective_top_k,
                         max_chars=config.max_obs_chars)


def _search(tool: RetrieverTool, query: str) -> tuple[Segment, Segment]:
    text, _ = tool.call(query)
    call = Segment(f"{SEARCH_TAGS.call_open}{query}{SEARCH_TAGS.call_close}", True)
    return call, Segment(f"{SEARCH_TAGS.obs_open}{text}{SEARCH_TAGS.obs_close}", False)


def _slip(rng: random.Random, text: str) -> str:
    """``text`` with one character replaced by another of the same kind (digit or letter)."""
    i = rng.randrange(len(text))
    pool = "0123456789" if text[i].isdigit() else LETTERS
    return text[:i] + rng.choice([c for c in pool if c != text[i]]) + text[i + 1 :]


def _demo(
    rng: random.Random, config: KVSearchConfig, kb: KnowledgeBase, tool: RetrieverTool, q: KVQuestion
) -> Demo:
    segments: list[Segment] = [Segment(prompt_text(q.text()), False)]
    answer = q.answer(kb)
    if rng.random() >= config.sft_tool_frac:
        guess = _value(rng, q.attribute)
        segments.append(Segment(f"<answer>{guess}</answer>", True))
        return Demo(tuple(segments), kind="direct")
    kind = "tool"
    if rng.random() < config.sft_error_frac:
        kind = rng.choice(("query_typo", "copy_error", "early_stop") if q.hops == 2 else ("query_typo",
                                                                                          "copy_error"))
    entity = q.entity
    if q.hops == 2:
        segments.extend(_search(tool, f"partner of {entity}"))
        entity = kb.facts[(entity, "partner")]
        if kind == "early_stop":
            segments.append(Segment(f"<answer>{entity}</answer>", True))
            return Demo(tuple(segments), kind=kind)
    queried = lookalike(rng, entity) if kind == "query_typo" else entity
    segments.extend(_search(tool, f"{q.attribute} of {queried}"))
    if kind == "query_typo":  # answers from the first passage it got back, right or wrong
        answer = _first_value(segments[-1].text, q.attribute, fallback=answer)
    elif kind == "copy_error":
        answer = _slip(rng, answer)
    segments.append(Segment(f"<answer>{answer}</answer>", True))
    return Demo(tuple(segments), kind=kind)


def _first_value(information: str, attribute: str, *, fallback: str) -> str:
    """Value of the first passage about ``attribute`` in a retrieved block (the naive reader's answer)."""
    body = information.removeprefix(SEARCH_TAGS.obs_open).removesuffix(SEARCH_TAGS.obs_close)
    for line in body.split("\n"):
        words = line.split(f" {attribute}: ", 1)
        if len(words) == 2:
            return words[1].strip()
    return fallback
