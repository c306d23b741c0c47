"""Host-side choices shared by the Triton wrappers: tile extents, matmul precision, GPU size."""

from __future__ import annotations

import os

import torch
import triton


def pad(n: int) -> int:
    """Tile extent for n: a power of two, at least 16 (the matrix units' smallest K)."""
    return max(16, triton.next_power_of_2(n))


def precision(t: torch.Tensor) -> str:
    """fp32 inputs multiply in full fp32 (the reference's precision), not tf32."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def interpreted() -> bool:
    """Running in Triton's interpreter (the CPU twins): loops need constant bounds there."""
    return os.environ.get("TRITON_INTERPRET") == "1"
