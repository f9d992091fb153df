"""The one place in kvguard.workers that knows about devices (cpu / cuda).

Everything else asks this module: which device, which dtype, how much memory a KV pool may use,
how to seed. Keeping the CUDA branches here means the engine stays correct on GPUs even though the
development machine has none.
"""

from __future__ import annotations

import random

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# A CPU has no allocator to ask, so the KV budget on CPU is a configured number of bytes.
DEFAULT_CPU_MEMORY_BYTES = 2 * 1024**3


def resolve_device(name: str) -> torch.device:
    """`auto` -> `cuda` when available else `cpu`; `cpu`, `cuda`, `cuda:N` as given (validated)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r} (use auto, cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """Map a dtype name (`float32`, `bfloat16`, `float16`) to a torch dtype."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (use one of {sorted(DTYPES)})")
    return DTYPES[name]


def memory_info(device: torch.device, cpu_memory_bytes: int = DEFAULT_CPU_MEMORY_BYTES) -> tuple[int, int]:
    """(free, total) bytes on the device now. On CPU: the configured budget minus what torch holds
    is not knowable, so both are the budget and the caller subtracts its weights."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return cpu_memory_bytes, cpu_memory_bytes


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (benchmarks time real work, not kernel launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    """Seed Python, torch CPU and (when present) CUDA generators."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A per-request sampling generator on the device the logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def default_dtype(device: torch.device, model_dtype: str | None) -> torch.dtype:
    """`--dtype auto`: float32 on CPU (bf16 matmuls are slow there); the checkpoint's dtype on CUDA,
    bfloat16 if it names none."""
    if device.type == "cpu":
        return torch.float32
    if model_dtype in DTYPES:
        return DTYPES[model_dtype]
    return torch.bfloat16
