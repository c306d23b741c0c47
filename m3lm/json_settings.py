"""Settings given as one JSON object: a command line's `--...-config '{...}'` or a dict."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from m3lm.errors import ConfigError


def json_settings(value: dict | str, name: str, keys: Sequence[str]) -> dict[str, Any]:
    """`value` (a dict or its JSON text) as a dict of known `keys`; ConfigError naming `name` and
    the first unknown key otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(f"{name}: unknown key {unknown[0]!r} (known: {', '.join(keys)})")
    return value
