"""A checkpoint folder on disk: that it is there and is one, and that its files stay inside it.

m3lm reads local folders only; a checkpoint is data, so nothing in it (a symlink, a shard
index's file names) may make us read files elsewhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from m3lm.errors import CheckpointError, M3lmError

LOCAL_ONLY = (
    "m3lm reads a local checkpoint directory (config.json, safetensors, tokenizer) and never downloads"
)


def check_dir(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
            raise CheckpointError(
                f"model path {path} does not exist; if it names a model on a hub: {LOCAL_ONLY}, so "
                "download it first and pass its directory"
            )
        raise CheckpointError(f"model path {path} does not exist ({LOCAL_ONLY})")
    if not path.is_dir():
        kind = "a GGUF file" if path.suffix.lower() == ".gguf" else "a file"
        raise CheckpointError(f"model path {path} is {kind}: {LOCAL_ONLY}")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a model checkpoint directory)")
    check_inside(path, path / "config.json")
    return path


def inside(folder: Path, f: Path) -> bool:
    """Whether a file of the checkpoint, its symlinks followed, stays in the model folder (a
    checkpoint may not make us read files elsewhere). A hub cache's snapshot folder
    (`.../snapshots/<revision>`) links its files into the repository's `blobs` folder: those stay."""
    root, target = folder.resolve(), f.resolve()
    return target.is_relative_to(root) or (
        root.parent.name == "snapshots" and target.is_relative_to(root.parent.parent / "blobs")
    )


def check_inside(folder: Path, f: Path) -> None:
    if not inside(folder, f):
        raise CheckpointError(f"{f} leads outside the model folder (to {f.resolve()})")


def json_object(f: Path, error: type[M3lmError] = CheckpointError) -> dict[str, Any]:
    """A checkpoint file holding one JSON object; `error` (one line naming the file) otherwise."""
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise error(f"{f}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise error(f"{f}: must hold a JSON object")
    return data
