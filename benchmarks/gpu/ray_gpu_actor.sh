#!/usr/bin/env bash
# Ray rollout actors on a GPU: `copc train driver.kind=ray driver.ray_gpus_per_worker=G` end to end.
#
# What it checks (the Ray driver's GPU path, which had never run): Ray places the actors on the GPU,
# each published version reaches them through the object store, they sample on `cuda`, and the CPU
# trainer's step-start recompute agrees with what they sampled. Three runs of the pinned `kv_search`
# warm start, method `copc` (its `old` forward makes `ratio/mean_abs_log` = mean |old - mu| per step):
#   A  fixed lag 0: every batch is sampled with the weights the trainer holds, so mean |old - mu| is the
#      CUDA-sampler vs CPU-trainer numerics only (fp32: about 1e-6); a stale or corrupted weight
#      transfer would read 0.1 or more;
#   B  bounded staleness 4, 12 steps: real lag, the same transport;
#   C  B resumed to 16 steps (`resume=true`): new actors on the GPU pick up the checkpoint's version.
# `nvidia-smi` is sampled every second: which processes held GPU memory.
#
# Usage (repo root; OUT is where results go): GPUS=0.5 bash benchmarks/gpu/ray_gpu_actor.sh
# GPUS=0 CPUS=0.5 WHEELS=0 PY=.venv/bin/python runs the same on CPU actors (a dry run without a GPU).
# Wheels: the device machine has no Ray. ray 2.60.0's cp312 wheel (76 MiB) is over what one call can
# carry beside the tree, so it travels split (`split -b 26M -d`) over three calls, `.whl/ray1`, `ray2`,
# `ray3` (the last with the missing dependencies: jsonschema, referencing, rpds-py, ...), and `.whl/bm25s-*`;
# they are installed under /tmp/site.
set -uo pipefail
OUT=${OUT:-/tmp/ray_gpu_out}
GPUS=${GPUS:-0.5}
PY=${PY:-python3}
THREADS=${THREADS:-8}
CPUS=${CPUS:-2}
mkdir -p "$OUT"
if [ "${WHEELS:-1}" = 1 ] && [ -d .whl/ray3 ]; then
  cat .whl/ray1/ray-2.60.0-cp312.whl.part00 .whl/ray2/ray-2.60.0-cp312.whl.part01 .whl/ray3/ray-2.60.0-cp312.whl.part02 \
    > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl || exit 3
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .whl/ray3/*.whl .whl/bm25s-*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD/src
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if command -v nvidia-smi >/dev/null; then
  (while true; do nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader; sleep 1; done) \
    > "$OUT/nvidia_smi.log" 2>&1 &
  SMI=$!
fi
common=(task=kv_search "task_options={hard: true}" model.policy=results/warmstarts/kv_search-72acaf748f56 method=copc
  driver.kind=ray driver.num_workers=2 "driver.ray_cpus_per_worker=$CPUS" "driver.ray_gpus_per_worker=$GPUS"
  "driver.trainer_threads=$THREADS" rollout.prompts_per_batch=8 rollout.group_size=4 eval.prompts=0 checkpoint_every=4)
rm -rf /tmp/ray_gpu_runs
run() {  # name, overrides...
  local name=$1; shift
  local t0=$SECONDS
  $PY -m copc.cli train --no-progress "${common[@]}" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? ${SECONDS}s" | tee -a "$OUT/status.txt"
}
run A staleness.mode=fixed_lag staleness.staleness=0 steps=8 run_dir=/tmp/ray_gpu_runs/A
run B staleness.mode=bounded staleness.staleness=4 steps=12 run_dir=/tmp/ray_gpu_runs/B
run C resume=true run_dir=/tmp/ray_gpu_runs/B steps=16
[ -n "${SMI:-}" ] && kill "$SMI"
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {}
for name, d in (("A", "A"), ("BC", "B")):
    rows = [json.loads(l) for l in Path(f"/tmp/ray_gpu_runs/{d}/metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = [r for r in rows if "ratio/mean_abs_log" in r]
    res[name] = {
        "steps": [r.get("step") for r in steps],
        "mean_abs_log": [r["ratio/mean_abs_log"] for r in steps],
        "staleness": [r.get("staleness/mean") for r in steps],
        "reward": [r.get("reward/mean") for r in steps],
        "summary": json.loads(Path(f"/tmp/ray_gpu_runs/{d}/summary.json").read_text()),
    }
smi = (out / "nvidia_smi.log").read_text().splitlines() if (out / "nvidia_smi.log").exists() else []
res["gpu_processes"] = sorted({line.split(",")[1].strip() for line in smi if line.count(",") >= 2})
res["gpu_pids"] = len({line.split(",")[0] for line in smi if line.count(",") >= 2})
(out / "ray_gpu.json").write_text(json.dumps(res, indent=1))
print(json.dumps({k: (v if k.startswith("gpu") else {kk: vv for kk, vv in v.items() if kk != "summary"}) for k, v in res.items()}, indent=1))
EOF
