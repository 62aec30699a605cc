"""Atomic checkpoints: round trips (model, optimizer, RNG, buffer), rotation, corruption, SIGKILL."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from copc.runtime.buffer import TrajectoryBuffer
from copc.runtime.staleness import StalenessConfig
from copc.trainer.checkpoint import (
    CheckpointError,
    capture_rng_state,
    checkpoint_root,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from copc.types import Prompt, StopReason, Trajectory


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_resume_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    save_checkpoint(tmp_path, 5, {"rng": capture_rng_state()})
    expected = [_draws() for _ in range(3)]
    _draws()  # move every generator on before resuming
    loaded = load_latest(tmp_path)
    assert loaded is not None
    step, payload = loaded
    assert step == 5 and payload["step"] == 5
    restore_rng_state(payload["rng"])  # type: ignore[arg-type]
    assert [_draws() for _ in range(3)] == expected


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=gen)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_model_and_optimizer_resume_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0)
    save_checkpoint(tmp_path, 1, {"policy": model.state_dict(), "optim": opt.state_dict(), "version": 1})
    _train_step(model, opt, 1)

    resumed = torch.nn.Linear(4, 2)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    loaded = load_latest(tmp_path)
    assert loaded is not None
    _, payload = loaded
    resumed.load_state_dict(payload["policy"])  # type: ignore[arg-type]
    resumed_opt.load_state_dict(payload["optim"])  # type: ignore[arg-type]
    _train_step(resumed, resumed_opt, 1)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)  # same ops, same order on CPU: bit-identical


def test_buffer_state_survives(tmp_path):
    buf = TrajectoryBuffer(StalenessConfig(mode="fixed_lag", staleness=1), batch_size=1)
    prompt = Prompt(id="q", text="2+2", answers=("4",))
    buf.admit(0, [prompt, Prompt(id="r", text="1+1", answers=("2",))])
    version_L = torch.tensor([-1, 0, 0])
    buf.put(
        [
            Trajectory(
                prompt_id="r",
                token_ids=torch.tensor([5, 6, 7]),
                prompt_len=1,
                action_mask=version_L >= 0,
                logp_behav=torch.tensor([0.0, -0.5, -0.25]),
                policy_version=version_L,
                reward=1.0,
                token_rewards=torch.tensor([0.0, 0.0, 1.0]),
                stop_reason=StopReason.ANSWER,
            )
        ]
    )
    save_checkpoint(tmp_path, 0, {"buffer": buf.state_dict(), "config": {"staleness": {"staleness": 1}}})
    loaded = load_latest(tmp_path)
    assert loaded is not None
    restored = TrajectoryBuffer(StalenessConfig(mode="fixed_lag", staleness=1), batch_size=1)
    restored.load_state_dict(loaded[1]["buffer"])  # type: ignore[arg-type]
    assert restored.take_requeued() == [prompt]
    batch = restored.get_batch(0)
    assert batch is not None and batch[0].prompt_id == "r" and batch[0].reward == 1.0
    assert loaded[1]["config"] == {"staleness": {"staleness": 1}}


def test_rotation_keeps_last_k_and_latest(tmp_path):
    for step in range(6):
        save_checkpoint(tmp_path, step, {"x": torch.tensor([step])}, keep=2)
    assert list_checkpoints(tmp_path) == [4, 5]
    assert (checkpoint_root(tmp_path) / "latest").read_text().strip() == "step_00000005"
    assert not list(checkpoint_root(tmp_path).glob(".tmp-*"))
    # re-saving an existing step (after a resume) replaces it
    save_checkpoint(tmp_path, 5, {"x": torch.tensor([50])}, keep=2)
    assert not list(checkpoint_root(tmp_path).glob(".tmp-*"))  # the replaced one is gone too
    loaded = load_latest(tmp_path)
    assert loaded is not None and int(loaded[1]["x"][0]) == 50  # type: ignore[index]
    # resuming from step 4 and saving step 5 again is fine; saving step 3 after a resume from an
    # older checkpoint discards the abandoned future (4, 5) so no fallback can jump into it
    save_checkpoint(tmp_path, 3, {"x": torch.tensor([3])}, keep=2)
    assert list_checkpoints(tmp_path) == [3]
    assert load_latest(tmp_path)[0] == 3  # type: ignore[index]


def test_load_latest_ignores_partial_and_corrupt(tmp_path):
    assert load_latest(tmp_path) is None
    save_checkpoint(tmp_path, 1, {"x": torch.tensor([1])}, keep=5)
    newest = save_checkpoint(tmp_path, 2, {"x": torch.tensor([2])}, keep=5)
    root = checkpoint_root(tmp_path)
    # a killed writer's temp dir with a newer step: ignored
    half = root / ".tmp-step_00000003-deadbeef"
    half.mkdir()
    (half / "state.pt").write_bytes(b"half")
    assert load_latest(tmp_path)[0] == 2  # type: ignore[index]
    # corrupt the newest checkpoint: the pointer's target fails verification, fall back to step 1
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[:-3] + b"xyz")
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(newest)
    with pytest.raises(CheckpointError):
        load_checkpoint(newest)
    assert load_latest(tmp_path)[0] == 1  # type: ignore[index]
    skipped: list[str] = []  # the fallback is reported (issue 18: it said nothing)
    assert load_latest(tmp_path, on_skip=skipped.append)[0] == 1  # type: ignore[index]
    assert len(skipped) == 1 and "step_00000002" in skipped[0] and "sha256" in skipped[0]
    # a garbage pointer is ignored too
    (root / "latest").write_text("../../etc\n")
    assert load_latest(tmp_path)[0] == 1  # type: ignore[index]


def test_payload_must_be_plain_data(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"payload\['rng'\]\['np'\] is a numpy.ndarray; convert it to a tensor"
    ):
        save_checkpoint(tmp_path, 0, {"rng": {"np": np.zeros(3)}})
    assert load_latest(tmp_path) is None  # nothing was written
    # a file that is not a torch payload at all fails with a clear error, not a pickle traceback
    path = save_checkpoint(tmp_path, 0, {"x": 1})
    (path / "state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot load"):
        load_checkpoint(path, verify=False)


def _writer_loop(run_dir: str, ready) -> None:  # runs in a forked child until SIGKILLed
    loaded = load_latest(run_dir)
    step = 0 if loaded is None else loaded[0] + 1
    ready.set()
    while True:
        # ~4 MB per checkpoint so a kill often lands mid-write; content is a function of the step
        payload = {"weights": torch.full((1_000_000,), float(step)), "version": step, "tag": f"s{step}"}
        save_checkpoint(run_dir, step, payload, keep=2)
        step += 1


def test_sigkill_at_random_times_never_leaves_a_loadable_partial_checkpoint(tmp_path):
    """Kill a process that writes checkpoints in a loop, at random moments, many times; after each
    kill every step_* directory verifies, load_latest returns a complete checkpoint whose content
    matches its step, and steps never go backwards across restarts (the writer resumes from
    load_latest). The writer is forked from this process (torch already imported, one thread), so
    each round costs the random delay, not an interpreter start."""
    ctx = multiprocessing.get_context("fork")
    # warm up in this process first: every lazy import save/load needs happens before any fork, so a
    # forked child never needs the import lock another thread might hold
    save_checkpoint(tmp_path / "warmup", 0, {"weights": torch.zeros(2)})
    assert load_latest(tmp_path / "warmup") is not None
    run_dir = tmp_path / "run"
    rng = random.Random(1234)
    last_step = -1
    for _ in range(10):
        ready = ctx.Event()
        proc = ctx.Process(target=_writer_loop, args=(str(run_dir), ready), daemon=True)
        proc.start()
        assert ready.wait(timeout=60)
        time.sleep(rng.uniform(0.0, 0.4))
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        assert proc.exitcode == -signal.SIGKILL
        # the protocol's invariant: every step_* directory on disk is complete
        for other in list_checkpoints(run_dir):
            assert verify_checkpoint(checkpoint_root(run_dir) / f"step_{other:08d}") == other
        loaded = load_latest(run_dir)
        if loaded is None:  # killed before the first save completed
            assert last_step == -1
            continue
        step, payload = loaded
        weights = payload["weights"]
        assert isinstance(weights, torch.Tensor) and weights.shape == (1_000_000,)
        assert bool((weights == float(step)).all())
        assert payload["version"] == step and payload["tag"] == f"s{step}" and payload["step"] == step
        assert step >= last_step
        last_step = step
    assert last_step >= 3, "the writer completed few checkpoints; the test exercised little"
    # kills between a rename and its pruning can leave extra (complete) checkpoints behind; the next
    # save that finishes prunes back to `keep`
    save_checkpoint(run_dir, last_step + 1, {"weights": torch.zeros(1)}, keep=2)
    assert list_checkpoints(run_dir) == [last_step, last_step + 1]
    assert not list(checkpoint_root(run_dir).glob(".tmp-*"))


def test_keep_must_be_positive(tmp_path: Path):
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 0, {}, keep=0)


# ------------------------------------------------------------------ weights as safetensors files
def test_weights_are_safetensors_files_with_tied_tensors_once(tmp_path):
    """Issue 17: a state dict marked Weights is its own .safetensors file (readable without torch's
    pickle), tied tensors stored once and tied again on load, bit-exact."""
    from safetensors.torch import load_file

    from copc.trainer.weight_files import Weights

    torch.manual_seed(0)
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # tied, as in SmolLM2
    state = {**{f"embed.{k}": v for k, v in embed.state_dict().items()},
             **{f"head.{k}": v for k, v in head.state_dict().items()}, "odd": torch.arange(6.0).view(2,
                                                                                                     3).t()}
    path = save_checkpoint(tmp_path, 3, {"trainer": {"policy": Weights(state), "version": 3},
                                         "snapshots": {7: Weights({"w": torch.ones(2)})}})
    names = sorted(p.name for p in path.iterdir())
    assert names == ["meta.json", "snapshots.7.safetensors", "state.pt", "trainer.policy.safetensors"]
    on_disk = load_file(path / "trainer.policy.safetensors")
    assert sorted(on_disk) == ["embed.weight", "odd"]  # head.weight is an alias of embed.weight
    loaded = load_checkpoint(path)
    policy = loaded["trainer"]["policy"]  # type: ignore[index]
    assert sorted(policy) == sorted(state)
    for key, tensor in state.items():
        assert torch.equal(policy[key], tensor) and policy[key].dtype == tensor.dtype
    assert policy["head.weight"].data_ptr() == policy["embed.weight"].data_ptr()
    assert torch.equal(loaded["snapshots"][7]["w"], torch.ones(2))  # type: ignore[index]
    assert loaded["trainer"]["version"] == 3  # type: ignore[index]


def test_a_damaged_weights_file_falls_back_to_the_previous_checkpoint(tmp_path):
    from copc.trainer.weight_files import Weights

    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"policy": Weights({"w": torch.full((64,), float(step))})})
    damaged = checkpoint_root(tmp_path) / "step_00000002" / "policy.safetensors"
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 1
    damaged.write_bytes(bytes(raw))
    skipped: list[str] = []
    loaded = load_latest(tmp_path, on_skip=skipped.append)
    assert loaded is not None and loaded[0] == 1
    assert torch.equal(loaded[1]["policy"]["w"], torch.full((64,), 1.0))  # type: ignore[index]
    assert len(skipped) == 1 and "policy.safetensors does not match its sha256" in skipped[0]


def test_identical_weight_sets_are_written_once(tmp_path):
    """The driver's snapshot of the newest version equals the trained policy: one file, two references."""
    from copc.trainer.weight_files import Weights

    policy = {"a": torch.arange(4.0), "b": torch.ones(2, 2)}
    snapshot = {k: v.clone() for k, v in policy.items()}  # same values, other storage
    other = {"a": torch.arange(4.0), "b": torch.ones(2, 2).to(torch.bfloat16)}  # same values, other dtype
    path = save_checkpoint(tmp_path, 1, {"trainer": {"policy": Weights(policy)},
                                         "source": {"snapshots": {1: Weights(snapshot), 0: Weights(other)}}})
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json", "source.snapshots.0.safetensors", "state.pt", "trainer.policy.safetensors"]
    loaded = load_checkpoint(path)
    again = loaded["source"]["snapshots"][1]  # type: ignore[index]
    assert all(torch.equal(again[k], policy[k]) for k in policy)  # type: ignore[index]
    assert loaded["source"]["snapshots"][0]["b"].dtype == torch.bfloat16  # type: ignore[index]
