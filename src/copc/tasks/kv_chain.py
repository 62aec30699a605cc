"""Built-in task ``kv_chain``: follow a chain of 4-8 links through a key-value store, one search per hop.

The long-horizon testbed. An episode has 6-10 policy turns and, at the median, over 200 policy tokens
(the tiny tokenizer's tags are one token each), so the product of per-token ratios over a trajectory can
move far from 1 under staleness, and every turn's observation shows how far the episode has got, so a
critic can learn a value that changes along it. The knowledge base holds two documents per entity::

    KX17_next: QT42            KX17_code: 4821

Keys join the entity and the relation with ``_`` so that BM25 (which splits on non-word characters)
sees one word: ``KX17_next`` finds KX17's link and never the document of the entity whose link points
*to* KX17 (``"PB33_next: KX17"`` holds the word ``kx17``, not ``kx17_next``). Half of the names are
look-alikes one digit away from another name, so a typo in a key silently finds another entity's link
and the chain goes wrong from there; a key that names no entity gets "No results".

Episode (question with 3 hops; the tasks of the testbed draw 4-8)::

    Start at KX17. Follow next 3 times, then give the code.           <- prompt
    <think>hop 1 of 3: at KX17, 2 left</think><search>KX17_next</search>   <- turn, stops at </search>
    -> <information>KX17_next: QT42</information>
    <think>hop 2 of 3: at QT42, 1 left</think><search>QT42_next</search>
    -> <information>QT42_next: AB12</information>
    <think>hop 3 of 3: at AB12, 0 left</think><search>AB12_next</search>
    -> <information>AB12_next: ZR55</information>
    <think>code of ZR55</think><search>ZR55_code</search>
    -> <information>ZR55_code: 4821</information>
    <answer>4821</answer>                                             <- reward: exact match

The ``<think>`` note carries the policy's own count of the hops made: the state a critic needs is in the
text. The question pool (every entity x every hop count) is shuffled once per seed; the eval split is its
head and the train split the rest, so no question is in both (the world, and so the links, are shared).
Warm-start demonstrations come from a separate world and mix correct chains with direct guesses and
flawed ones (a typo in a key, a miscounted chain, a slip copying the answer), so the warm-started policy
finishes a chain only part of the time and RL has room to make every hop reliable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from copc.config import check_fraction, check_positive
from copc.tasks.base import Demo, PerProcess, Segment, Split, check_split, register_task, split_pool, take
from copc.tasks.envs import SEARCH_TAGS
from copc.tasks.kv_search import entity_names, lookalike
from copc.tasks.tooling import CorpusLoader, RetrieverTool, search_env
from copc.types import Env, Prompt

if TYPE_CHECKING:
    pass

#: The rollout budgets a kv_chain run needs (``copc train task=kv_chain`` sets them; later overrides win):
#: 8 hops + the code search + the answer are 10 turns of at most ~35 tokens; the longest episode holds
#: about 520 tokens with its observations.
ROLLOUT_DEFAULTS: dict[str, int] = {
    "max_turns": 10,
    "max_new_tokens_per_turn": 48,
    "max_total_tokens": 384,
    "context_limit": 768,
}


@dataclass(frozen=True)
class KVChainConfig:
    seed: int = 0
    """Seed of the knowledge base, the question split and the demonstrations."""
    entities: int = 400
    """Entities in the world (each has a ``next`` link and a ``code``)."""
    min_hops: int = 4
    """Fewest links a question asks to follow."""
    max_hops: int = 8
    """Most links a question asks to follow."""
    lookalike_frac: float = 0.5
    """Fraction of names made one digit away from an earlier name (a key typo then finds another entity)."""
    eval_size: int = 300
    """Number of eval questions (the rest of the pool is the train split)."""
    max_obs_chars: int = 200
    """Retrieved text shown to the policy is cut to this many characters."""
    extra_tool_calls: int = 2
    """Searches allowed beyond the ``max_hops + 1`` a correct chain needs (later ones get an error)."""
    sft_tool_frac: float = 0.85
    """Warm-start mix: fraction of demonstrations that search (the rest guess a code directly)."""
    sft_error_frac: float = 0.4
    """Warm-start mix: fraction of search demonstrations with a mistake (key typo, miscount, copy slip)."""

    def __post_init__(self) -> None:
        check_positive("KVChainConfig", entities=self.entities, min_hops=self.min_hops,
                       eval_size=self.eval_size)
        check_positive("KVChainConfig", max_obs_chars=self.max_obs_chars)
        check_fraction("KVChainConfig", lookalike_frac=self.lookalike_frac, sft_tool_frac=self.sft_tool_frac,
                       sft_error_frac=self.sft_error_frac)
        if self.max_hops < self.min_hops:
            raise ValueError(
                f"KVChainConfig.max_hops={self.max_hops} is below min_hops={self.min_hops}; raise it")
        if self.extra_tool_calls < 0:
            raise ValueError(f"KVChainConfig.extra_tool_calls must be >= 0, got {self.extra_tool_calls}")
        if self.entities < 4:
            raise ValueError(f"KVChainConfig.entities must be >= 4, got {self.entities}")
        pool = self.entities * (self.max_hops - self.min_hops + 1)
        if self.eval_size > pool // 2:
            raise ValueError(
                f"KVChainConfig.eval_size={self.eval_size} is over half the question pool ({pool}); lower it")

    @property
    def max_tool_calls(self) -> int:
        """Searches allowed per episode: every hop, the code, and ``extra_tool_calls`` spare."""
        return self.max_hops + 1 + self.extra_tool_calls


@dataclass(frozen=True)
class ChainWorld:
    entities: tuple[str, ...]
    #: entity -> the entity its ``next`` link names (never itself)
    links: dict[str, str]
    #: entity -> its four-digit code
    codes: dict[str, str]

    def follow(self, start: str, hops: int) -> str:
        """The entity reached from ``start`` after ``hops`` links."""
        entity = start
        for _ in range(hops):
            entity = self.links[entity]
        return entity

    def documents(self) -> list[dict[str, str]]:
        """Corpus rows (``id``, ``contents``): a link and a code document per entity, in a fixed order."""
        rows = []
        for entity in sorted(self.entities):
            rows.append({"id": f"{entity}-next", "contents": key_text(entity, "next", self.links[entity])})
            rows.append({"id": f"{entity}-code", "contents": key_text(entity, "code", self.codes[entity])})
        return rows


def key(entity: str, relation: str) -> str:
    """The search key of one fact, ``"KX17_next"``: one word to BM25 (module docstring)."""
    return f"{entity}_{relation}"


def key_text(entity: str, relation: str, value: str) -> str:
    """One document: ``"KX17_next: QT42"``."""
    return f"{key(entity, relation)}: {value}"


def build_world(config: KVChainConfig, stream: str) -> ChainWorld:
    """A seeded world (``stream`` names it): names (some look-alikes), links and codes."""
    rng = random.Random(f"kv_chain/{stream}/world")
    names = entity_names(rng, config.entities, config.lookalike_frac)
    links = {entity: rng.choice([other for other in names if other != entity]) for entity in names}
    codes = {entity: str(rng.randint(1000, 9999)) for entity in names}
    return ChainWorld(entities=tuple(names), links=links, codes=codes)


@dataclass(frozen=True)
class ChainQuestion:
    start: str
    hops: int

    def text(self) -> str:
        return f"Start at {self.start}. Follow next {self.hops} times, then give the code.\n"

    def answer(self, world: ChainWorld) -> str:
        return world.codes[world.follow(self.start, self.hops)]


def question_pool(config: KVChainConfig, world: ChainWorld, stream: str) -> list[ChainQuestion]:
    """Every (start, hops) question, shuffled once; the eval split is the head, train the tail."""
    pool = [ChainQuestion(e, h) for e in world.entities for h in range(config.min_hops, config.max_hops + 1)]
    random.Random(f"kv_chain/{stream}/questions").shuffle(pool)
    return pool


@register_task("kv_chain", KVChainConfig)
class KVChainTask:
    """Follow a chain of links with BM25 key look-ups (see the module docstring)."""

    name = "kv_chain"

    def __init__(self, config: KVChainConfig) -> None:
        self.config = config
        stream = f"world/{config.seed}"
        #: The world, and the search tool over its corpus that every episode shares (one per process).
        self.world = PerProcess(partial(build_world, config, stream))
        self.tool = PerProcess(partial(_search_tool, config, stream))

    def prompts(self, split: Split, n: int | None = None) -> list[Prompt]:
        check_split(split)
        world = self.world()
        pool = question_pool(self.config, world, f"world/{self.config.seed}")
        questions = take(split_pool(pool, split, self.config.eval_size), n, f"{split} questions")
        return [
            Prompt(id=f"kv_chain/{split}/{i}", text=q.text(), answers=(q.answer(world),),
                   meta={"hops": q.hops})
            for i, q in enumerate(questions)
        ]

    def make_env(self, prompt: Prompt) -> Env:
        return search_env(prompt, self.tool(), max_tool_calls=self.config.max_tool_calls)

    def sft_demos(self, n: int, seed: int) -> list[Demo]:
        """Warm-start demonstrations on a separate world (seeded by ``seed``), so no eval fact is seen."""
        stream = f"sft/{self.config.seed}/{seed}"
        world = build_world(self.config, stream)
        tool = _search_tool(self.config, stream)
        pool = question_pool(self.config, world, stream)
        rng = random.Random(f"kv_chain/{stream}/mix")
        return [_demo(rng, self.config, world, tool, pool[i % len(pool)]) for i in range(n)]

    def sft_examples(self, n: int, seed: int) -> list[str]:
        return [demo.text for demo in self.sft_demos(n, seed)]


def _world_documents(config: KVChainConfig, stream: str) -> list[dict[str, str]]:
    return build_world(config, stream).documents()


def _search_tool(config: KVChainConfig, stream: str) -> RetrieverTool:
    return RetrieverTool(CorpusLoader(_world_documents, config, stream), top_k=1,
                         max_chars=config.max_obs_chars)


def _hop_turn(tool: RetrieverTool, note: str, query: str) -> tuple[Segment, Segment, str]:
    """A turn that notes its progress and searches ``query``; the observation and its raw text."""
    text, _ = tool.call(query)
    call = Segment(f"<think>{note}</think>{SEARCH_TAGS.call_open}{query}{SEARCH_TAGS.call_close}", True)
    return call, Segment(f"{SEARCH_TAGS.obs_open}{text}{SEARCH_TAGS.obs_close}", False), text


def _read_value(text: str, fallback: str) -> str:
    """The value of a ``"KEY: VALUE"`` passage (what a reader copies), ``fallback`` for "No results"."""
    head, sep, value = text.partition(": ")
    return value.strip() if sep and "_" in head else fallback


def _demo(rng: random.Random, config: KVChainConfig, world: ChainWorld, tool: RetrieverTool,
          q: ChainQuestion) -> Demo:
    """One demonstration: a correct chain, a direct guess, or a chain with one mistake.

    Mistakes: ``key_typo`` (one hop searches a name one digit off and follows what comes back, or guesses
    after "No results"), ``miscount`` (one hop too few or too many), ``copy_slip`` (the final code copied
    with one digit wrong). Each is what a reader that slips once would write.
    """
    segments: list[Segment] = [Segment(q.text(), False)]
    if rng.random() >= config.sft_tool_frac:
        segments.append(Segment(f"<answer>{rng.randint(1000, 9999)}</answer>", True))
        return Demo(tuple(segments), kind="direct")
    kind = "tool"
    if rng.random() < config.sft_error_frac:
        kind = rng.choice(("key_typo", "miscount", "copy_slip"))
    hops = q.hops
    if kind == "miscount":
        hops = max(1, q.hops + rng.choice((-1, 1)))
    typo_at = rng.randrange(hops) if kind == "key_typo" else -1
    entity = q.start
    for hop in range(hops):
        queried = lookalike(rng, entity) if hop == typo_at else entity
        note = f"hop {hop + 1} of {q.hops}: at {queried}, {q.hops - hop - 1} left"
        call, obs, text = _hop_turn(tool, note, key(queried, "next"))
        segments += [call, obs]
        entity = _read_value(text, fallback="")
        if not entity:  # "No results": the reader gives up and guesses
            segments.append(Segment(f"<answer>{rng.randint(1000, 9999)}</answer>", True))
            return Demo(tuple(segments), kind=kind)
    call, obs, text = _hop_turn(tool, f"code of {entity}", key(entity, "code"))
    segments += [call, obs]
    answer = _read_value(text, fallback=str(rng.randint(1000, 9999)))
    if kind == "copy_slip":
        i = rng.randrange(len(answer))
        answer = answer[:i] + rng.choice([d for d in "0123456789" if d != answer[i]]) + answer[i + 1 :]
    segments.append(Segment(f"<answer>{answer}</answer>", True))
    return Demo(tuple(segments), kind=kind)


__all__ = ["ROLLOUT_DEFAULTS", "ChainWorld", "KVChainConfig", "KVChainTask", "build_world", "key", "key_text"]
