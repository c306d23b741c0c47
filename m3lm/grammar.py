"""Structured output as grammars: a `StructuredOutput` -> an xgrammar `Grammar`, and M3's tool calls.

The one home of that translation: the server calls `check` before it admits a request (what the
library refuses is a ValueError naming the problem, a 400), the engine calls `grammar` before it
compiles the same thing against the tokenizer. No tensors, no HTTP; xgrammar is imported on use.

Choices:
- JSON is written on one line with ", " and ": " between items (xgrammar's `any_whitespace=False`,
  as `json.dumps` writes it), so a model cannot pad an answer with whitespace without end; a schema
  is enforced strictly (nothing beyond what it names), whether or not the request said `strict`,
  as vLLM does. `json_object` is any JSON object.
- M3's tool calls keep the model's own format: the namespaced XML of `text/tool_calls.py`, built from
  xgrammar's `minimax_m3_xml` argument grammar inside a block laid out as the chat template lays
  it out (`m3_tool_calls`). The block is the end of the reply: nothing follows it.
- Markers: a grammar written with strings would let the model spell the namespace marker
  `]<]minimax[>[` out of ordinary tokens, which the parser (on token ids) reads as plain text.
  `bind_markers` rewrites every literal occurrence of a marker into its single token.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from m3lm.core import StructuredOutput

MAX_SPEC_CHARS = 256 << 10  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024
# Counted repetitions ({n}, {n,}, {n,m}) in regexes, schema patterns and grammars: the library's
# work grows with their counts (about with the square of a pattern's count to build it; a counted
# range's compile grows with the count too), so larger counts are refused up front. Nested ones
# multiply: their product is bounded too.
MAX_REPEAT = 256
MAX_REPEAT_PRODUCT = 4096


def grammar(spec: StructuredOutput):
    """The xgrammar `Grammar` of `spec`, its markers bound to their tokens; ValueError if the
    library cannot build it (the message says why)."""
    import xgrammar as xgr

    if len(spec.value) > MAX_SPEC_CHARS:
        raise ValueError(f"the {spec.kind} is longer than {MAX_SPEC_CHARS} characters")
    check_repetitions(spec)
    if spec.kind == "json":
        check_required(spec.value)
    try:
        g = _library_grammar(spec.kind, spec.value)
        if spec.markers:
            g = xgr.Grammar.from_ebnf(bind_markers(str(g), dict(spec.markers)))
    except (RuntimeError, ValueError, TypeError) as e:  # the library's own errors are of these kinds
        raise ValueError(f"the {_what(spec.kind)} cannot be used: {library_message(e)}") from None
    return g


def _library_grammar(kind: str, value: str):
    """The library's grammar of one kind of structured output, before its markers are bound."""
    import xgrammar as xgr

    build = {
        "json": json_grammar,
        "json_object": lambda _: xgr.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        ),
        "regex": xgr.Grammar.from_regex,
        "choice": lambda v: xgr.Grammar.from_ebnf(_choice_ebnf(v)),
        "grammar": xgr.Grammar.from_ebnf,
        "structural_tag": xgr.Grammar.from_structural_tag,
    }.get(kind)
    if build is None:
        raise ValueError(f"unknown structured output kind {kind!r}")
    return build(value)


@functools.lru_cache(maxsize=256)
def check(spec: StructuredOutput) -> None:
    """Raise ValueError when `spec` cannot become a grammar (cached: the same schema is checked once)."""
    grammar(spec)


def check_repetitions(spec: StructuredOutput) -> None:
    """ValueError naming the first counted repetition past `MAX_REPEAT` (or nested ones whose
    counts multiply past `MAX_REPEAT_PRODUCT`) in the spec's regexes and grammars: a regex, a
    grammar, or the `pattern` (and `regex`, `ebnf`) strings anywhere in a JSON schema or tag."""
    if spec.kind == "regex":
        _repetitions(spec.value, "regex", quoted=False)
    elif spec.kind == "grammar":
        _repetitions(spec.value, "grammar", quoted=True)
    elif spec.kind in ("json", "structural_tag"):
        for node in _schema_nodes(spec.value):
            for key, value in node.items():
                if key in ("pattern", "regex", "ebnf") and isinstance(value, str):
                    _repetitions(value, f"{key} {value[:60]!r}", quoted=key == "ebnf")
                elif key == "patternProperties" and isinstance(value, dict):
                    for pattern in value:
                        _repetitions(pattern, f"patternProperties {pattern[:60]!r}", quoted=False)


def check_required(schema: str) -> None:
    """ValueError for an object schema whose `required` names a property it cannot have (none of
    its `properties`, and no other property allowed): enforced strictly, it could only give `{}`."""
    for node in _schema_nodes(schema):
        required, props = node.get("required"), node.get("properties")
        if not isinstance(required, list) or not isinstance(props, dict):
            continue  # a `required` beside no `properties` may apply to another subschema's
        if node.get("additionalProperties") not in (None, False) or node.get("patternProperties"):
            continue  # other properties may carry it
        missing = [r for r in required if isinstance(r, str) and r not in props]
        if missing:
            raise ValueError(
                f"the JSON schema cannot be used: required names {missing[0]!r}, which is not among "
                "its properties (and no other property is allowed)"
            )


def _schema_nodes(text: str):
    """Every JSON object in a schema's (or tag's) text, at any depth; none when it is not JSON
    (the library then names what is wrong with it)."""
    try:
        stack = [json.loads(text)]
    except ValueError:
        return
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
            yield node


_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _repetitions(text: str, where: str, quoted: bool) -> None:
    """Check the counted repetitions of one regex (or EBNF grammar, whose "string literals" are
    skipped when `quoted`): each count, and the product of nested ones."""
    stack = [1]  # the largest product of counts inside each open group
    last = 1  # that of the atom just closed, which a count repeats
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i, last = i + 2, 1
            continue
        if c == "[":  # a character class: one atom
            j = i + 1 + (text[i + 1 : i + 2] == "^")
            j += text[j : j + 1] == "]"
            i, last = _closing(text, j, "]") + 1, 1
            continue
        if quoted and c == '"':
            i, last = _closing(text, i + 1, '"') + 1, 1
            continue
        if c == "(":
            stack.append(1)
            i += 1
            continue
        if c == ")":
            last = stack.pop() if len(stack) > 1 else 1
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        m = _COUNT.match(text, i) if c == "{" else None
        if m:
            last = _repeat(m, last, where)
            stack[-1] = max(stack[-1], last)
            i = m.end()
            continue
        last = 1
        stack[-1] = max(stack[-1], 1)
        i += 1


def _repeat(m: re.Match, inner: int, where: str) -> int:
    """The product of counts after the repetition `m` of an atom whose own product is `inner`;
    ValueError when the count or the product is past its bound."""
    count = max(int(m[1]), int(m[2] or 0))
    if count > MAX_REPEAT:
        raise ValueError(
            f"{where}: the repetition {m[0]} counts past {MAX_REPEAT}, this server's bound "
            "(a count that large makes the grammar too costly to build)"
        )
    product = inner * max(count, 1)
    if product > MAX_REPEAT_PRODUCT:
        raise ValueError(
            f"{where}: nested repetitions ending in {m[0]} repeat {product} times, past "
            f"{MAX_REPEAT_PRODUCT}, this server's bound (too costly a grammar to build)"
        )
    return product


def _closing(text: str, j: int, close: str) -> int:
    """The index of the first `close` at or after `j` that no backslash escapes (past the end if
    there is none): where a character class or a quoted string ends."""
    n = len(text)
    while j < n and text[j] != close:
        j += 2 if text[j] == "\\" else 1
    return j


def _what(kind: str) -> str:
    return {"json": "JSON schema", "structural_tag": "tool-call format"}.get(kind, kind)


def json_grammar(schema: str):
    """A JSON schema (as text) -> its grammar, in this module's JSON style."""
    import xgrammar as xgr

    return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)


def _choice_ebnf(value: str) -> str:
    choices = json.loads(value)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} choices")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def library_message(e: BaseException) -> str:
    """xgrammar's error text without its C++ prefix (time, source file, failed check)."""
    text = str(e).strip()
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    if text.startswith("Check failed:") and " is false: " in text:
        text = text.split(" is false: ", 1)[1]
    return " ".join(text.split()) or type(e).__name__


# -- markers ------------------------------------------------------------------------------------

_LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPE_UNIT = re.compile(r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|[^\\]", re.S)
_STRING_LEVEL = ("TagDispatch(", "TokenTagDispatch(")  # their arguments stay text (triggers, excludes)


def bind_markers(ebnf: str, markers: Mapping[str, int]) -> str:
    """Rewrite xgrammar EBNF so that each marker text inside a string literal is its token:
    `"a]<]minimax[>[b"` -> `("a" Token(4089) "b")`. Literals inside a tag dispatch's arguments
    (string-level triggers and excluded texts) stay as they are."""
    _check_markers(markers)
    out: list[str] = []
    i, n, skip_depth = 0, len(ebnf), 0
    while i < n:
        c = ebnf[i]
        if c == '"':
            m = _LITERAL.match(ebnf, i)
            if m is None:
                raise ValueError("unterminated string in the grammar")
            out.append(m.group(0) if skip_depth else _bind_literal(m.group(1), markers))
            i = m.end()
        elif c == "[":
            j = _closing(ebnf, i + 1, "]")
            out.append(ebnf[i : j + 1])
            i = j + 1
        else:
            start = next((s for s in _STRING_LEVEL if ebnf.startswith(s, i)), None)
            if start is not None and not skip_depth:
                out.append(start)
                i += len(start)
                skip_depth = 1
                continue
            if skip_depth and c == "(":
                skip_depth += 1
            elif skip_depth and c == ")":
                skip_depth -= 1
            out.append(c)
            i += 1
    return "".join(out)


def _check_markers(markers: Mapping[str, int]) -> None:
    """ValueError for a marker no EBNF literal can hold as it is (empty, a quote or backslash in
    it, or not printable ASCII)."""
    for marker in markers:
        if not marker or any(c in marker for c in '"\\') or not (marker.isascii() and marker.isprintable()):
            raise ValueError(f"marker {marker!r} cannot be bound in a grammar")


def _bind_literal(body: str, markers: Mapping[str, int]) -> str:
    """One literal's escaped body -> EBNF: marker texts become Token(id), the rest stays quoted."""
    units = _ESCAPE_UNIT.findall(body)
    parts: list[str] = []
    text, k = [], 0
    while k < len(units):
        hit = next((mk for mk in markers if "".join(units[k : k + len(mk)]) == mk), None)
        if hit is None:
            text.append(units[k])
            k += 1
            continue
        if text:
            parts.append('"' + "".join(text) + '"')
            text = []
        parts.append(f"Token({markers[hit]})")
        k += len(hit)
    if not parts:
        return '"' + body + '"'
    if text:
        parts.append('"' + "".join(text) + '"')
    return "(" + " ".join(parts) + ")"


# -- M3 tool calls ------------------------------------------------------------------------------

NAMESPACE = "]<]minimax[>["
_BAD_NAME = re.compile(r"""[\s"'<>/=\ue000-\ue002]""")


@dataclass(frozen=True)
class M3Tokens:
    """Token ids of M3's tool-call markers: the namespace marker and the block's opener and closer."""

    ns: int
    open: int
    close: int


def m3_tool_calls(
    tools: Sequence[Mapping[str, Any]],
    choice: str,
    parallel: bool,
    ids: M3Tokens,
    answer: str | None = None,
) -> StructuredOutput:
    """The grammar of an M3 reply under a tool choice, as a structural tag.

    choice: "required" (a block of calls, one if not `parallel`, and nothing else), "auto" (text
    then optionally a block; with `answer`, a grammar in EBNF, that answer or a block), or a
    tool's name (one call to it). Every call's arguments follow its tool's parameters schema. Raises ValueError
    for a tool whose name or schema the format cannot carry.
    """
    from xgrammar.structural_tag import (
        ConstStringFormat,
        GrammarFormat,
        OrFormat,
        PlusFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
        TokenFormat,
        TokenTriggeredTagsFormat,
    )

    fns = [t.get("function", t) for t in tools]
    if choice not in ("auto", "required"):
        fns = [f for f in fns if f.get("name") == choice]
    if not fns:
        raise ValueError("no tool to call")
    ns = TokenFormat(token=ids.ns)

    def invoke(fn: Mapping[str, Any]):
        name = fn.get("name", "")
        if _BAD_NAME.search(name):
            raise ValueError(
                f"tool name {name!r}: M3's tool calls cannot carry it (no spaces, quotes, <, >, / or =)"
            )
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        _check_element_names(name, schema)
        return SequenceFormat(
            elements=[
                ns,
                ConstStringFormat(value=f'<invoke name="{name}">'),
                _arguments(schema, ns),
                ns,
                ConstStringFormat(value="</invoke>\n"),
            ]
        )

    invokes = [invoke(f) for f in fns]
    calls = invokes[0] if len(invokes) == 1 else OrFormat(elements=invokes)
    if parallel and choice in ("auto", "required"):
        calls = PlusFormat(content=calls)
    body = [TokenFormat(token=ids.open), ConstStringFormat(value="\n"), calls, ns]
    if choice != "auto":
        fmt = SequenceFormat(elements=[ns, *body, TokenFormat(token=ids.close)])
    elif answer is None:
        block = TagFormat(begin=ns, content=SequenceFormat(elements=body), end=TokenFormat(token=ids.close))
        fmt = TokenTriggeredTagsFormat(
            trigger_tokens=[ids.ns], tags=[block], exclude_tokens=[ids.open, ids.close], stop_after_first=True
        )
    else:
        fmt = OrFormat(
            elements=[
                GrammarFormat(grammar=answer),
                SequenceFormat(elements=[ns, *body, TokenFormat(token=ids.close)]),
            ]
        )
    tag = StructuralTag(format=fmt).model_dump_json()
    markers = ((NAMESPACE, ids.ns), ("<tool_call>", ids.open), ("</tool_call>", ids.close))
    return StructuredOutput("structural_tag", tag, markers)


STRING_LIMITS = ("minLength", "maxLength", "pattern", "format")


def _arguments(schema: Mapping[str, Any], ns: Any) -> Any:
    """A call's arguments in M3's XML: xgrammar's `minimax_m3_xml` grammar of the parameters, or,
    where they hold a bounded string at any depth (the library's XML grammar cannot bound a
    string and exclude the namespace marker at once), the same layout built here: an object's
    properties in schema order, optional ones optional, an array's `item` elements, one
    whitespace around each; bounded strings as `_bounded_string`, every part without one through
    the library's grammar."""
    from xgrammar.structural_tag import (
        ConstStringFormat,
        JSONSchemaFormat,
        OptionalFormat,
        OrFormat,
        RegexFormat,
        RepeatFormat,
        SequenceFormat,
    )

    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), Mapping)}
    library_defs = xml_schema(defs)
    ws = OptionalFormat(content=RegexFormat(pattern=r"[ \n\r\t]"))

    def library(sub: Any) -> Any:
        sub = xml_schema(sub)
        return JSONSchemaFormat(
            json_schema={**sub, **library_defs} if isinstance(sub, Mapping) else sub,
            style="minimax_m3_xml",
            max_whitespace_cnt=1,
        )

    def element(name: str, sub: Any, depth: int) -> Any:
        inner = value(sub, depth + 1)
        return SequenceFormat(
            elements=[
                ws,
                ns,
                ConstStringFormat(value=f"<{name}>"),
                inner,
                ns,
                ConstStringFormat(value=f"</{name}>"),
            ]
        )

    def value(sub: Any, depth: int) -> Any:
        sub = _resolve(sub, defs)
        if _bounded(sub):
            return _bounded_string(sub)
        if depth > _MAX_LAYOUT_DEPTH or not _holds_bounded(sub, defs):
            return library(sub)
        if isinstance(branches := sub.get("anyOf") or sub.get("oneOf"), list):
            return OrFormat(elements=[value(b, depth + 1) for b in branches])  # e.g. a bounded string or null
        if isinstance(props := sub.get("properties"), Mapping):
            required = set(sub.get("required") or ())
            parts = [element(n, p, depth) for n, p in props.items()]
            parts = [
                e if n in required else OptionalFormat(content=e) for n, e in zip(props, parts, strict=True)
            ]
            return SequenceFormat(elements=[*parts, ws])
        if isinstance(items := sub.get("items"), Mapping):
            low, high = int(sub.get("minItems") or 0), sub.get("maxItems")
            count = RepeatFormat(
                min=max(low, 1), max=-1 if high is None else int(high), content=element("item", items, depth)
            )
            some = SequenceFormat(elements=[count, ws])
            return some if low else OrFormat(elements=[ConstStringFormat(value=""), some])  # [] is no text
        return library(sub)

    return value(schema, 0)


_MAX_LAYOUT_DEPTH = 16  # nesting laid out here; deeper parts go through the library's grammar


def _resolve(schema: Any, defs: Mapping[str, Any]) -> Any:
    """A local `$ref` (`#/$defs/NAME`, `#/definitions/NAME`) -> its schema; anything else as is."""
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if isinstance(ref, str):
        _, _, path = ref.partition("#/")
        kind, _, name = path.partition("/")
        if isinstance(found := defs.get(kind, {}).get(name), Mapping):
            return found
    return schema


def _holds_bounded(schema: Any, defs: Mapping[str, Any], depth: int = 0) -> bool:
    """Whether a bounded string is in `schema`, through properties, items, branches and refs."""
    schema = _resolve(schema, defs)
    if depth > _MAX_LAYOUT_DEPTH or not isinstance(schema, Mapping):
        return False
    if _bounded(schema):
        return True
    props = schema.get("properties")
    subs = list(props.values()) if isinstance(props, Mapping) else []
    subs += [schema.get("items"), *(schema.get("anyOf") or []), *(schema.get("oneOf") or [])]
    return any(_holds_bounded(sub, defs, depth + 1) for sub in subs)


def _bounded(schema: Any) -> bool:
    """A string schema with a length or a pattern (a `format` alone is an annotation)."""
    return (
        isinstance(schema, Mapping)
        and schema.get("type", "string") == "string"
        and "enum" not in schema
        and "const" not in schema
        and (bool(schema.get("minLength")) or "maxLength" in schema or "pattern" in schema)
    )


def _bounded_string(schema: Mapping[str, Any]) -> Any:
    """A bounded string parameter's text: its `pattern` as written, else any text without the
    namespace marker within `minLength`..`maxLength` characters (the first `minLength` of them,
    at most `MAX_REPEAT`, also not `<`, so that no marker starts there)."""
    from xgrammar.structural_tag import AnyTextFormat, ConstStringFormat, RegexFormat, SequenceFormat

    if isinstance(pattern := schema.get("pattern"), str):
        return RegexFormat(pattern=pattern)
    low, high = min(int(schema.get("minLength") or 0), MAX_REPEAT), schema.get("maxLength")
    rest = None if high is None else min(max(int(high) - low, 0), 2**31 - 1)
    parts = [RegexFormat(pattern=f"[^<]{{{low}}}")] if low else []
    if rest != 0:
        parts.append(AnyTextFormat(excludes=[NAMESPACE], max_chars=rest))
    if len(parts) == 1:
        return parts[0]
    return SequenceFormat(elements=parts) if parts else ConstStringFormat(value="")


def xml_schema(schema: Any, depth: int = 0) -> Any:
    """A tool's parameter schema as the library's XML argument grammar can enforce it: without
    the string limits (`STRING_LIMITS`) it cannot carry, which real tool schemas (MCP servers,
    coding tools) hold. `_arguments` uses it only for parts that hold no bounded string; a
    `format` is left to the client, as it is an annotation."""
    if depth > 64 or not isinstance(schema, Mapping):
        return schema
    out = {k: v for k, v in schema.items() if k not in STRING_LIMITS}
    if isinstance(props := schema.get("properties"), Mapping):
        out["properties"] = {name: xml_schema(sub, depth + 1) for name, sub in props.items()}
    for key in ("items", "additionalProperties"):
        if key in schema:
            out[key] = xml_schema(schema[key], depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(subs := schema.get(key), list):
            out[key] = [xml_schema(sub, depth + 1) for sub in subs]
    for key in ("$defs", "definitions"):
        if isinstance(defs := schema.get(key), Mapping):
            out[key] = {name: xml_schema(sub, depth + 1) for name, sub in defs.items()}
    return out


def _check_element_names(tool: str, schema: Any, depth: int = 0) -> None:
    """Property names become XML element names, which the parser reads only when they are plain."""
    if depth > 64 or not isinstance(schema, Mapping):
        return
    props = schema.get("properties")
    for name, sub in props.items() if isinstance(props, Mapping) else ():
        if not name or len(name) > 128 or _BAD_NAME.search(name) or NAMESPACE in name:
            raise ValueError(
                f"tool {tool!r}: property {name!r} cannot be an element name of M3's tool calls "
                "(1-128 characters, no spaces, quotes, <, >, / or =)"
            )
        _check_element_names(tool, sub, depth + 1)
    for key in ("items", "additionalProperties"):
        _check_element_names(tool, schema.get(key), depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else ():
            _check_element_names(tool, sub, depth + 1)
    defs = schema.get("$defs") or schema.get("definitions")
    for sub in defs.values() if isinstance(defs, Mapping) else ():
        _check_element_names(tool, sub, depth + 1)
