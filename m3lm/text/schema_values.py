"""Reply-parsing pieces that need no tokenizer: typed values, bounded JSON, tool_choice, history.

The parsers themselves: `reasoning.ReplyParser` / `reasoning.parse_reply` for a whole reply
(reasoning split, then tool calls in the answer), `reasoning.ReasoningParser` and
`tools.ToolCallParser` for one concern each. This module holds what they share with the server:

- `type_value`: leaf text typed by a tool's JSON schema, never evaluated;
- `parse_json_bounded`: JSON with bounded nesting and finite numbers, for M2 object values and
  for tool-call arguments sent back in the history;
- `plan_tool_choice`: "none", or no tools in the request: no parsing, the reply is plain
  content. "auto": parse. "required": parse; where no grammar enforced the call and the model
  produced none, the reply goes out as content with
  finish_reason "stop" (a call is never invented; `missing_required_call` lets the server log or
  count it). A named function: parse and keep only calls to it. `parallel_tool_calls: false`
  keeps the first call;
- `template_messages`: OpenAI history -> the dicts the chat template renders.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 32  # nested elements / JSON containers per argument value
_MAX_NUMBER_CHARS = 1000  # int <-> str conversion is quadratic; Python refuses past 4300 digits


class _BadJson(Exception):
    """Internal: the text is not bounded, finite JSON (never escapes this module)."""


def new_call_id() -> str:
    """`call_` + 24 random hex digits, as OpenAI-style clients expect."""
    return "call_" + secrets.token_hex(12)


def tool_schemas(tools: Iterable[Mapping[str, Any]] | None) -> dict[str, Any]:
    """Map tool name -> parameters schema from OpenAI `tools` (bare function dicts work too)."""
    schemas: dict[str, Any] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            schemas[fn["name"]] = fn.get("parameters")
    return schemas


_INT = re.compile(r"-?[0-9]+")
_NUM = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _definitions(schema: Any) -> dict[str, Any]:
    return {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}


def resolved(schema: Any, defs: dict[str, Any] | None = None) -> Any:
    """`schema` with a local `$ref` (`#/$defs/NAME`, `#/definitions/NAME`) followed, carrying the
    root's definitions (`defs`, else its own) so that the parts below it resolve too."""
    if not isinstance(schema, dict):
        return schema
    defs = _definitions(schema) if defs is None else defs
    for _ in range(MAX_DEPTH):  # a ref to a ref, never forever
        ref = schema.get("$ref")
        kind, _, name = ref.removeprefix("#/").partition("/") if isinstance(ref, str) else ("", "", "")
        target = defs.get(kind, {}).get(name)
        if not isinstance(target, dict):
            break
        schema = target
    return {**schema, **defs} if defs else schema


def _alternatives(schema: Any) -> list[dict[str, Any]]:
    schema = resolved(schema)
    if not isinstance(schema, dict):
        return []
    defs = _definitions(schema)
    alts = [schema]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            alts.extend(resolved(s, defs) for s in schema[key] if isinstance(s, dict))
    return alts


def schema_types(schema: Any) -> set[str]:
    """JSON types a (possibly malformed, user-sent) schema allows, anyOf/oneOf included."""
    types: set[str] = set()
    for alt in _alternatives(schema):
        t = alt.get("type")
        if isinstance(t, str):
            types.add(t)
        elif isinstance(t, list):
            types.update(x for x in t if isinstance(x, str))
        elif "properties" in alt:
            types.add("object")
        elif "items" in alt:
            types.add("array")
        if alt.get("nullable") is True:
            types.add("null")
    return types


def child_schema(schema: Any, name: str) -> Any:
    """Schema of element `name` inside `schema` (`item` -> `items`), or None when unknown."""
    alts = _alternatives(schema)
    defs = _definitions(alts[0]) if alts else {}
    for alt in alts:
        if name == "item" and isinstance(alt.get("items"), dict):
            return resolved(alt["items"], defs)
        props = alt.get("properties")
        if isinstance(props, dict) and isinstance(props.get(name), dict):
            return resolved(props[name], defs)
    extra = next(
        (a["additionalProperties"] for a in alts if isinstance(a.get("additionalProperties"), dict)), None
    )
    return resolved(extra, defs)


def _number(s: str) -> int | float | None:
    """A finite JSON-style number, or None. Integers stay ints so `3` does not become `3.0`."""
    if len(s) > _MAX_NUMBER_CHARS or not _NUM.fullmatch(s):
        return None
    if _INT.fullmatch(s):
        return int(s)
    f = float(s)
    return f if math.isfinite(f) else None


def _integer(s: str) -> int | None:
    v = _number(s)
    if isinstance(v, float):
        return int(v) if v.is_integer() else None
    return v


def _enumerated(schema: Any) -> list[Any]:
    values: list[Any] = []
    for alt in _alternatives(schema):
        if isinstance(alt.get("enum"), list):
            values += alt["enum"]
        if "const" in alt:
            values.append(alt["const"])
    return values


def _rendered(value: Any) -> str | None:
    """A value as the chat template writes a leaf: strings verbatim, scalars as JSON."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return None


def type_value(text: str, schema: Any) -> Any:
    """Leaf text -> JSON value as the schema says; anything that does not fit stays a string.

    A member of the schema's `enum` (or its `const`) written as the template writes it is that
    member; strings are verbatim; numbers only when they parse and are finite (`1e999`, `nan`
    stay strings); null only when the schema allows it and the text is `null`; object/array
    leaves are empty containers or bounded JSON text. Nothing is ever evaluated.
    """
    found, member = _enum_member(text, schema)
    if found:
        return member
    types = schema_types(schema)
    if not types:
        return text
    s = text.strip()
    if "null" in types and s == "null":
        return None
    if "string" in types:
        return text
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if "integer" in types and (i := _integer(s)) is not None:
        return i
    if "number" in types and (n := _number(s)) is not None:
        return n
    found, container = _container(s, types)
    return container if found else text


def _enum_member(text: str, schema: Any) -> tuple[bool, Any]:
    """(True, the schema's `enum` or `const` member that `text` writes as the template writes it),
    else (False, None); a member may itself be None."""
    for value in _enumerated(schema):
        if (text if isinstance(value, str) else text.strip()) == _rendered(value):
            return True, value
    return False, None


def _container(s: str, types: set[str]) -> tuple[bool, Any]:
    """(True, the object or array that stripped leaf text `s` holds) when `types` allow one: an
    empty leaf is an empty container, else bounded JSON of an allowed kind; else (False, None)."""
    if not types & {"object", "array"}:
        return False, None
    if not s:
        return True, {} if "object" in types else []
    ok, v = parse_json_bounded(s)
    if ok and ((isinstance(v, dict) and "object" in types) or (isinstance(v, list) and "array" in types)):
        return True, v
    return False, None


_JSON_WS = re.compile(r"[ \t\n\r]*")
_JSON_STR = re.compile(r'"((?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*)"')
_JSON_NUM = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_JSON_ESC = re.compile(r"\\(u[0-9a-fA-F]{4}|.)")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SURROGATE = re.compile("[\ud800-\udfff]")


class _JsonReader:
    """Recursive descent bounded by MAX_DEPTH; numbers must be finite."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def skip(self, ch: str) -> bool:
        self.i = _JSON_WS.match(self.s, self.i).end()
        if self.s.startswith(ch, self.i):
            self.i += len(ch)
            return True
        return False

    def expect(self, ch: str) -> None:
        if not self.skip(ch):
            raise _BadJson(f"expected {ch!r} at {self.i}")

    def string(self) -> str:
        self.skip("")
        m = _JSON_STR.match(self.s, self.i)
        if not m:
            raise _BadJson(f"expected a string at {self.i}")
        self.i = m.end()
        out = _JSON_ESC.sub(lambda e: _ESCAPES.get(e.group(1)) or chr(int(e.group(1)[1:], 16)), m.group(1))
        if _SURROGATE.search(out):  # join escaped pairs, replace lone halves
            out = out.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return out

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _BadJson("JSON nested too deep")
        if self.skip("{"):
            return self.object(depth)
        if self.skip("["):
            return self.array(depth)
        if self.s.startswith('"', self.i):
            return self.string()
        return self.scalar()

    def object(self, depth: int) -> dict[str, Any]:
        """The members of an object whose `{` was just read, up to its `}`."""
        obj: dict[str, Any] = {}
        if self.skip("}"):
            return obj
        while True:
            key = self.string()
            self.expect(":")
            obj[key] = self.value(depth + 1)
            if self.skip("}"):
                return obj
            self.expect(",")

    def array(self, depth: int) -> list[Any]:
        """The items of an array whose `[` was just read, up to its `]`."""
        arr: list[Any] = []
        if self.skip("]"):
            return arr
        while True:
            arr.append(self.value(depth + 1))
            if self.skip("]"):
                return arr
            self.expect(",")

    def scalar(self) -> Any:
        """true, false, null or a finite number."""
        for word, v in (("true", True), ("false", False), ("null", None)):
            if self.s.startswith(word, self.i):
                self.i += len(word)
                return v
        m = _JSON_NUM.match(self.s, self.i)
        if m and (n := _number(m.group())) is not None:
            self.i = m.end()
            return n
        raise _BadJson(f"bad JSON value at {self.i}")


def parse_json_bounded(text: str) -> tuple[bool, Any]:
    """(True, value) for JSON text within MAX_DEPTH with finite numbers, else (False, None)."""
    reader = _JsonReader(text)
    try:
        v = reader.value(0)
        reader.skip("")
    except _BadJson:
        return False, None
    return (True, v) if reader.i == len(text) else (False, None)


@dataclass(frozen=True)
class ToolChoicePlan:
    """How the server treats tool calls for one request (see the module docstring)."""

    parse: bool
    required: bool = False
    only: str | None = None
    max_calls: int | None = None


def plan_tool_choice(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None = "auto",
    parallel_tool_calls: bool = True,
) -> ToolChoicePlan:
    """Validate `tool_choice` against `tools`; raises ValueError (a 400) when they disagree."""
    names = set(tool_schemas(tools))
    max_calls = None if parallel_tool_calls else 1
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice == "none" or (tool_choice == "auto" and not names):
        return ToolChoicePlan(parse=False)
    if tool_choice == "auto":
        return ToolChoicePlan(parse=True, max_calls=max_calls)
    if not names:
        raise ValueError(f"tool_choice {tool_choice!r} needs a non-empty `tools` list")
    if tool_choice == "required":
        return ToolChoicePlan(parse=True, required=True, max_calls=max_calls)
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}')
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not in `tools`")
    return ToolChoicePlan(parse=True, required=True, only=name, max_calls=max_calls)


def missing_required_call(plan: ToolChoicePlan, calls: Sequence[Any]) -> bool:
    """True when `tool_choice` required a call and the reply has none (served as content)."""
    return plan.required and not calls


def finish_reason(calls: Sequence[Any], engine_reason: str) -> str:
    """Say "tool_calls" when a finished reply made calls; "length" and the rest pass through."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


def _drop_nulls(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"tool call arguments nested deeper than {MAX_DEPTH}")
    if isinstance(value, Mapping):
        return {k: _drop_nulls(v, depth + 1) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v, depth + 1) for v in value]
    return value


def template_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI `tool_calls[i]` (arguments: JSON text) -> the template's form (a mapping).

    Null values are omitted because the template renders what is present, and an absent
    optional argument is what the model wrote. Raises ValueError for unusable arguments.
    """
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call in the history has no function name")
    args = fn.get("arguments")
    if isinstance(args, str) and args.strip():
        ok, args = parse_json_bounded(args)
        if not ok:
            raise ValueError(f"tool call {name!r} has arguments that are not bounded, finite JSON")
    elif args is None or isinstance(args, str):
        args = {}
    if not isinstance(args, Mapping):
        raise ValueError(f"tool call {name!r} arguments must be a JSON object")
    out = {"type": "function", "function": {"name": name, "arguments": _drop_nulls(args)}}
    return {"id": call.get("id") or new_call_id(), **out}


def template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the dicts the chat template renders.

    Assistant turns get their `tool_calls` expanded (`template_tool_call`) and their reasoning,
    sent back under `reasoning_content` or `reasoning`, passed on as `reasoning_content`.
    Other messages are copied unchanged.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        if msg.get("role") == "assistant":
            reasoning = msg.pop("reasoning_content", None) or msg.pop("reasoning", None)
            msg.pop("reasoning", None)
            if reasoning:
                msg["reasoning_content"] = reasoning
            if msg.get("tool_calls"):
                msg["tool_calls"] = [template_tool_call(c) for c in msg["tool_calls"]]
        out.append(msg)
    return out
