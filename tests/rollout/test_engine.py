"""The generation engine: behaviour log-probs equal an independent teacher-forced computation."""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator

import pytest
import torch

from copc.models.hf import token_logprobs
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine, FinishReason
from copc.rollout.episode import run_episodes
from copc.rollout.sampling import SamplingConfig, sample_inverse_cdf, truncated_logprobs
from copc.types import EnvStep, StopReason

# KV-cached, padded, one-token-at-a-time fp32 vs one full forward: summation order differs, ~1e-6.
ATOL = 1e-5
PROMPTS = ["Compute 3+4.", "hi", "<python>print(1)</python>\n<output>1\n</output>"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, seed=0)


@pytest.fixture()
def engine(model, tok):
    return Engine(model, tok)


def _prompts(tok) -> list[list[int]]:
    return [tok.encode(p) for p in PROMPTS]


def _teacher_forced_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Logits that predict each generated token, from one unpadded forward of prompt + generation."""
    full = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(full).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def _oracle_truncated_logp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[float]:
    """Per-token Python transcription of the documented distribution (no torch sort/topk/scatter)."""
    scaled = [float(x) / temperature for x in logits]
    kept = set(range(len(scaled)))
    if top_k > 0:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        kept = {v for v in kept if scaled[v] >= kth}
    if top_p < 1.0:
        z = sum(math.exp(scaled[v]) for v in kept)
        ranked = sorted(kept, key=lambda v: -scaled[v])
        mass, nucleus = 0.0, set()
        for v in ranked:
            if mass < top_p:
                nucleus.add(v)
            mass += math.exp(scaled[v]) / z
        kept = nucleus
    log_z = math.log(sum(math.exp(scaled[v]) for v in kept))
    return [scaled[v] - log_z if v in kept else -math.inf for v in range(len(scaled))]


def test_sampling_config_validates() -> None:
    for bad in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError, match="must"):
            SamplingConfig(**bad)
    with pytest.raises(ValueError, match="tuple"):
        SamplingConfig(stop_strings=["</python>"])  # type: ignore[arg-type]


def test_truncated_logprobs_golden() -> None:
    # p = (0.5, 0.3, 0.2).  top_p = 0.6: mass before each token (sorted) = (0, 0.5, 0.8) -> keep the first
    # two, renormalise: (0.5, 0.3) / 0.8 = (0.625, 0.375).  top_k = 1 -> (1, 0, 0).
    # temperature 0.5 squares the probabilities: (0.25, 0.09, 0.04) / 0.38.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    nucleus = truncated_logprobs(logits, temperature=1.0, top_k=0, top_p=0.6).exp()
    torch.testing.assert_close(nucleus, torch.tensor([[0.625, 0.375, 0.0]]))
    greedy = truncated_logprobs(logits, temperature=1.0, top_k=1, top_p=1.0).exp()
    torch.testing.assert_close(greedy, torch.tensor([[1.0, 0.0, 0.0]]))
    cold = truncated_logprobs(logits, temperature=0.5, top_k=0, top_p=1.0).exp()
    torch.testing.assert_close(cold, torch.tensor([[0.25, 0.09, 0.04]]) / 0.38)
    # top_p = 0.5 exactly: mass before token 1 is 0.5, not < 0.5 -> only the first token.
    assert truncated_logprobs(logits, temperature=1.0, top_k=0, top_p=0.5).exp()[0, 1] == 0


def test_inverse_cdf_golden() -> None:
    # CDF (0.625, 1.0, 1.0): u < 0.625 -> token 0, else token 1; token 2 (excluded) never, even at u -> 1.
    logp = torch.tensor([[0.625, 0.375, 0.0]]).log().expand(4, 3)
    u = torch.tensor([0.0, 0.6, 0.7, 1 - 1e-12], dtype=torch.float64)
    assert sample_inverse_cdf(logp, u).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logp_equals_teacher_forced_forward(engine, model, tok, temperature) -> None:
    prompts = _prompts(tok)
    gens = engine.generate(prompts, SamplingConfig(temperature=temperature, max_new_tokens=12), seeds=[1, 2,
                                                                                                       3])
    for prompt, gen in zip(prompts, gens, strict=True):
        full = torch.tensor([prompt + gen.token_ids.tolist()])
        with torch.no_grad():
            forced = token_logprobs(model, full, torch.ones_like(full, dtype=torch.bool),
                                    temperature=temperature).logp
        assert gen.logp.dtype == torch.float32
        torch.testing.assert_close(gen.logp, forced[0, len(prompt) :], atol=ATOL, rtol=0)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (8, 0.7)])
def test_truncated_logp_equals_independent_oracle(engine, model, tok, top_k, top_p) -> None:
    prompts = _prompts(tok)
    config = SamplingConfig(temperature=0.5, top_k=top_k, top_p=top_p, max_new_tokens=10)
    gens = engine.generate(prompts, config, seeds=[4, 5, 6])
    n_truncated = 0
    for prompt, gen in zip(prompts, gens, strict=True):
        logits = _teacher_forced_logits(model, prompt, gen.token_ids.tolist())
        for t, token in enumerate(gen.token_ids.tolist()):
            oracle = _oracle_truncated_logp(logits[t], 0.5, top_k, top_p)
            assert math.isfinite(oracle[token]), "sampled a token outside the kept set"
            assert abs(gen.logp[t].item() - oracle[token]) < ATOL
            n_truncated += sum(not math.isfinite(x) for x in oracle) > 0
    assert n_truncated > 0  # the truncation really removed tokens (else the test proves nothing)


def test_same_seed_same_tokens_and_generator_determinism(engine, tok) -> None:
    prompts, config = _prompts(tok), SamplingConfig(max_new_tokens=15)
    a = engine.generate(prompts, config, seeds=[7, 8, 9])
    b = engine.generate(prompts, config, seeds=[7, 8, 9])
    c = engine.generate(prompts, config, seeds=[7, 8, 10])
    assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[2].token_ids, c[2].token_ids)
    g1 = engine.generate(prompts, config, generator=torch.Generator().manual_seed(3))
    g2 = engine.generate(prompts, config, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(g1, g2, strict=True))


def test_padded_batch_equals_row_by_row(engine, tok) -> None:
    prompts = _prompts(tok)
    # Different budgets so rows leave the batch (and the KV cache) at different steps.
    budgets = [20, 5, 12]
    config = SamplingConfig(temperature=0.8, max_new_tokens=20)
    batch = engine.generate(prompts, config, seeds=[11, 12, 13], max_new_tokens=budgets)
    for i, prompt in enumerate(prompts):
        (alone,) = engine.generate([prompt], config, seeds=[11 + i], max_new_tokens=[budgets[i]])
        assert torch.equal(batch[i].token_ids, alone.token_ids)
        torch.testing.assert_close(batch[i].logp, alone.logp, atol=ATOL, rtol=0)
        assert batch[i].text == alone.text
        # The random tiny model may sample EOS early; otherwise the row ran exactly to its own budget.
        assert alone.finish in (FinishReason.LENGTH, FinishReason.EOS)
        assert (len(alone.token_ids) == budgets[i]) == (alone.finish is FinishReason.LENGTH)


def test_row_blocks_are_sized_per_device(tok) -> None:
    """Blocks of 128 suit CPU caches; on a GPU a decode step is bound by kernel launches, so they ran a
    256-row batch in two sequential passes (0.62x HF generate on an H200, docs/figures/gpu_engine_h200_*)."""
    from copc.models.tiny import build_tiny_model
    from copc.rollout.engine import ACCELERATOR_MAX_ROWS, MAX_ROWS

    assert (MAX_ROWS, ACCELERATOR_MAX_ROWS) == (128, 256)
    assert Engine(build_tiny_model(tok, seed=0), tok).max_rows == MAX_ROWS
    with torch.device("meta"):  # any device that is not the CPU; no memory is allocated
        on_meta = build_tiny_model(tok, seed=0)
    assert Engine(on_meta, tok).max_rows == ACCELERATOR_MAX_ROWS
    assert Engine(on_meta, tok, max_rows=64).max_rows == 64  # an explicit choice stays


@pytest.mark.parametrize(("max_rows", "prefill_tokens"), [(2, 0), (1, 0), (0, 8), (2, 16)])
def test_row_blocks_and_prefill_chunks_give_the_same_samples(model, tok, max_rows, prefill_tokens) -> None:
    """Rows decoded in blocks of ``max_rows`` and prefilled in chunks of ``prefill_tokens`` sample what one
    batch samples (per-row seeds), with or without cached prefixes."""
    prompts = _prompts(tok) * 2
    config = SamplingConfig(temperature=0.9, max_new_tokens=10)
    seeds, budgets = list(range(20, 26)), [10, 3, 7, 10, 1, 6]
    whole = Engine(model, tok, max_rows=0, prefill_tokens=0)
    split = Engine(model, tok, max_rows=max_rows, prefill_tokens=prefill_tokens)
    first = whole.generate(prompts, config, seeds=seeds, max_new_tokens=budgets, return_kv=True)
    second = [p + g.token_ids.tolist() + tok.encode("<output>7</output>", add_special_tokens=False)
              for p, g in zip(prompts, first, strict=True)]
    prefixes = [g.kv if i % 2 else None for i, g in enumerate(first)]
    for engine_prompts, kv in ((prompts, None), (second, prefixes)):
        a = whole.generate(engine_prompts, config, seeds=seeds, max_new_tokens=budgets, prefix_kv=kv,
                           return_kv=True)
        b = split.generate(engine_prompts, config, seeds=seeds, max_new_tokens=budgets, prefix_kv=kv,
                           return_kv=True)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.token_ids, y.token_ids) and x.finish == y.finish
            torch.testing.assert_close(x.logp, y.logp, atol=ATOL, rtol=0)
            assert x.kv is not None and y.kv is not None and x.kv.length == y.kv.length
            for (kx, vx), (ky, vy) in zip(x.kv.layers, y.kv.layers, strict=True):
                torch.testing.assert_close(ky, kx, atol=ATOL, rtol=0)
                torch.testing.assert_close(vy, vx, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        Engine(model, tok, max_rows=-1)


def test_stop_strings(engine, tok) -> None:
    prompt = tok.encode("Say something:")
    greedy = SamplingConfig(top_k=1, max_new_tokens=30)
    (free,) = engine.generate([prompt], greedy)
    text = free.text
    # Stop at the first place the text ends with a 3-character piece taken from its middle.
    stop = text[10:13]
    first_end = next(j for j in range(1, len(text) + 1) if text[:j].endswith(stop))
    (stopped,) = engine.generate([prompt], SamplingConfig(top_k=1, max_new_tokens=30, stop_strings=("@@@@",
                                                                                                    stop)))
    assert stopped.finish is FinishReason.STOP and stopped.stop_string == stop
    assert stopped.text == text[:first_end]
    assert torch.equal(stopped.token_ids, free.token_ids[: len(stopped.token_ids)])
    # Per-row stop strings override the config's; a stop string that never appears runs to the budget.
    both = engine.generate([prompt, prompt], greedy, stop_strings=[(stop,), ("@@@@",)])
    assert both[0].text == text[:first_end] and both[1].finish is FinishReason.LENGTH


def test_eos_stops_row_and_is_not_in_text(model, tok) -> None:
    prompt = tok.encode("x")
    engine = Engine(model, tok)
    (free,) = engine.generate([prompt], SamplingConfig(top_k=1, max_new_tokens=6))
    third = int(free.token_ids[2])
    saved = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = [tok.eos_token_id, third]  # models may have several EOS ids
        (gen,) = Engine(model, tok).generate([prompt], SamplingConfig(top_k=1, max_new_tokens=6))
        (ignored,) = Engine(model, tok).generate([prompt], SamplingConfig(top_k=1, max_new_tokens=6,
                                                                          ignore_eos=True))
    finally:
        model.generation_config.eos_token_id = saved
    first = free.token_ids.tolist().index(third)
    assert gen.finish is FinishReason.EOS and gen.token_ids.tolist() == free.token_ids.tolist()[: first + 1]
    assert gen.text == tok.decode(free.token_ids[:first].tolist())
    assert torch.equal(ignored.token_ids, free.token_ids)


def test_load_weights_stamps_versions(model, tok) -> None:
    engine = Engine(build_tiny_model(tok, seed=0), tok)
    prompts = _prompts(tok)[:2]
    config = SamplingConfig(max_new_tokens=6)
    assert engine.generate(prompts, config, seeds=[1, 2])[0].version == 0
    new = build_tiny_model(tok, seed=5)
    engine.load_weights(new.state_dict())
    assert engine.version == 1
    engine.load_weights({k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}, version=7)
    gens = engine.generate(prompts, config, seeds=[1, 2])
    assert {g.version for g in gens} == {7}
    # The recorded log-probs are the NEW weights' (teacher-forced check against `new`).
    for prompt, gen in zip(prompts, gens, strict=True):
        full = torch.tensor([prompt + gen.token_ids.tolist()])
        with torch.no_grad():
            forced = token_logprobs(new, full, torch.ones_like(full, dtype=torch.bool)).logp
        torch.testing.assert_close(gen.logp, forced[0, len(prompt) :], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="increase"):
        engine.load_weights(new.state_dict(), version=7)
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights({"model.norm.weight": new.model.norm.weight}, version=8)


def test_bad_calls_say_what_to_do(engine, tok) -> None:
    config = SamplingConfig(max_new_tokens=3)
    assert engine.generate([], config) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], config)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 10_000]], config)
    with pytest.raises(ValueError, match="seeds"):
        engine.generate([[1], [1]], config, seeds=[1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1]], config, max_new_tokens=[0])


def test_prefix_kv_reuse_gives_the_same_samples(model, tok) -> None:
    engine = Engine(model, tok)
    prompts = _prompts(tok)
    config = SamplingConfig(temperature=0.9, max_new_tokens=8)
    first = engine.generate(prompts, config, seeds=[1, 2, 3], return_kv=True)
    for prompt, gen in zip(prompts, first, strict=True):
        assert gen.kv is not None and gen.kv.version == 0
        assert gen.kv.length == len(prompt) + len(gen.token_ids) - 1  # every token the model was fed
    # Next turn: previous ids + sampled tokens + an "observation" of different length per row.
    observations = ["<output>1</output>", "ok", "<output>12345\n</output>"]
    second = [
        p + g.token_ids.tolist() + tok.encode(o, add_special_tokens=False)
        for p, g, o in zip(prompts, first, observations, strict=True)
    ]
    prefixes = [first[0].kv, None, first[2].kv]  # mixed: row 1 is fed from scratch
    reused = engine.generate(second, config, seeds=[4, 5, 6], prefix_kv=prefixes)
    fresh = engine.generate(second, config, seeds=[4, 5, 6])
    for prompt, a, b in zip(second, reused, fresh, strict=True):
        assert torch.equal(a.token_ids, b.token_ids)
        torch.testing.assert_close(a.logp, b.logp, atol=ATOL, rtol=0)
        full = torch.tensor([prompt + a.token_ids.tolist()])
        with torch.no_grad():
            forced = token_logprobs(model, full, torch.ones_like(full, dtype=torch.bool),
                                    temperature=0.9).logp
        torch.testing.assert_close(a.logp, forced[0, len(prompt) :], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([prompts[0][:2]], config, prefix_kv=[first[0].kv])


def test_prefix_kv_from_old_weights_is_ignored(tok) -> None:
    engine = Engine(build_tiny_model(tok, seed=0), tok)
    prompt = tok.encode("Compute 3+4.")
    config = SamplingConfig(max_new_tokens=6)
    (old,) = engine.generate([prompt], config, seeds=[1], return_kv=True)
    new = build_tiny_model(tok, seed=8)
    engine.load_weights(new.state_dict())
    nxt = prompt + old.token_ids.tolist() + tok.encode("!", add_special_tokens=False)
    (reused,) = engine.generate([nxt], config, seeds=[2], prefix_kv=[old.kv])
    full = torch.tensor([nxt + reused.token_ids.tolist()])
    with torch.no_grad():
        forced = token_logprobs(new, full, torch.ones_like(full, dtype=torch.bool)).logp
    # Keys/values of the old weights would shift these; the stale prefix was recomputed instead.
    torch.testing.assert_close(reused.logp, forced[0, len(nxt) :], atol=ATOL, rtol=0)


def _merging_tokenizer():
    """A real (word-level) fast tokenizer whose pieces merge a closing tag with what follows it, as BPE
    vocabularies do (Qwen's and Llama-3's pre-tokenisers keep ``>`` and a newline in one piece ``>\\n``)."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<pad>", "<eos>", "<bos>", "</search", ">", ">\n", ">\n5", "q", "5", " ", "a", "b"]
    vocab = {p: i for i, p in enumerate(pieces)}
    back = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    back.pre_tokenizer = pre_tokenizers.Split(
        Regex("|".join(re.escape(p) for p in sorted(pieces, key=len, reverse=True))), behavior="isolated")
    back.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=back, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


class _SearchEnv:
    """Records the text each turn hands it; done after the first."""

    stop_strings = ("</search>",)

    def __init__(self) -> None:
        self.actions: list[str] = []

    def initial_text(self) -> str:
        return "a"

    def step(self, action_text: str) -> EnvStep:
        self.actions.append(action_text)
        return EnvStep(observation=None, done=True, reward=1.0, info={"correct": 1.0})

    def finish(self, reason: StopReason) -> EnvStep:
        return EnvStep(observation=None, done=True, reward=0.0, info={"correct": 0.0})


@contextlib.contextmanager
def _scripted(engine: Engine, forced: list[int], prompt_len: int) -> Iterator[None]:
    """The engine's model emits ``forced`` in order (its logits put all mass on the next one), so a test
    decides the tokens and the engine and the episode loop decide what they mean."""
    model = engine.model
    real_forward = model.forward

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        out = real_forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        done = int(attention_mask.shape[1]) - prompt_len  # tokens generated so far
        logits = torch.full_like(out.logits, -1e4)
        logits[..., -1, forced[min(done, len(forced) - 1)]] = 1e4
        out.logits = logits
        return out

    model.forward = types.MethodType(forward, model)
    try:
        yield
    finally:
        model.forward = real_forward


@pytest.mark.parametrize("piece", [">\n", ">\n5"])
def test_a_token_that_runs_past_a_stop_string_stops_the_row(piece: str) -> None:
    """``</search>`` completed by a ``>\\n`` piece (or ``>\\n5``): the row stops at that token, as vLLM
    stops wherever the string appears. Before, only a text that *ended* with the stop string stopped, so
    the row ran on: the query never ran and the model could write its own retrieval. The tool reads
    ``text_to_stop``, which ends at the stop string; the token's extra characters stay in the row, and
    the episode loop hands the env that text."""
    tok = _merging_tokenizer()
    engine = Engine(build_tiny_model(tok, seed=0), tok)
    forced = [tok.convert_tokens_to_ids(p) for p in ["q", "</search", piece, "a", "b"]]
    with _scripted(engine, forced, prompt_len=1):
        (gen,) = engine.generate([[tok.bos_token_id]], SamplingConfig(top_k=1, max_new_tokens=5),
                                 stop_strings=[("</search>",)])
    assert gen.finish is FinishReason.STOP and gen.stop_string == "</search>"
    assert gen.token_ids.tolist() == forced[:3]  # stopped at the token that completed the string
    assert gen.text == "q</search" + piece and gen.text_to_stop == "q</search>"

    env = _SearchEnv()
    with _scripted(engine, forced, prompt_len=1):
        (traj,) = run_episodes(engine, [env], max_turns=2, max_new_tokens_per_turn=5, max_total_tokens=20,
                               context_limit=64, seed=0, sampling=SamplingConfig(top_k=1))
    assert env.actions == ["q</search>"]
    assert traj.token_ids[traj.prompt_len:].tolist() == forced[:3]
