"""Step time of sync PPO, async PPO and async COPC at the same batch on the tiny model (claim C5).

    .venv/bin/python benchmarks/step_time.py [--steps 10] [--rounds 2] [--policy warmstart|tiny]
    [--no-forward-reuse]
        [--copc copc|copc_proximal|copc_behaviour] [key=value ...]   # copc train overrides, e.g.
        task=kv_search
                                                                     # 'task_options={hard: true}' (E5)
    .venv/bin/python benchmarks/step_time.py --copc copc_behaviour trainer.actor_minibatches=1   # C5 for R1

Prints, measured in this one run (configurations run in interleaved rounds, so a drifting load on a
shared machine hits them alike; medians over the steps after the first ``--warmup`` of each run):

- step time and tokens/s of each configuration;
- the async speed-up over sync (sync median step time / async median step time);
- COPC's step-time overhead over async PPO (3a: ratio against the behaviour policy, no old forward) and,
  for reference, over async PPO 3b (``async_ppo_recompute``, the same forward count as COPC);
- the split of each step: generation, training, waiting for the batch, publication of the new weights,
  and the share of the training time its thread was on a CPU (``time/train_cpu / time/train``: below
  100% it was off a CPU, waiting for a core, the GIL or I/O; at 100% and still slower than in the sync
  run, it shared caches and memory);
- the ideal overlap bound ``(gen + train) / max(gen, train)`` from the sync run's generation and
  training times, and the same bound scaled by this machine's measured parallel capacity ``c`` for two
  busy processes (``c = 2 t_1 / t_2``: ``t_1`` = time of one busy process alone, ``t_2`` = wall time of
  two running at once): two processes that share ``c`` cores finish ``gen + train`` of work in at least
  ``(gen + train) / c``, so the reachable speed-up is ``min(bound, c)``;
- speed-up as a fraction of that scaled bound (target >= 90%) and the COPC overhead (target <= 2%);
- COPC's overhead measured on the trainer step alone, methods alternated on identical batches;
- the end-to-end ratios (COPC / 3a, COPC / 3b, sync / COPC, sync / 3a) round by round, with the 95% t
  interval of their logs over rounds (``--rounds 5`` or more: a 1-2% claim needs the interval);
- the CPU cost of generation (generator process + the sandbox's fork server and its runs, for the tool
  calls) and the overlap bound it implies, the CPU-time bound: a step needs ``gen CPU + train`` seconds
  of CPU, and the machine delivers ``c`` cores of it to busy processes, so an async step takes at least
  ``max(gen, train, (gen CPU + train) / c)``. (Until 2026-12-01 22:40 the last term divided by the
  nominal ``os.cpu_count()`` = 2 and the result was capped by ``c``: a bound no run on this machine
  could reach when generation alone keeps more than one core busy. The line prints that figure too.)

Every configuration uses the async driver's defaults (one rollout worker, bounded staleness 8) but for
the method and ``driver.kind``; ``driver.*`` overrides reach every configuration (async-only ones, such as
``driver.partial_rollouts``, are refused by the sync configuration), with no critic warm-up (every timed step
trains the actor) and ``trainer.old_forward_reuse`` (3b, COPC) and ``trainer.critic_forward_reuse`` on
(``--no-forward-reuse`` turns both off);
the sync run generates and trains in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from copc.eval.evaluate import EvalConfig
from copc.experiments.stats import ratio_interval
from copc.run.config import RunConfig, load_run_config
from copc.run.train import train
from copc.runtime.staleness import StalenessConfig
from copc.tasks.tooling import sandbox_cpu_s


def busy(seconds_of_work: int, out: mp.Queue) -> None:
    """A CPU-bound loop of fixed work (small matmuls, one thread); reports its own wall time."""
    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    start = time.perf_counter()
    for _ in range(seconds_of_work):
        a = torch.tanh(a @ a * 0.01)
    out.put(time.perf_counter() - start)


def parallel_capacity(work: int = 3000) -> tuple[float, float, float]:
    """``(c, t1, t2)``: c = 2 t1 / t2 for one vs two concurrent busy processes (1 = no parallelism).

    Medians of three alternations, to damp the drift of a machine shared with other work."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    ones, twos = [], []
    for _ in range(3):
        proc = ctx.Process(target=busy, args=(work, out))
        proc.start()
        proc.join()
        ones.append(out.get())
        procs = [ctx.Process(target=busy, args=(work, out)) for _ in range(2)]
        for p in procs:
            p.start()
        twos.append(max(out.get(), out.get()))
        for p in procs:
            p.join()
    t1, t2 = statistics.median(ones), statistics.median(twos)
    return min(2.0, 2 * t1 / t2), t1, t2


def trainer_overhead(base: RunConfig, repeats: int, tmp: Path, copc: str = "copc") -> dict[str, float]:
    """Median trainer-step time per method on the SAME recorded batches, methods interleaved (paired).

    The end-to-end async step hides the trainer behind generation whenever generation is the slower
    side, and a loaded machine drifts between runs; timing ``trainer.step`` alone, alternating the
    methods on identical batches, isolates what COPC adds (the old forward and one extra scan).
    """
    from copc.channels.methods import get_method
    from copc.models.hf import ValueModel, load_policy
    from copc.rollout.generator import RolloutGenerator
    from copc.run.build import policy_path
    from copc.tasks import get_task
    from copc.trainer.batching import collate
    from copc.trainer.trainer import ActorCriticTrainer

    model_dir = policy_path(base, tmp)
    gen_model, tokenizer = load_policy(model_dir)
    task = get_task(base.task, **base.task_options)
    generator = RolloutGenerator(gen_model, tokenizer, task, base.rollout, seed=base.seed)
    batches, cpu = [], {"gen_wall": [], "gen_cpu_self": [], "gen_cpu_tools": []}
    for j in range(3):
        wall, self0, tools0 = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _tool_cpu(task)
        batches.append(collate(generator.generate(j).trajectories, pad_id=int(tokenizer.pad_token_id)))
        cpu["gen_wall"].append(time.perf_counter() - wall)
        cpu["gen_cpu_self"].append(_cpu(resource.RUSAGE_SELF) - self0)
        cpu["gen_cpu_tools"].append(_tool_cpu(task) - tools0)
    trainers = {}
    for name in ("async_ppo", "async_ppo_recompute", copc):
        policy, _ = load_policy(model_dir)
        torch.manual_seed(0)
        trainers[name] = ActorCriticTrainer(
            policy, ValueModel.from_policy(policy), get_method(name), replace(base.trainer,
                                                                              critic_warmup_steps=0)
        )
    times: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:  # rotate the order
            start = time.perf_counter()
            trainers[name].step(batches[rep % len(batches)])
            times[name].append(time.perf_counter() - start)
    out = {("copc" if name == copc else name): statistics.median(values) for name, values in times.items()}
    out.update({key: statistics.median(values) for key, values in cpu.items()})
    return out


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _tool_cpu(task: object) -> float:
    """CPU seconds of this process's tool subprocesses so far: those that exited, and the live fork server."""
    return _cpu(resource.RUSAGE_CHILDREN) + sandbox_cpu_s(task)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every configuration")
    parser.add_argument("--trainer-repeats", type=int, default=12)
    parser.add_argument("--policy", default="warmstart", help="warmstart | tiny | an HF folder")
    parser.add_argument("--copc", default="copc",
                        help="the COPC preset timed: copc (the name), copc_proximal (R0) "
                        "or copc_behaviour (R1)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="copc train overrides applied first (e.g. task=kv_search 'task_options={hard: "
                             "true}')")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write each configuration's medians and per-round step times as JSON "
                             "(read by benchmarks/accuracy_wallclock.py)")
    parser.add_argument("--forward-reuse", action=argparse.BooleanOptionalAction, default=True,
                        help="trainer.old_forward_reuse (3b, COPC) and trainer.critic_forward_reuse (every "
                             "method with a critic) for every configuration")
    parser.add_argument("--report-json", type=Path, default=None, metavar="PATH",
                        help="measure nothing: print the round-by-round ratios and their intervals from a "
                             "JSON file an earlier --json run wrote")
    args = parser.parse_args()
    if args.report_json is not None:
        saved = json.loads(args.report_json.read_text())
        print(f"{args.report_json}: {saved['task']}, {saved['copc']} as async COPC, batch {saved['batch']}, "
              f"{saved['steps']} steps x {saved['rounds']} rounds per configuration")
        for name, row in saved["configurations"].items():
            print(f"  {name:28s} median step {row['step']:.3f} s (generate {row['generate']:.3f}, "
                  f"train {row['train']:.3f}, mean lag {row['staleness']:.1f})")
        report_rounds(saved["per_round_step_s"])
        return
    torch.set_num_threads(1)
    given = load_run_config(None, args.overrides)
    base = replace(
        given,
        steps=args.steps,
        checkpoint_every=0,
        plots=False,
        model=replace(given.model, policy=args.policy),  # model.* overrides (a warm start's recipe) kept
        eval=EvalConfig(prompts=0),
        staleness=StalenessConfig(mode="bounded", staleness=8),
    )
    # Every timed step trains the actor: no critic warm-up (its steps skip the actor's forwards).
    base = replace(base, trainer=replace(base.trainer, critic_warmup_steps=0,
                                         old_forward_reuse=args.forward_reuse,
                                         critic_forward_reuse=args.forward_reuse))
    configs = {
        "sync PPO": replace(base, method="ppo", driver=replace(base.driver, kind="sync")),
        "async PPO (3a)": replace(base, method="async_ppo", driver=replace(base.driver, kind="async")),
        "async PPO (3b, recompute)": replace(base, method="async_ppo_recompute",
                                             driver=replace(base.driver, kind="async")),
        "async COPC": replace(base, method=args.copc, driver=replace(base.driver, kind="async")),
    }
    capacity, t1, t2 = parallel_capacity()
    per_step: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    per_round: dict[str, list[float]] = {name: [] for name in configs}  # each run's median step time
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name, cfg in configs.items():
                run_dir = Path(tmp) / f"{name.replace(' ', '_')}-{rnd}"
                rows = run_steps(replace(cfg, run_dir=str(run_dir)), args.warmup)
                per_step[name] += rows
                per_round[name].append(statistics.median(r["time/step"] for r in rows))
        overhead = trainer_overhead(base, args.trainer_repeats, Path(tmp), args.copc)
    results = {name: medians(rows) for name, rows in per_step.items()}
    report(results, overhead, capacity, t1, t2, base, args)
    report_rounds(per_round)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"task": base.task, "task_options": base.task_options, "copc": args.copc,
                   "batch": base.rollout.batch_size, "steps": args.steps, "rounds": args.rounds,
                   "configurations": results, "per_round_step_s": per_round}
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")


def report_rounds(per_round: dict[str, list[float]]) -> None:
    """The end-to-end ratios round by round (each round runs every configuration once, back to back, so a
    round's ratio is paired against the load of its minutes) and their 95% interval over rounds."""
    print("\nend-to-end step-time ratios, round by round (median step of each run), with the 95% t interval "
          "of the log ratio over rounds:")
    pairs = [("async COPC", "async PPO (3a)"), ("async COPC", "async PPO (3b, recompute)"),
             ("sync PPO", "async COPC"), ("sync PPO", "async PPO (3a)")]
    for num, den in pairs:
        ratios = [a / b for a, b in zip(per_round[num], per_round[den], strict=True)]
        got = ratio_interval(per_round[num], per_round[den])
        interval = "" if got.low is None else f" [{got.low:.3f}, {got.high:.3f}]"
        print(f"  {num} / {den}: {got.mean:.3f}{interval} (n={got.n} rounds; "
              + ", ".join(f"{r:.3f}" for r in ratios) + ")")


def run_steps(cfg: RunConfig, warmup: int) -> list[dict[str, float]]:
    result = train(cfg, show_progress=False)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "time/step" in r][warmup:]


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "step": med("time/step"),
        "generate": med("time/generate"),
        "train": med("time/train"),
        "train_cpu": med("time/train_cpu"),
        "wait": med("time/wait"),
        "publish": med("time/publish"),
        "tokens_per_s": med("perf/tokens_per_s"),
        "staleness": med("staleness/mean"),
        "n": float(len(rows)),
    }


def report(
    results: dict[str, dict[str, float]], overhead: dict[str, float], capacity: float, t1: float, t2: float,
    base: RunConfig, args: argparse.Namespace,
) -> None:
    print(f"\nCOPC preset timed: {args.copc}; actor minibatches: "
          f"{base.trainer.actor_minibatches or 'as each preset sets them'}")
    print(f"parallel capacity for two busy processes: c = {capacity:.2f} (one alone {t1:.2f}s, two at once "
          f"{t2:.2f}s)")
    print(f"task: {base.task} {base.task_options or ''}; batch: {base.rollout.batch_size} trajectories/step; "
          f"{args.rounds} interleaved rounds of {args.steps} "
          f"steps per configuration, medians over steps after the first {args.warmup} of each run\n")
    print(f"{'configuration':28s} {'step s':>8s} {'gen s':>8s} {'train s':>8s} {'on CPU':>7s} {'wait s':>8s} "
          f"{'publish s':>9s} {'tok/s':>8s} {'stale':>6s} {'n':>4s}")
    for name, r in results.items():
        print(f"{name:28s} {r['step']:8.3f} {r['generate']:8.3f} {r['train']:8.3f} "
              f"{r['train_cpu'] / r['train']:7.0%} {r['wait']:8.3f} "
              f"{r['publish']:9.3f} {r['tokens_per_s']:8.1f} {r['staleness']:6.2f} {int(r['n']):4d}")
    sync = results["sync PPO"]
    gen, trn = sync["generate"], sync["train"]
    bound = (gen + trn) / max(gen, trn)
    scaled = min(bound, capacity)
    speedup = sync["step"] / results["async PPO (3a)"]["step"]
    speedup_copc = sync["step"] / results["async COPC"]["step"]
    gen_cpu = overhead["gen_cpu_self"] + overhead["gen_cpu_tools"]
    cores = os.cpu_count() or 1
    cpu_bound = min(capacity, (gen + trn) / max(gen, trn, (gen_cpu + trn) / capacity))
    nominal = min(capacity, (gen + trn) / max(gen, trn, (gen_cpu + trn) / cores))
    e2e_3a = results["async COPC"]["step"] / results["async PPO (3a)"]["step"] - 1
    e2e_3b = results["async COPC"]["step"] / results["async PPO (3b, recompute)"]["step"] - 1
    print(f"\nideal overlap bound (gen + train) / max(gen, train) = {bound:.2f}x; scaled by capacity: "
          f"{scaled:.2f}x")
    print(f"async PPO (3a) speed-up over sync PPO: {speedup:.2f}x = {speedup / scaled:.0%} of the scaled "
          f"bound, {speedup / cpu_bound:.0%} of the CPU-time bound ({cpu_bound:.2f}x, below)")
    print(f"async COPC speed-up over sync PPO:     {speedup_copc:.2f}x = {speedup_copc / scaled:.0%} of the "
          f"scaled bound, {speedup_copc / cpu_bound:.0%} of the CPU-time bound (target >= 90%)")
    print(f"COPC end-to-end step-time overhead: {e2e_3a:+.1%} vs async PPO 3a, {e2e_3b:+.1%} vs 3b")
    t3a, t3b, tc = overhead["async_ppo"], overhead["async_ppo_recompute"], overhead["copc"]
    print(f"generation of one batch in-process: {overhead['gen_wall']:.2f}s wall, "
          f"{overhead['gen_cpu_self']:.2f}s CPU "
          f"in the generator + {overhead['gen_cpu_tools']:.2f}s CPU in sandbox subprocesses (tool calls) -> "
          f"generation alone uses {gen_cpu / overhead['gen_wall']:.1f} cores; CPU-time bound with the "
          f"measured capacity: (gen + train) / max(gen, train, (gen CPU + train) / c) = {cpu_bound:.2f}x "
          f"(with the nominal {cores} cores instead of c, capped by c: {nominal:.2f}x; async COPC at "
          f"{speedup_copc / nominal:.0%} of that)")
    print(f"trainer step alone (paired, same batches): 3a {t3a:.3f}s, 3b {t3b:.3f}s, COPC {tc:.3f}s -> COPC "
          f"{tc / t3a - 1:+.1%} vs 3a (its old forward, unless taken from the first minibatch, and its "
          f"scans), {tc / t3b - 1:+.1%} vs 3b (the same forwards)")


if __name__ == "__main__":
    main()
