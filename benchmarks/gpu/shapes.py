"""Model shapes the GPU benchmarks build with random weights (nothing is downloaded)."""

from __future__ import annotations

#: Qwen3-0.6B's published shapes (config.json of Qwen/Qwen3-0.6B).
QWEN3_06B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}
#: A few-parameter model of the same architecture, to run a GPU benchmark's code on a CPU.
QWEN3_TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
