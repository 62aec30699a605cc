"""``wandb=true``: a run's metrics mirrored to Weights & Biases (``pip install 'copc[wandb]'``; imported only
when asked for; ``WANDB_MODE=offline`` writes the run under ``run_dir/wandb`` for a later ``wandb sync``).
metrics.jsonl stays the run's record; the mirror is one-way."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from copc.run.tracker import MetricsMirror

__all__ = ["WandbMirror"]


@dataclass(frozen=True)
class WandbMirror:
    """Where a run's scalars are mirrored in Weights & Biases (the ``wandb`` package, imported lazily)."""

    project: str = "copc"
    """W&B project."""
    name: str = ""
    """Run name ('' = the run directory's name)."""
    config: Mapping[str, object] | None = None
    """The run's resolved config, shown beside the curves."""

    def open(self, run_dir: Path) -> MetricsMirror:
        """Start (or, for a resumed copc run, continue) the W&B run of ``run_dir``: its id is kept in
        ``run_dir/wandb_id`` and its files under ``run_dir/wandb``."""
        try:
            import wandb
        except ImportError:
            raise ImportError("wandb=true needs the wandb package: pip install 'copc[wandb]' (offline: "
                              "WANDB_MODE=offline)") from None
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        return wandb.init(project=self.project, name=self.name or run_dir.name, id=run_id, resume="allow",
                          dir=str(run_dir), config=dict(self.config or {}))
