"""EngineConfig: every knob of one engine instance, validated once when it is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvguard.workers.device import DEFAULT_CPU_MEMORY_BYTES, DTYPES


@dataclass
class EngineConfig:
    """Configuration of one engine (model + KV pool + scheduler).

    The KV pool size is `kv_pool_tokens` when given, else derived from device memory as SGLang
    does: `(free_after_weights - total * (1 - kv_memory_fraction)) / bytes_per_token`, rounded down
    to whole pages. `context_length` defaults to the model's `max_position_embeddings` and may only
    be lowered. `tags=False` disables generation tags (S1/S5 checks); it exists only for
    `bench/tag_overhead.py` and the `no_tags` fault.
    """

    model_dir: Path | str
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    kv_pool_tokens: int | None = None
    kv_memory_fraction: float = 0.85
    device_share: float = 1.0  # of one CUDA device, where several engines share it (plan_pool_pages)
    cpu_memory_bytes: int = DEFAULT_CPU_MEMORY_BYTES
    context_length: int | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    tags: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model_dir: {self.model_dir} has no config.json")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not auto or one of {sorted(DTYPES)}")
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < self.page_size:
            raise ValueError(
                f"kv_pool_tokens: {self.kv_pool_tokens} is smaller than one page ({self.page_size})"
            )
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction: must be in (0, 1], got {self.kv_memory_fraction}")
        if not 0.0 < self.device_share <= 1.0:
            raise ValueError(f"device_share: must be in (0, 1], got {self.device_share}")
        if self.cpu_memory_bytes <= 0:
            raise ValueError(f"cpu_memory_bytes: must be > 0, got {self.cpu_memory_bytes}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length: must be >= 1, got {self.context_length}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests: must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens: must be >= 1, got {self.max_prefill_tokens}")
