#!/usr/bin/env bash
# GPU check of copc's verl plugin: a few verl v1 colocated-async steps on one GPU, first with verl's own
# PPO + GAE (plugin not loaded), then with copc's loss and trainer (`--config-name copc_ppo_trainer`, as in
# docs/verl.md: R0, loss `copc`), then R1 (loss `copc_behaviour`, R1's band as verl's token rejection), on
# the same data and model; prints each run's mean step time, its actor and critic losses, and the copc
# metrics the copc runs logged. Sized for under 10 minutes on one GPU (each run is cut at RUN_TIMEOUT,
# 180 s); not yet run on a GPU.
#
# Nothing is downloaded: a small random-weight Qwen3-architecture model is built from a config, its
# tokenizer is a byte-level BPE trained on the synthetic prompts, and the data are GSM8K-style
# arithmetic rows in verl's parquet format (data_source openai/gsm8k, so verl's own GSM8K reward scores
# them). Random weights mean the rewards stay near 0: this checks that the plugin runs inside verl and
# what it costs per step, not that it learns.
#
# Needs: one CUDA GPU; python with torch (CUDA), `pip install "copc[verl]" vllm` done beforehand.
# Usage: bash benchmarks/gpu/verl_copc.sh [steps]   (default 6 steps per run; the first is not timed)
# Env:   PY (python, default python3), WORK (scratch dir, default a new temp dir), RUN_TIMEOUT (s, 180).
set -euo pipefail
STEPS=${1:-6}
PY=${PY:-python3}
# Fail fast, in one line, where there is no GPU (verl 0.9.1 has no CPU platform).
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "verl_copc.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); this check needs one GPU" >&2
    exit 2
fi
WORK=${WORK:-$(mktemp -d -t verl_copc.XXXX)}
RUN_TIMEOUT=${RUN_TIMEOUT:-180}
echo "work dir: $WORK"

"$PY" - "$WORK" <<'EOF'
"""Random-weight Qwen3 + byte-level tokenizer + GSM8K-style parquet files, all built locally."""
import json
import random
import sys
from pathlib import Path

import pandas as pd
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

work = Path(sys.argv[1])
rng = random.Random(0)
SUFFIX = 'Let\'s think step by step and output the final answer after "####".'


def row(i: int, split: str) -> dict:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"Tom has {a} apples and buys {b} more. How many now? {SUFFIX}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": i},
    }


train = [row(i, "train") for i in range(512)]
test = [row(i, "test") for i in range(64)]
pd.DataFrame(train).to_parquet(work / "train.parquet")
pd.DataFrame(test).to_parquet(work / "test.parquet")

special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
corpus = [r["prompt"][0]["content"] + f" #### {r['reward_model']['ground_truth']}" for r in train] * 4
tok.train_from_iterator(
    corpus,
    trainers.BpeTrainer(vocab_size=2048, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
)
hf_tok = PreTrainedTokenizerFast(
    tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
)
hf_tok.chat_template = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
model_dir = work / "qwen3-random"
hf_tok.save_pretrained(model_dir)
config = Qwen3Config(
    vocab_size=len(hf_tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
    tie_word_embeddings=True, eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
    bos_token_id=hf_tok.eos_token_id, torch_dtype="bfloat16",
)
Qwen3ForCausalLM(config).save_pretrained(model_dir)  # random init, no download
print(json.dumps({"model": str(model_dir), "vocab": len(hf_tok), "train_rows": len(train)}))
EOF

COMMON=(
    data.train_files="$WORK/train.parquet" data.val_files="$WORK/test.parquet"
    data.train_batch_size=32 data.max_prompt_length=128 data.max_response_length=128
    actor_rollout_ref.model.path="$WORK/qwen3-random"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.calculate_log_probs=True
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    critic.enable=True critic.model.path="$WORK/qwen3-random" critic.optim.lr=1e-5
    critic.ppo_micro_batch_size_per_gpu=8
    algorithm.gamma=1.0 algorithm.lam=1.0 algorithm.use_kl_in_reward=False
    trainer.use_v1=True trainer.critic_warmup=0 trainer.logger='["console"]'
    trainer.project_name=copc_gpu_check trainer.n_gpus_per_node=1 trainer.nnodes=1
    trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1
    trainer.total_training_steps="$STEPS"
)

run() {  # name, plugin policy (auto|none), config name, extra overrides...
    local name=$1 plugins=$2 config=$3
    shift 3
    echo "== $name"
    VERL_USE_EXTERNAL_PLUGINS=$plugins timeout "$RUN_TIMEOUT" "$PY" -m verl.trainer.main_ppo \
        --config-name "$config" "${COMMON[@]}" \
        trainer.experiment_name="$name" trainer.default_local_dir="$WORK/ckpt_$name" "$@" \
        >"$WORK/$name.log" 2>&1 || { echo "$name failed (rc $?); last lines:"; tail -n 40 "$WORK/$name.log"; return 1; }
}

status=0
run ppo none ppo_trainer trainer.v1.trainer_mode=colocate_async algorithm.adv_estimator=gae \
    actor_rollout_ref.actor.policy_loss.loss_mode=vanilla || status=1
run copc auto copc_ppo_trainer trainer.v1.trainer_mode=copc_colocate_async algorithm.adv_estimator=copc_clipped_td \
    actor_rollout_ref.actor.policy_loss.loss_mode=copc || status=1
run copc_r1 auto copc_ppo_trainer trainer.v1.trainer_mode=copc_colocate_async algorithm.adv_estimator=copc_clipped_td \
    actor_rollout_ref.actor.policy_loss.loss_mode=copc_behaviour \
    +actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs=token_k1 \
    +actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs_threshold=0.5_2.0 || status=1

"$PY" - "$WORK" <<'EOF'
"""Mean step time (verl's timing_s/step, first step dropped), losses, and the copc metrics that were logged."""
import re
import sys
from pathlib import Path

work = Path(sys.argv[1])
for name in ("ppo", "copc", "copc_r1"):
    log = work / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    steps = [float(x) for x in re.findall(r"timing_s/step:([0-9.eE+-]+)", text)]
    copc_keys = sorted(set(re.findall(r"((?:actor/)?(?:copc|rollout_corr)/[a-z_/0-9]+):", text)))
    timed = steps[1:] if len(steps) > 1 else steps
    mean = sum(timed) / len(timed) if timed else float("nan")
    print(f"{name}: {len(steps)} steps, mean step time {mean:.2f} s (first step dropped); copc metrics: {len(copc_keys)}")
    for key in ("actor/pg_loss", "critic/vf_loss", "critic/score/mean"):
        values = re.findall(re.escape(key) + r":([0-9.eE+-]+)", text)
        print(f"    {key} per step: {', '.join(f'{float(v):.4g}' for v in values) or 'not logged'}")
    if name != "ppo":
        last = {k: re.findall(re.escape(k) + r":([0-9.eE+-]+)", text)[-1:] for k in copc_keys}
        print("    copc metrics, last step:", ", ".join(f"{k}={float(v[0]):.4g}" for k, v in last.items() if v))
EOF
exit $status
