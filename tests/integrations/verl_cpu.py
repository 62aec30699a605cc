"""What verl 0.9.1 needs to run its own workers on CPU, for the tests only (not part of copc's plugin).

verl resolves its device through ``verl.plugin.platform`` and ships CUDA, NPU and ROCm platforms only; its
FSDP engine, ``TrainingWorker`` and process-group set-up are device-agnostic once a platform says
``device_name == "cpu"`` and ``communication_backend_name() == "gloo"``. Four shims, nothing else:

- :class:`PlatformCPU`, registered with verl's own ``set_platform`` (``PlatformBase``'s abstract
  methods; memory statistics are 0, seeding is torch's CPU generator);
- verl's FSDP engines (actor and critic) registered for device ``cpu`` too (verl registers them for
  ``cuda`` and ``npu``), with verl's own ``EngineRegistry.register``;
- the one-rank gloo process group, started before verl's (verl's backend string would name ``cpu`` twice);
- :func:`sdpa_valuehead_loader`, for ``verl.utils.model.load_valuehead_model``, which hard-codes
  ``attn_implementation="flash_attention_2"`` (CUDA only); the same ``from_pretrained`` call with SDPA.

:func:`tiny_model_dir` saves copc's download-free tiny Qwen3 (2 layers) and its byte tokenizer, so verl
loads it by path like any Hugging Face checkpoint.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase, set_platform


def _zero(*_: Any, **__: Any) -> int:
    return 0


def _none(*_: Any, **__: Any) -> None:
    return None


def _mem_get_info(*_: Any) -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return vm.available, vm.total


#: What verl calls on ``get_torch_device()`` (torch.cuda's API), answered for the CPU.
CPU_DEVICE_MODULE = SimpleNamespace(
    is_available=lambda: True,
    current_device=lambda: "cpu",
    device_count=lambda: 1,
    set_device=_none,
    synchronize=_none,
    empty_cache=_none,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    memory_allocated=_zero,
    memory_reserved=_zero,
    reset_peak_memory_stats=_none,
    set_per_process_memory_fraction=_none,
    mem_get_info=_mem_get_info,
    get_device_name=lambda *_: "CPU",  # verl's FLOPs table has a CPU entry
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
)


class PlatformCPU(PlatformBase):
    """verl platform ``cpu``: torch's CPU device, gloo collectives, no profiler, no IPC."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        # verl hands this to ``.to(...)`` and ``torch.device(...)``, where an int means an accelerator.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def sdpa_valuehead_loader(local_path: str, torch_dtype: Any, model_config: Any,
                          trust_remote_code: bool) -> Any:
    """verl's ``load_valuehead_model`` (token-classification head, ``num_labels=1``) with SDPA attention."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
    )


def install_cpu_platform() -> None:
    """Make this process a one-rank gloo "cluster" on CPU, as verl's Ray worker would see it on a GPU."""
    import verl.utils.model as verl_model

    with socket.socket() as s:  # a free port for torch.distributed's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    set_platform(PlatformCPU())
    verl_model.load_valuehead_model = sdpa_valuehead_loader
    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model",
                                                                          FSDPEngineWithValueHead)):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine)
    # verl would ask for "cpu:gloo,<device>:<backend>", i.e. "cpu:gloo,cpu:gloo", which torch refuses; it
    # keeps a group that is already up, so start the one-rank gloo group here.
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def tiny_model_dir(path: Path, *, seed: int = 0) -> Path:
    """copc's tiny 2-layer Qwen3 and byte tokenizer, saved where verl's ``model.path`` can point."""
    from copc.models.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, num_hidden_layers=2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
