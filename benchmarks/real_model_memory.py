"""Memory, checkpoint size and step time of a real model's run (issue 17, part 4).

    .venv/bin/python benchmarks/real_model_memory.py --model smollm2-hf [--driver sync|async] [--steps 2]
        [--src OTHER_CHECKOUT/src] [key=value ...]

Runs the walk-through of docs/own-model.md (``math_tool`` on ``tests/fixtures/math_tool.jsonl``, COPC,
real-model budgets) as a ``copc train`` subprocess and prints:

- the trainer's peak RSS in each phase of a step (batch, prepare, critic, actor, publish, and
  ``other``: start-up, model loading, evaluations and checkpoints), from the run's ``memory/peak_*``
  metrics (copc.trainer.memory), which say where the memory goes;
- peak memory of the whole process tree (trainer, rollout workers, the sandbox's fork server), as the
  sum of PSS (proportional set size: a shared page, e.g. the weight ring, is counted once in total, not
  once per process that maps it) and the trainer's own peak RSS, sampled every second from ``/proc``;
- the size of one checkpoint on disk and of the ``checkpoints/`` folder;
- median seconds per training step (``time/step``) and the run's wall time.

Extra ``key=value`` arguments are passed to ``copc train`` after the walk-through's (e.g.
``model.dtype=bfloat16 checkpoint_optimizer=false``), and ``--src`` runs another checkout's copc (a
``git worktree`` of an older commit), so the same script measures before and after in one sitting. It
also prints the memory floor by component (float32 weights, gradients and AdamW moments of the policy
and the critic, from the parameter count) and what the run used above it.
Linux only (reads ``/proc``). Figures depend on the machine's load; compare rows of one sitting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WALKTHROUGH = [
    "task=math_tool", f"task_options.data={ROOT / 'tests/fixtures/math_tool.jsonl'}",
    "task_options.eval_size=2",
    "rollout.max_new_tokens_per_turn=256", "rollout.max_total_tokens=512", "rollout.context_limit=2048",
    "rollout.prompts_per_batch=2", "rollout.group_size=4", "trainer.actor_lr=5e-6",
    "trainer.critic_warmup_steps=0", "eval.prompts=2", "eval.every=0", "method=copc",
]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(tree.get(current, []))
    return out


def _field_kib(path: str, name: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(command: list[str], env: dict[str, str]) -> tuple[int, float, float]:
    """Run ``command``; its exit code, peak summed PSS of its tree and its own peak RSS, both in GiB."""
    process = subprocess.Popen(command, env=env)
    peak_tree = 0
    while process.poll() is None:
        total = sum(_field_kib(f"/proc/{pid}/smaps_rollup", "Pss") for pid in _descendants(process.pid))
        peak_tree = max(peak_tree, total)
        time.sleep(1.0)
    # VmHWM of the trainer is gone with the process: getrusage of children has its max RSS.
    import resource

    own_peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return process.returncode, peak_tree / 2**20, own_peak_kib / 2**20


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF folder of the policy (docs/own-model.md step 2)")
    parser.add_argument("--driver", choices=("sync", "async"), default="sync")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--src", default=None,
                        help="run copc train from this source tree (PYTHONPATH), e.g. an "
                        "older commit's checkout, to measure before and after in one sitting")
    parser.add_argument("overrides", nargs="*", help="extra copc train key=value overrides")
    args = parser.parse_args()
    from copc.tracking import read_metrics

    with tempfile.TemporaryDirectory(prefix="copc-memory-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "copc.cli", "train", *WALKTHROUGH, f"model.policy={args.model}",
                   f"driver.kind={args.driver}", f"steps={args.steps}", f"run_dir={run_dir}", *args.overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.src:
            env["PYTHONPATH"] = str(Path(args.src).resolve())
        start = time.perf_counter()
        code, tree_gib, own_gib = measure(command, env)
        wall = time.perf_counter() - start
        if code != 0:
            raise SystemExit(f"copc train failed with exit code {code}")
        records = read_metrics(run_dir / "metrics.jsonl")
        steps = [float(r["time/step"]) for r in records if "time/step" in r]
        phases = _phase_peaks(records)
        # the exit's ru_maxrss covers only the time after the last step
        own_gib = max([own_gib, *phases.values()])
        root = run_dir / "checkpoints"
        latest = root / (root / "latest").read_text().strip()
        print(f"{args.driver} {' '.join(args.overrides) or '(defaults)'}: peak PSS of the tree "
              f"{tree_gib:.2f} GiB, trainer peak RSS {own_gib:.2f} GiB, checkpoint "
              f"{_size(latest) / 2**30:.2f} GiB "
              f"(checkpoints/ {_size(root) / 2**30:.2f} GiB), median "
              f"step {statistics.median(steps):.1f} s, wall {wall:.0f} s")
        if phases:
            print("trainer peak RSS by phase of a step (max over steps; copc.trainer.memory): "
                  + ", ".join(f"{name} {gib:.2f}" for name, gib in phases.items())
                  + " GiB (other: start-up, model loading, evaluations, checkpoints between steps)")
        print(_floor(Path(args.model), critic_backbone=True, peak_gib=tree_gib))


def _phase_peaks(records: list[dict[str, float]]) -> dict[str, float]:
    """``{phase: max over steps of memory/peak_<phase>}`` in the order of a step."""
    order = ("batch", "prepare", "critic", "actor", "publish", "other")
    found = {k[len("memory/peak_"):]: 0.0 for r in records for k in r if k.startswith("memory/peak_")}
    for record in records:
        for name in found:
            found[name] = max(found[name], float(record.get(f"memory/peak_{name}", 0.0)))
    return dict(sorted(found.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def _floor(model: Path, *, critic_backbone: bool, peak_gib: float) -> str:
    """The float32 floor of training: weights, gradients and two AdamW moments of the policy and the critic
    (4 copies each, from the policy's parameter count; the critic is a copy of the backbone), in GiB."""
    from safetensors import safe_open

    params = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                params += _numel(handle.get_slice(key).get_shape())
    one = params * 4 / 2**30
    floor = 4 * one * (2 if critic_backbone else 1)
    return (f"floor by component: policy weights {one:.2f} + gradients {one:.2f} + AdamW moments "
            f"{2 * one:.2f} GiB; critic the same: {floor:.2f} GiB in all ({params / 1e6:.0f}M parameters in "
            f"float32); above the floor: {peak_gib - floor:.2f} GiB "
            "(the sampler's copy, activations, logits, the allocator)")


def _numel(shape: list[int]) -> int:
    out = 1
    for size in shape:
        out *= int(size)
    return out


if __name__ == "__main__":
    main()
