"""A Responses request (`POST /v1/responses`) and what it means as a chat completion request.

The mapping:
- `instructions` is the system message (not carried to a later response, as OpenAI does);
  `input` text is a user message; message items keep their role (text parts joined with
  newlines); `function_call` items are the assistant's tool calls and `function_call_output`
  items tool messages; `reasoning` items sent back are the turn's reasoning (their
  `reasoning_text` content, else their summary text);
- `reasoning.effort` is chat's `reasoning_effort`, a level of the served model's (`effort.Efforts`:
  on M3 a thinking mode and a reasoning budget, `none` and `minimal` no reasoning, `low` /
  `medium` / `high` 512 / 2048 / 8192 tokens, `xhigh` and `max` unbounded, and without it the
  template's default (adaptive) holds; on M3.1-Flash the template's `reasoning_effort`);
- function `tools`, `tool_choice` (`auto`, `none`, `required`, a named function) and
  `parallel_tool_calls` as in chat, with the same enforcement; a `namespace` tool's functions
  (Codex's MCP servers) join them as `NAMESPACE__NAME`, and their calls come back with
  `namespace` and `name` apart; tools the server cannot run or this model cannot call
  (`DROPPED_TOOLS`: `web_search`, `tool_search`, `custom`, ...) are left out, with a warning the
  first time each type is met; `max_output_tokens` is
  `max_tokens`; `text.format` is chat's `response_format`, with the same support;
  `text.verbosity` is accepted and ignored;
- `previous_response_id` continues a stored response: responses made with `store` (default
  true) are kept in this process (`response_store`: bounded, fair between keys), each within its
  API key's namespace, and `GET /v1/responses/{id}` returns them;
- accepted and ignored: `include` (`reasoning.encrypted_content`: the reasoning text is always in
  the reasoning item), `prompt_cache_key` (prefix caching is automatic), `client_metadata`,
  `metadata` (echoed), `user`, `service_tier`, `safety_identifier`, `truncation: "disabled"`;
  refused: other tool types, other `include` values, `background`, `conversation`, `prompt`,
  `truncation: "auto"`, `top_logprobs`, `max_tool_calls`, image, file and audio parts.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from m3lm.server.protocol import ChatCompletionRequest, _Body, check_text_parts

log = logging.getLogger("m3lm.server")
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's limits
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# Tools the client declares but the server (or the client, in a form this model cannot call) would
# have to run: dropped from what the model sees, with a warning the first time each is met.
DROPPED_TOOLS = (
    "web_search", "web_search_preview", "tool_search", "file_search", "code_interpreter",
    "image_generation", "computer_use_preview", "mcp", "local_shell", "custom",
)  # fmt: skip
_warned: set[str] = set()


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # ids, status, phase, ...


class Part(_Item):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[Part] = []
    content: list[Part] | None = None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(lambda v: v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)),
]


class FunctionTool(_Item):
    type: str
    name: str | None = Field(None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Item):
    effort: str | None = None  # a level of the served model's (`effort.Efforts`)
    summary: str | None = None


class TextConfig(_Item):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_items(cls, data: Any) -> Any:
        """Name an item or part type this server cannot read rather than its shape."""
        items = data.get("input") if isinstance(data, dict) else None
        for item in items if isinstance(items, list) else ():
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in _ITEM_TYPES:
                raise ValueError(
                    f"input items of type {kind!r} are not supported (only {', '.join(_ITEM_TYPES)})"
                )
            check_text_parts(item.get("content") if kind == "message" else None, _TEXT_PARTS)
        return data

    def check_supported(self) -> None:
        """Refuse the fields this server cannot honour (ValueError: a 400)."""
        refused = {
            "background": self.background,
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
        }
        if named := [k for k, v in refused.items() if v]:
            raise ValueError(f"{', '.join(named)}: not supported by this server")
        check_metadata(self.metadata)
        if self.truncation == "auto":
            raise ValueError(
                'truncation "auto" is not supported: a conversation longer than the context is refused'
            )
        if bad := [i for i in self.include or () if i != "reasoning.encrypted_content"]:
            raise ValueError(f"include {bad} is not supported (only reasoning.encrypted_content)")

    def input_items(self) -> list[dict]:
        """The input as items (text is one user message), as stored for a later response."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [i.model_dump(exclude_none=True) for i in self.input]


def _text(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text") or p.get("refusal") or "" for p in content)


def chat_messages(items: list[dict]) -> list[dict]:
    """Responses items -> chat messages: reasoning, assistant text and function calls that follow
    one another are one assistant turn; a reasoning item after text or calls starts the next."""
    out: list[dict] = []
    turn: dict | None = None
    for item in items:
        kind = item.get("type", "message")
        if kind in ("reasoning", "function_call") or (kind == "message" and item["role"] == "assistant"):
            ends_turn = {"reasoning": ("content", "tool_calls"), "message": ("tool_calls",)}.get(kind, ())
            if turn is not None and any(turn[k] for k in ends_turn):
                out.append(turn)
                turn = None
            turn = turn or {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
            if kind == "function_call":
                fn = {"name": flat_name(item.get("namespace"), item["name"]), "arguments": item["arguments"]}
                turn["tool_calls"].append({"id": item["call_id"], "type": "function", "function": fn})
            else:
                key = "reasoning_content" if kind == "reasoning" else "content"
                text = _text(item.get("content") or item.get("summary") or [])
                turn[key] = f"{turn[key]}\n{text}" if turn[key] else text
            continue
        if turn is not None:
            out.append(turn)
            turn = None
        if kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        else:
            out.append({"role": item["role"], "content": _text(item["content"])})
    if turn is not None:
        out.append(turn)
    return [{k: v for k, v in m.items() if v or k == "content"} for m in out]


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for function `name` of a `namespace` tool (Codex groups each MCP
    server's functions in one)."""
    return f"{namespace}__{name}" if namespace else name


def chat_tools(tools: list[FunctionTool]) -> tuple[list[dict], dict[str, tuple[str, str]]]:
    """Responses tools -> chat function tools, and the namespaced functions' flat names ->
    (namespace, name). A namespace's functions join the list under their flat names (a call of one
    goes back with `namespace` and its own `name`); tools of `DROPPED_TOOLS` types are left out
    (ValueError, a 400, for other types)."""
    out, names = [], {}

    def add(fn: dict, name: str) -> None:
        keys = ("description", "parameters", "strict")
        out.append({"type": "function", "function": {"name": name, **{k: fn[k] for k in keys if k in fn}}})

    for i, t in enumerate(tools):
        d = t.model_dump(exclude_none=True)
        if t.type == "function" and t.name is not None:
            add(d, t.name)
        elif t.type == "namespace" and t.name is not None and isinstance(d.get("tools"), list):
            for j, f in enumerate(d["tools"]):
                if (
                    not isinstance(f, dict)
                    or f.get("type") != "function"
                    or not isinstance(f.get("name"), str)
                ):
                    _warn_once(f"tools.{i}.tools.{j}", f.get("type") if isinstance(f, dict) else None)
                    continue
                names[flat_name(t.name, f["name"])] = (t.name, f["name"])
                add(f, flat_name(t.name, f["name"]))
        elif t.type in DROPPED_TOOLS:
            _warn_once(f"tools.{i}", t.type)
        else:
            raise ValueError(
                f"tools.{i}: tools of type {t.type!r} are not supported (function and namespace tools; "
                f"{', '.join(DROPPED_TOOLS)} are left out)"
            )
    return out, names


def _warn_once(where: str, kind: object) -> None:
    if str(kind) not in _warned:
        _warned.add(str(kind))
        log.warning(
            "%s: a tool of type %r is left out: this server's model calls function tools only", where, kind
        )


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice {choice!r} is not supported (auto, none, required or a function)")


def _response_format(fmt: dict | None) -> dict | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    return {"type": fmt.get("type")}


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat completion request a Responses request means, after the `history` items of the
    response it continues (ValueError: a 400)."""
    req.check_supported()
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += chat_messages(history + req.input_items())
    if not messages:
        raise ValueError("input is empty")
    tools, _ = chat_tools(req.tools or [])
    body: dict[str, Any] = {
        "messages": messages,
        "tools": tools or None,
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "response_format": _response_format(req.text.format if req.text else None),
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits on `metadata`: 16 pairs, keys of 64 characters, values of 512."""
    if metadata is None:
        return
    if len(metadata) > METADATA_PAIRS:
        raise ValueError(f"metadata: {len(metadata)} pairs, at most {METADATA_PAIRS}")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY:
            raise ValueError(f"metadata: a key of {len(key)} characters, at most {METADATA_KEY}")
        if len(value) > METADATA_VALUE:
            raise ValueError(f"metadata[{key!r}]: {len(value)} characters, at most {METADATA_VALUE}")
