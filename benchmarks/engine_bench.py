"""Tokens/s of copc's engine vs Hugging Face ``model.generate`` on the tiny model, one CPU thread.

Both sample (temperature 1, no top-k / top-p) from the same left-padded prompts with a KV cache.
Default: the same number of new tokens per row (EOS ignored: ``ignore_eos`` for the engine,
``min_new_tokens`` for HF). With ``--eos`` rows stop at EOS (ragged lengths, as in RL rollouts) and
tokens/s counts the tokens up to and including each row's EOS; the engine drops finished rows from
the batch, HF keeps computing them until the last row ends. Reported: median wall time over repeats
and tokens/s for each, and the ratio engine / HF measured in the same run (interleaved repeats, so
machine load hits both alike). On a shared machine the process CPU time (one thread) is the steadier
figure; both are printed.

    .venv/bin/python benchmarks/engine_bench.py [--batch 16] [--prompt 32] [--new 64] [--repeats 7] [--eos]
        [--device cuda] [--model qwen3-0.6b]

On a GPU (``--device cuda``) the wall time is the figure (CPU time then counts the Python that drives
the kernels). ``--model qwen3-0.6b`` builds a random-weight Qwen3 with Qwen3-0.6B's shapes
(``benchmarks/gpu/shapes.py``; bfloat16 on cuda, nothing downloaded) instead of the tiny model; the
prompts are token ids of the tiny tokenizer either way (EOS is its EOS id), so with random weights use
the default (EOS ignored).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from shapes import QWEN3_06B

from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.engine import Engine
from copc.rollout.sampling import SamplingConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32, help="longest prompt (others shorter, ragged)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eos", action="store_true", help="stop rows at EOS (ragged lengths)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=("tiny", "qwen3-0.6b"), default="tiny")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("engine_bench.py: no CUDA device visible (torch.cuda.is_available() is False)")

    tok = build_tiny_tokenizer()
    if args.model == "tiny":
        model = build_tiny_model(tok, seed=0).to(args.device)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        ids = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
               "bos_token_id": tok.bos_token_id}
        with torch.device(args.device):
            model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B, **ids, tie_word_embeddings=True))
        model = model.to(torch.bfloat16 if cuda else torch.float32).eval()
    engine = Engine(model, tok)
    gen = torch.Generator().manual_seed(0)
    vocab = torch.arange(4, len(tok))
    prompts = [
        [tok.bos_token_id, *vocab[torch.randint(len(vocab), (args.prompt - 1 - i % 8,),
                                                generator=gen)].tolist()]
        for i in range(args.batch)
    ]
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt", padding_side="left").to(args.device)
    config = SamplingConfig(max_new_tokens=args.new, ignore_eos=not args.eos)

    def run_engine() -> int:
        out = engine.generate(prompts, config, generator=torch.Generator().manual_seed(1))
        return sum(len(g.token_ids) for g in out)

    def run_hf() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new,
                min_new_tokens=0 if args.eos else args.new,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        new = out[:, batch["input_ids"].shape[1] :]
        if not args.eos:
            return int(new.numel())
        # Tokens up to and including the first EOS of each row (HF pads after it).
        is_eos = new == tok.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1,
                            torch.full_like(is_eos[:, 0], new.shape[1], dtype=torch.long))
        return int(first.sum())

    run_engine(), run_hf()  # warm-up
    times: dict[str, list[float]] = {"engine": [], "hf": []}
    cpu: dict[str, list[float]] = {"engine": [], "hf": []}
    tokens = {"engine": 0, "hf": 0}
    for _ in range(args.repeats):
        for name, fn in (("engine", run_engine), ("hf", run_hf)):
            start, start_cpu = time.perf_counter(), time.process_time()
            tokens[name] = fn()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    if not args.eos:
        assert tokens["engine"] == tokens["hf"] == args.batch * args.new, tokens
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"{args.model} model ({sum(p.numel() for p in model.parameters())} params, "
          f"{next(model.parameters()).dtype}, "
          f"{args.device}), batch {args.batch}, "
          f"prompt <= {args.prompt}, {'<= ' if args.eos else ''}{args.new} new tokens/row "
          f"({'stop at EOS' if args.eos else 'EOS ignored'}), "
          f"{args.threads} thread(s), {args.repeats} repeats")
    for name in ("engine", "hf"):
        print(
            f"  {name:6s}: median wall {med[name] * 1e3:8.1f} ms  {tokens[name] / med[name]:7.0f} tokens/s | "
            f"cpu {med_cpu[name] * 1e3:8.1f} ms  {tokens[name] / med_cpu[name]:7.0f} tokens/cpu-s"
        )
    ratio = (tokens["engine"] / med["engine"]) / (tokens["hf"] / med["hf"])
    ratio_cpu = (tokens["engine"] / med_cpu["engine"]) / (tokens["hf"] / med_cpu["hf"])
    print(f"  ratio engine/hf tokens/s: wall {ratio:.2f}, cpu {ratio_cpu:.2f}")


if __name__ == "__main__":
    main()
