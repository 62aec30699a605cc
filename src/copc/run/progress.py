"""What a long run says while it runs when no progress bar can show it: a plain line per step for a
stdout that is not a terminal, and a warning when the train rewards carry no learning signal."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from copc import tracking as m
from copc.run.provenance import lag_text

__all__ = ["NoSignal", "StepLines", "print_summary"]


class StepLines:
    """Progress for a stdout that is not a terminal (nohup, a pipe, a log file), where the progress bar only
    shows at the end: one plain line per step, at most one per ``every_s`` seconds, the last step always."""

    def __init__(self, steps: int, every_s: float = 10.0) -> None:
        self.steps, self.every_s = steps, every_s
        self.started = time.perf_counter()
        self.last = -float("inf")

    def step(self, done: int, status: str) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s and done < self.steps:
            return
        self.last = now
        print(f"train {done}/{self.steps}  {status.removeprefix(f'step {done}').strip()}  "
              f"{now - self.started:.0f}s",
              flush=True)


class NoSignal:
    """Says once on stderr when every train reward has been 0 for ``after`` consecutive steps (0 = never):
    all advantages are then 0 and the policy does not learn, which a progress line alone does not show."""

    def __init__(self, after: int) -> None:
        self.after, self.run, self.said = after, 0, False

    def step(self, done: int, metrics: Mapping[str, float]) -> None:
        zero = metrics.get(m.REWARD_MEAN) == 0.0 and metrics.get(m.REWARD_STD, 0.0) == 0.0
        self.run = self.run + 1 if zero else 0
        if self.after and not self.said and self.run >= self.after:
            self.said = True
            print(f"warning: no learning signal: every train reward has been 0 for the last {self.run} steps "
                  f"(to step {done}); check that the task's answers can be reached within the rollout "
                  "budgets (rollout.max_new_tokens_per_turn, max_total_tokens, context_limit), the grader "
                  "(copc eval --samples-out shows episodes and rewards), and the starting policy (a warm "
                  "start, not an untrained model); "
                  "no_signal_steps=0 turns this off", file=sys.stderr, flush=True)


def print_summary(summary: Mapping[str, object]) -> None:
    """The end-of-run table of ``copc train`` (summary.json's evaluations, steps and wall time)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"copc train: {summary['method']} on {summary['task']} ({summary['driver']}, "
                        f"{lag_text(summary['lag'])})")  # type: ignore[arg-type]
    table.add_column("metric")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")

    def fmt(value: object) -> str:
        if value is None:  # eval.prompts=0: not evaluated
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    table.add_row("eval accuracy (avg@k)", fmt(summary["eval_accuracy_before"]),
                  fmt(summary["eval_accuracy_after"]))
    table.add_row("greedy accuracy", fmt(summary["eval_greedy_accuracy_before"]),
                  fmt(summary["eval_greedy_accuracy_after"]))
    table.add_row("tool-use rate", fmt(summary["eval_tool_use_rate_before"]),
                  fmt(summary["eval_tool_use_rate_after"]))
    table.add_row("steps", "", str(summary["steps"]))
    table.add_row("wall time (s)", "", f"{float(summary['wall_seconds']):.0f}")  # type: ignore[arg-type]
    console = Console()
    console.print(table)
    changed = summary.get("eval_changed_on_resume")
    if isinstance(changed, dict):
        console.print(f"note: 'before' was evaluated with the run's earlier settings; they changed when it "
                      f"resumed from step {changed['step']} ({changed['change']})", markup=False)
    console.print(f"run directory: [bold]{summary['run_dir']}[/bold]")
