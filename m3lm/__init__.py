"""m3lm: an exact and fast inference engine for MiniMax-M3.

The public names are imported on first use, so that `m3lm --help` and `m3lm --version` answer
without loading torch; inside the package, modules import from the module that defines a name.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from m3lm.assets import DEFAULT_DRAFTER, DEFAULT_MODEL
from m3lm.threads import quiet_waits
from m3lm.version import __version__

if "torch" not in sys.modules:  # OpenMP reads its wait policy when torch loads it
    quiet_waits()

if TYPE_CHECKING:
    from m3lm.config import EngineConfig, ModelArgs
    from m3lm.core import SamplingParams
    from m3lm.errors import CheckpointError, ConfigError, M3lmError
    from m3lm.generation import GenerationResult, generate, session_engine, stream_generate
    from m3lm.loader import load, load_model, read_generation_config
    from m3lm.models.minimax_m3 import MiniMaxM3

_HOMES = {
    "EngineConfig": "m3lm.config",
    "ModelArgs": "m3lm.config",
    "SamplingParams": "m3lm.core",
    "CheckpointError": "m3lm.errors",
    "ConfigError": "m3lm.errors",
    "M3lmError": "m3lm.errors",
    "GenerationResult": "m3lm.generation",
    "generate": "m3lm.generation",
    "session_engine": "m3lm.generation",
    "stream_generate": "m3lm.generation",
    "LLM": "m3lm.llm",
    "load": "m3lm.loader",
    "load_model": "m3lm.loader",
    "read_generation_config": "m3lm.loader",
    "MiniMaxM3": "m3lm.models.minimax_m3",
}
__all__ = [
    "DEFAULT_DRAFTER",
    "DEFAULT_MODEL",
    "LLM",
    "CheckpointError",
    "ConfigError",
    "EngineConfig",
    "GenerationResult",
    "M3lmError",
    "MiniMaxM3",
    "ModelArgs",
    "SamplingParams",
    "__version__",
    "generate",
    "load",
    "load_model",
    "read_generation_config",
    "session_engine",
    "stream_generate",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'm3lm' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
