"""m3lm: an exact and fast inference engine for MiniMax-M3."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from m3lm.config import EngineConfig, ModelArgs
from m3lm.core import SamplingParams
from m3lm.distributed.parallel import SINGLE, ParallelConfig
from m3lm.errors import CheckpointError, ConfigError, M3lmError
from m3lm.generate import GenerationResult, generate, session_engine, stream_generate
from m3lm.loader import check_dir, load_model
from m3lm.models.minimax_m3 import MiniMaxM3

__version__ = "0.1.0"
# The embedded default model: a 10M-parameter MiniMax-M3 (MSA + MoE) trained on short stories.
DEFAULT_MODEL = Path(__file__).parent / "assets" / "story"
__all__ = [
    "DEFAULT_MODEL",
    "CheckpointError",
    "ConfigError",
    "EngineConfig",
    "GenerationResult",
    "M3lmError",
    "MiniMaxM3",
    "ModelArgs",
    "SamplingParams",
    "generate",
    "load",
    "load_model",
    "session_engine",
    "stream_generate",
]


def load(
    path: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    quant: str | None = "auto",
    parallel: ParallelConfig = SINGLE,
    load_format: str = "auto",
    skip_tokenizer_init: bool = False,
) -> tuple[MiniMaxM3, Any]:
    """Load a local checkpoint directory: returns (model, tokenizer or None).

    `quant`: "auto" keeps an MXFP8 checkpoint's weights in 8 bits on a GPU, "mxfp8" always
    (quantising a bf16/fp32 checkpoint at load), "none" dequantises. With `parallel` (a rank of
    a tensor-parallel group) the model is that rank's shard, 8-bit where the weights are.
    The model carries the checkpoint's generation_config.json as `model.generation_config`
    (sampling defaults and EOS ids). `load_format="dummy"` builds the model from config.json
    alone with seeded random weights made on the device (`m3lm.loader.random_weights_`); with
    `skip_tokenizer_init` the tokenizer is None (token ids in and out).
    """
    from m3lm.tokenizer import load_tokenizer

    path = check_dir(path)
    model = load_model(
        path,
        device=device,
        dtype=dtype,
        progress=progress,
        quant=quant,
        parallel=parallel,
        load_format=load_format,
    )
    model.generation_config = read_generation_config(path)
    return model, None if skip_tokenizer_init else load_tokenizer(path)


def read_generation_config(path: Path) -> dict:
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{f}: must hold a JSON object")
    return data
