"""Where the model runs: its device, and whether torchrun started this process."""

from __future__ import annotations

import os

import torch


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def resolve_device(device: torch.device | str | None) -> torch.device:
    """A torch device or its name (default cuda if available); m3lm runs on the CPU and NVIDIA
    GPUs, and a device this machine lacks is a ValueError that says what to use instead."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {str(device)!r} is not a device; use cuda, cuda:N (an NVIDIA GPU) or cpu"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device {str(device)!r}: m3lm runs on NVIDIA GPUs (cuda) and the CPU; use --device cpu"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(
            f"device {str(device)!r}: torch {torch.__version__} ({build}) sees no CUDA GPU; use --device cpu"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return dev


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list as a tensor on `device`; on a GPU through pinned memory, so that the copy is
    queued behind the work already launched instead of waiting for it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
