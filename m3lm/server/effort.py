"""One vocabulary for how much a reply reasons, on every API: an effort level is the template's
`thinking_mode` and a reasoning budget (tokens after which the closer is forced, as chat's
`thinking_token_budget`). Chat's `reasoning_effort`, Responses' `reasoning.effort` and
Anthropic's `output_config.effort` all read this table; a mode or a budget the request gives
itself (`chat_template_kwargs.thinking_mode`, `thinking_token_budget`, Anthropic's `thinking`)
wins over the effort's.
"""

from __future__ import annotations

from typing import Literal

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

EFFORTS: dict[str, tuple[str, int | None]] = {  # effort: (thinking_mode, budget; None: unbounded)
    "none": ("disabled", None),
    "minimal": ("disabled", None),
    "low": ("enabled", 512),
    "medium": ("enabled", 2048),
    "high": ("enabled", 8192),
    "xhigh": ("enabled", None),
    "max": ("enabled", None),
}


def apply_effort(body: dict, effort: str | None) -> dict:
    """A chat request body with `effort`'s mode and budget where the body sets neither."""
    if effort is None:
        return body
    mode, budget = EFFORTS[effort]
    kwargs = dict(body.get("chat_template_kwargs") or {})
    kwargs.setdefault("thinking_mode", mode)
    body["chat_template_kwargs"] = kwargs
    if body.get("thinking_token_budget") is None and kwargs["thinking_mode"] != "disabled":
        body["thinking_token_budget"] = budget
    return body
