"""One vocabulary for how much a reply reasons, on every API: chat's `reasoning_effort`,
Responses' `reasoning.effort` and Anthropic's `output_config.effort` name a level, and the served
model's `Efforts` (from its chat template: `efforts_of`) says which levels it takes and how a
level reaches it:

- MiniMax-M3 (`M3_EFFORTS`): a level is the template's `thinking_mode` and a reasoning budget
  (`EFFORTS`: tokens after which the closer is forced, as chat's `thinking_token_budget`); a mode
  or a budget the request gives itself (`chat_template_kwargs.thinking_mode`,
  `thinking_token_budget`, Anthropic's `thinking`) wins over the effort's; no effort, no change.
- MiniMax-M3.1-Flash (`FLASH_EFFORTS`): thinking is always on and the model spends its own
  effort; the level is the template variable `reasoning_effort` (default `max`), with no budget
  of the server's. `none`, `minimal` or a disabled thinking mode is a 400 naming the levels.

This is the one place that knows how the two checkpoints differ here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EFFORTS: dict[str, tuple[str, int | None]] = {  # effort: (thinking_mode, budget; None: unbounded)
    "none": ("disabled", None),
    "minimal": ("disabled", None),
    "low": ("enabled", 512),
    "medium": ("enabled", 2048),
    "high": ("enabled", 8192),
    "xhigh": ("enabled", None),
    "max": ("enabled", None),
}

ANTHROPIC_FIELD = "output_config.effort"
TEMPLATE_VARIABLE = "reasoning_effort"  # what an M3.1-Flash template reads (the chat field's name)


class EffortError(ValueError):
    """A level or a mode the served model refuses (a 400 naming `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Efforts:
    """The effort levels a served model takes and how a level reaches its template."""

    levels: tuple[str, ...]  # on chat's reasoning_effort and Responses' reasoning.effort
    anthropic_levels: tuple[str, ...]  # on Anthropic's output_config.effort
    default: str | None  # the level of a request that names none (None: the template's own default)
    variable: str | None  # the template variable the level is; None: `EFFORTS`' mode and budget

    def accepted(self, field: str) -> tuple[str, ...]:
        return self.anthropic_levels if field == ANTHROPIC_FIELD else self.levels

    def effective(self, effort: str | None) -> str | None:
        """The level a request with `effort` gets."""
        return self.default if effort is None else effort

    def card(self) -> dict[str, Any]:
        """`/v1/models`' fields: the levels chat and Responses take, and the default."""
        return {"reasoning_efforts": list(self.levels), "default_reasoning_effort": self.default}

    def resolve(
        self, effort: str | None, field: str, kwargs: dict[str, Any] | None, budget: int | None
    ) -> tuple[dict[str, Any] | None, int | None]:
        """A chat request's template arguments and reasoning budget once its `effort` (named
        `field` in its API) is applied; ValueError for a level or a mode this model refuses."""
        if effort is not None and effort not in self.accepted(field):
            raise EffortError(f"{field}: {_should_be(self.accepted(field))}{self._why(effort)}", field)
        if self.variable is None:
            if effort is None:
                return kwargs, budget
            mode, own = EFFORTS[effort]
            kwargs = {**(kwargs or {})}
            kwargs.setdefault("thinking_mode", mode)
            if budget is None and kwargs["thinking_mode"] != "disabled":
                budget = own
            return kwargs, budget
        kwargs = {**(kwargs or {})}
        if kwargs.get("thinking_mode") == "disabled":
            raise EffortError(
                f"this model always thinks: thinking cannot be disabled; choose how much it reasons "
                f"with an effort level ({', '.join(self.levels)})",
                "chat_template_kwargs.thinking_mode",
            )
        name = f"chat_template_kwargs.{self.variable}"
        given = kwargs.get(self.variable)
        if given is not None and given not in self.levels:
            raise EffortError(f"{name}: {_should_be(self.levels)}{self._why(given)}", name)
        if given is not None and effort is not None and given != effort:
            raise EffortError(f"{field} is {effort!r} but {name} is {given!r}: give one of them", field)
        kwargs[self.variable] = given if given is not None else self.effective(effort)
        return kwargs, budget

    def _why(self, value: Any) -> str:
        if self.variable is not None and value in ("none", "minimal"):
            return " (this model always thinks: it has no level without reasoning)"
        return ""


def _should_be(levels: tuple[str, ...]) -> str:
    """pydantic's words for a literal, so that every API's refusal reads alike."""
    quoted = [repr(x) for x in levels]
    return f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]}"


M3_EFFORTS = Efforts(tuple(EFFORTS), ("low", "medium", "high", "max"), None, None)
FLASH_EFFORTS = Efforts(
    ("low", "medium", "high", "xhigh", "max"),
    ("low", "medium", "high", "xhigh", "max"),
    "max",
    TEMPLATE_VARIABLE,
)


def efforts_of(chat_template: str | dict[str, str] | None) -> Efforts | None:
    """The served model's levels, from its chat template (None: no chat template). A template that
    reads `reasoning_effort` is MiniMax-M3.1-Flash's; any other is MiniMax-M3's."""
    if not chat_template:
        return None
    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return FLASH_EFFORTS if any(TEMPLATE_VARIABLE in _reads(s) for s in sources) else M3_EFFORTS


def _reads(source: str) -> set[str]:
    """The variables a Jinja template reads from its arguments."""
    import jinja2  # a dependency of transformers' chat templates
    from jinja2 import ext, meta

    try:  # transformers renders with loop controls (break, continue) on
        return meta.find_undeclared_variables(jinja2.Environment(extensions=[ext.loopcontrols]).parse(source))
    except jinja2.TemplateSyntaxError:
        return set()  # rendering will say what is wrong with it
