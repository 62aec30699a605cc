"""Which code produced a run, with which libraries, and at what lag: the provenance a run carries.

A run's ``summary.json`` and every sweep record (copc.experiments.results) hold :func:`run_provenance`,
so a reader can tell which code made a number once the run directory is gone:

- ``commit``: the git commit of the checkout the imported ``copc`` package lives in, and
  ``commit_dirty``: whether that package's files differ from the commit (tracked changes or untracked
  files under the package folder; ``dirty_paths`` names up to :data:`DIRTY_PATHS_KEPT` of them). Both are
  ``None`` when copc does not run from a git checkout (an installed wheel, a ``git archive`` copy): then
  ``versions["copc"]``, the package's version, is all there is to go by. Git is asked once per process,
  each call with a timeout: provenance never holds up or fails a run. A run resumed by later code names
  the code of its last process, the one that wrote the summary.
- ``versions``: python, torch, transformers, numpy and copc as imported;
- ``method_resolved``: the method preset with ``method_overrides`` applied, every field of its policy,
  advantage and critic configs (a preset changed later leaves an old record's own copy as it ran);
- ``lag``: the lag the configuration gives its rollouts (:func:`stated_lag`). The staleness section alone
  can mislead: the sync driver under ``bounded`` staleness samples every batch with the current weights,
  so its lag is 0 whatever bound the section holds.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

import copc
from copc.config import ConfigValue, to_dict
from copc.run.config import RunConfig, resolve_method
from copc.runtime.staleness import StalenessConfig

__all__ = [
    "DIRTY_PATHS_KEPT",
    "GIT_TIMEOUT_S",
    "PROVENANCE_KEYS",
    "code_commit",
    "lag_text",
    "library_versions",
    "run_provenance",
    "stated_lag",
]

#: Seconds each git call may take before provenance gives up on git (commit and dirty flag None).
GIT_TIMEOUT_S = 10.0
#: How many changed paths ``dirty_paths`` names (a record stays a few KB).
DIRTY_PATHS_KEPT = 20
#: The keys :func:`run_provenance` gives (and a run's summary and a sweep record carry).
PROVENANCE_KEYS = ("commit", "commit_dirty", "dirty_paths", "versions", "method_resolved", "lag")
#: The libraries whose versions a run records, beside python.
LIBRARIES = ("torch", "transformers", "numpy")


def code_commit(package_dir: Path | None = None) -> dict[str, ConfigValue]:
    """``{"commit", "commit_dirty", "dirty_paths"}`` of the git checkout holding ``package_dir`` (default:
    the imported copc package); all ``None`` outside a checkout, when git is missing or too slow, or when
    the package is not tracked by the checkout around it (an install inside another repository)."""
    folder = Path(package_dir if package_dir is not None else Path(copc.__file__).parent).resolve()
    commit, dirty = _git_state(str(folder))
    return {"commit": commit, "commit_dirty": None if commit is None else bool(dirty),
            "dirty_paths": None if commit is None else list(dirty[:DIRTY_PATHS_KEPT])}


@functools.cache
def _git_state(folder: str) -> tuple[str | None, tuple[str, ...]]:
    """(HEAD's commit, the changed paths under ``folder``), asked once per folder and process."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S,
                              check=True).stdout

    try:
        # a folder git does not track (site-packages inside some repository) is no evidence of its code
        if not git("ls-files", "--", ".").strip():
            return None, ()
        commit = git("rev-parse", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=all", "--", ".").splitlines()
    except (OSError, subprocess.SubprocessError):
        return None, ()
    return commit or None, tuple(line[3:] for line in changed if line.strip())


def library_versions() -> dict[str, ConfigValue]:
    """python, torch, transformers, numpy and copc: the imported module's ``__version__`` where it is
    imported (what the run used), else the installed distribution's; ``None`` for one not installed."""
    versions: dict[str, ConfigValue] = {"python": platform.python_version(), "copc": copc.__version__}
    for name in LIBRARIES:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is None:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = None
        versions[name] = str(version) if version is not None else None
    return versions


def stated_lag(*, driver: str, staleness: StalenessConfig) -> dict[str, ConfigValue]:
    """The lag, in policy versions, the configuration gives the rollouts of each step (what a record states
    beside the lag it measured):

    - ``fixed_lag`` (any driver): exactly ``s`` (``nominal = at_most = s``; the first ``s`` steps, sampled
      by the warm start, have less);
    - ``bounded`` on the ``sync`` driver: 0, since it samples every batch with the current weights
      (copc.runtime.sync), so the bound ``s`` is never used (``nominal = at_most = 0``);
    - ``bounded`` on the ``async`` and ``ray`` drivers: at most ``s``; the lag each batch gets depends on
      timing (``nominal = None``, ``at_most = s``).
    """
    s = staleness.staleness
    if staleness.fixed_lag:
        return {"rule": "fixed_lag", "nominal": s, "at_most": s}
    if driver == "sync":
        return {"rule": "sync driver: current weights", "nominal": 0, "at_most": 0}
    return {"rule": f"bounded, {driver} driver", "nominal": None, "at_most": s}


def lag_text(lag: dict[str, ConfigValue]) -> str:
    """A :func:`stated_lag` in words: ``lag 16 (fixed_lag)``, ``lag 0 (sync driver: current weights)``,
    ``lag <= 8 (bounded, async driver)``."""
    amount = f"lag {lag['nominal']}" if lag["nominal"] is not None else f"lag <= {lag['at_most']}"
    return f"{amount} ({lag['rule']})"


def run_provenance(cfg: RunConfig) -> dict[str, ConfigValue]:
    """The provenance of a run of ``cfg`` made by this process (module docstring): ``commit``,
    ``commit_dirty``, ``dirty_paths``, ``versions``, ``method_resolved`` and ``lag``."""
    return {
        **code_commit(),
        "versions": library_versions(),
        "method_resolved": to_dict(resolve_method(cfg)),
        "lag": stated_lag(driver=cfg.driver.kind, staleness=cfg.staleness),
    }
