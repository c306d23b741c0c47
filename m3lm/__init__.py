"""m3lm: an exact and fast inference engine for MiniMax-M3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from m3lm.config import ModelArgs
from m3lm.errors import CheckpointError, ConfigError, M3lmError
from m3lm.loader import load_model
from m3lm.models.minimax_m3 import MiniMaxM3

__version__ = "0.1.0"
__all__ = ["CheckpointError", "ConfigError", "M3lmError", "MiniMaxM3", "ModelArgs", "load", "load_model"]


def load(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | str | None = None
) -> tuple[MiniMaxM3, Any]:
    """Load a local checkpoint directory: returns (model, tokenizer). The tokenizer is None for now."""
    return load_model(path, device=device, dtype=dtype), None
