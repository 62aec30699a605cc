"""``wandb=true``: the run's scalars mirrored to Weights & Biases, here in offline mode (no network); the
run directory holds the offline run with the same scalars as metrics.jsonl (issue 35, item 7)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from copc.config import ConfigError
from copc.run.config import load_run_config
from copc.run.train import train_cli

TINY = [
    "model.policy=tiny", "task_options={train_size: 100, eval_size: 8}", "steps=2", "checkpoint_every=1",
    "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8",
    "rollout.max_total_tokens=12", "eval.prompts=4", "eval.samples=2", "driver.kind=sync",
    "trainer.critic_warmup_steps=0", "plots=false",
]


def test_an_offline_wandb_run_mirrors_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    assert train_cli(["--no-progress", f"run_dir={run_dir}", *TINY, "wandb=true",
                      "wandb_project=copc-test"]) == 0
    run_id = (run_dir / "wandb_id").read_text().strip()
    [offline] = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    [log] = list(offline.glob("*.wandb"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}
    # W&B's writer (wandb-core) is its own process and may still be flushing when the run returns (seen
    # once beside two training runs): read the file until every step is there, for at most 60 s.
    deadline = time.monotonic() + 60.0
    while True:
        logged = _history(log)
        if set(rewards) <= set(logged) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert rewards and set(rewards) <= set(
        logged), f"steps {sorted(rewards)}, W&B history has {sorted(logged)}"
    assert all(logged[step]["reward/mean"] == value for step, value in rewards.items())
    assert wandb.__version__


def _history(log: Path) -> dict[int, dict[str, object]]:
    """The history rows of an offline ``.wandb`` file, by step, read with wandb's own protobuf schema."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    logged: dict[int, dict[str, object]] = {}
    for data in _records(log.read_bytes()):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(data)
        except DecodeError:  # the last record of a file still being written
            continue
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(
                item.value_json) for item in record.history.item}
            logged[int(items["_step"])] = items
    return logged


def _records(raw: bytes) -> list[bytes]:
    """The payloads of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB's log
    format: 32 KiB blocks of records ``crc32c (4) | length (2, little-endian) | type (1) | data``, a record
    split across blocks as FIRST / MIDDLE / LAST pieces (type 2-4; FULL = 1)."""
    assert raw[:4] == b":W&B"
    out, piece, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4: pos + 6], "little"), raw[pos + 6]
        data, pos = raw[pos + 7: pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding at the end of a block
            pos += block - pos % block if pos % block else 0
            continue
        piece = data if kind in (1, 2) else piece + data
        if kind in (1, 4):
            out.append(piece)
    return out


def test_wandb_without_the_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name,
                                                                                                        *a))
    with pytest.raises(ConfigError, match=r"wandb=true needs the wandb package: pip install 'copc\[wandb\]'"):
        load_run_config(None, ["model.policy=tiny", "wandb=true"])


def test_the_mirror_is_left_out_of_the_config_hash() -> None:
    from copc.config import to_dict
    from copc.experiments.results import config_hash

    plain, mirrored = (to_dict(load_run_config(None, o, strict=False)) for o in ([], ["wandb=true",
                                                                                      "wandb_project=x"]))
    assert config_hash(plain) == config_hash(mirrored)
    old = {k: v for k, v in plain.items() if k not in ("wandb", "wandb_project")}  # a record made before them
    assert config_hash(old) == config_hash(plain)
