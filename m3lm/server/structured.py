"""A request's output rules: `response_format`, vLLM's `structured_outputs`, `tool_choice`, strict
tools and `thinking_token_budget` -> the `StructuredOutput` and `ThinkingControl` the engine enforces.

- `response_format`: `text`, `json_object`, `json_schema` (its `schema`; `strict` is accepted and
  the schema is always enforced, as vLLM does).
- `structured_outputs` (vLLM's extension): exactly one of `json` (a schema, as an object or text),
  `regex`, `choice` (a list of strings), `grammar` (xgrammar's EBNF), `json_object: true`.
- Tool calls are enforced in M3's own format (`grammar.m3_tool_calls`) when `tool_choice` is
  "required" or names a function, or when any tool is `strict` (then every tool's calls follow
  their schemas, and the reply may still be text); with a JSON answer format as well under "auto",
  the reply is that JSON or a block of calls.
- In chat the rules apply to the answer: the engine starts the grammar after `</mm:think>`
  (`ThinkingControl`, with the mode the template put the prompt in).

Everything is checked before the request is admitted (`check`): what the grammar library cannot
use is a ValueError naming the problem (a 400).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from m3lm.core import StructuredOutput, ThinkingControl
from m3lm.grammar import M3Tokens, grammar, m3_tool_calls
from m3lm.text.reasoning import ReplyFormat, ThinkingMode
from m3lm.text.schema_values import ToolChoicePlan

_VLLM_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def answer_format(
    response_format: Mapping[str, Any] | None, structured_outputs: Any
) -> StructuredOutput | None:
    """The answer's format from `response_format` or `structured_outputs` (not both)."""
    from_response = _response_format(response_format)
    from_vllm = _structured_outputs(structured_outputs)
    if from_response is not None and from_vllm is not None:
        raise ValueError("send either response_format or structured_outputs, not both")
    return from_response or from_vllm


def _response_format(rf: Mapping[str, Any] | None) -> StructuredOutput | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise ValueError('response_format.type must be "text", "json_object" or "json_schema"')
    spec = rf.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError("response_format.json_schema must be an object with a `schema`")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, (Mapping, bool)):
        raise ValueError("response_format.json_schema.schema must be a JSON schema (an object)")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise ValueError("response_format.json_schema.strict must be a boolean")
    return StructuredOutput("json", _schema_text(schema))


def _structured_outputs(so: Any) -> StructuredOutput | None:
    if so is None:
        return None
    key, value = _one_kind(so)
    if key == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be true")
        return StructuredOutput("json_object")
    if key == "json":
        return StructuredOutput("json", _schema_text(_json_schema(value)))
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{key} must be a non-empty string")
    return StructuredOutput(_VLLM_KINDS[key], value)


def _one_kind(so: Any) -> tuple[str, Any]:
    """vLLM's `structured_outputs`: the one kind it sets (unset: None or false) and its value."""
    if not isinstance(so, Mapping):
        raise ValueError("structured_outputs must be an object")
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = sorted(set(given) - {*_VLLM_KINDS, "json_object"})
    if unknown:
        raise ValueError(f"structured_outputs: {', '.join(map(repr, unknown))} not supported")
    if len(given) != 1:
        raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object")
    ((key, value),) = given.items()
    return key, value


def _json_schema(value: Any) -> Any:
    """`structured_outputs.json`: a schema, or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
    if not isinstance(value, (Mapping, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema")
    return value


def _schema_text(schema: Any) -> str:
    return json.dumps(schema, ensure_ascii=False)  # keys in the client's order: the answer's order


def output_rules(
    answer: StructuredOutput | None,
    tools: Sequence[Mapping[str, Any]],
    tool_choice: Any,
    plan: ToolChoicePlan,
    parallel: bool,
    fmt: ReplyFormat | None,
) -> StructuredOutput | None:
    """What the reply must match: the answer format, the tool-call grammar, or both; None: free."""
    forced = plan.parse and (plan.required or plan.only is not None)
    strict = plan.parse and any((t.get("function", t) or {}).get("strict") is True for t in tools)
    if not (forced or (plan.parse and (strict or answer is not None))):
        return answer
    if forced and answer is not None:
        raise ValueError("response_format cannot be combined with a required or named tool_choice")
    if (
        fmt is None
        or fmt.tools.family != "m3"
        or None in (fmt.tools.ns_id, fmt.tools.open_id, fmt.tools.close_id)
    ):
        raise ValueError("enforcing tool calls needs M3's tool-call tokens, which this tokenizer lacks")
    ids = M3Tokens(fmt.tools.ns_id, fmt.tools.open_id, fmt.tools.close_id)
    choice = plan.only or ("required" if plan.required else "auto")
    answer_ebnf = str(grammar(answer)) if answer is not None else None
    return m3_tool_calls(tools, choice, parallel, ids, answer_ebnf)


def chat_rules(
    req: Any,
    tools: Sequence[Mapping[str, Any]],
    plan: ToolChoicePlan,
    fmt: ReplyFormat | None,
    mode: ThinkingMode | None,
) -> tuple[StructuredOutput | None, ThinkingControl | None]:
    """A chat request's output rules (ValueError names what cannot be enforced), to be checked
    (`GrammarChecks`)."""
    answer = answer_format(req.response_format, req.structured_outputs)
    rules = output_rules(answer, tools, req.tool_choice, plan, req.parallel_tool_calls, fmt)
    budget = req.thinking_token_budget
    limit = req.max_completion_tokens or req.max_tokens
    # forced output must arrive: reasoning ends in time, and a budget (the request's or its
    # effort's) that would take every token leaves the answer none
    if rules is not None and (budget is None or (limit is not None and budget >= limit)):
        budget = (
            FORCED_REASONING_BUDGET if limit is None else min(FORCED_REASONING_BUDGET, max(1, limit // 4))
        )
    return rules, thinking_control(fmt, mode, budget, rules is not None)


def completion_rules(req: Any) -> StructuredOutput | None:
    """A text completion's output rule (from its first token), to be checked (`GrammarChecks`)."""
    return answer_format(req.response_format, req.structured_outputs)


# Under a grammar (a schema, a forced tool call) a reply that reasons and never closes its
# reasoning would end with no answer: without a budget of the request's, reasoning gets this
# many tokens, or a quarter of max_tokens when that is less (the rest is the answer's: a call's
# markup takes many tokens), and then the closer is forced.
FORCED_REASONING_BUDGET = 2048


def thinking_control(
    fmt: ReplyFormat | None, mode: ThinkingMode | None, budget: int | None, constrained: bool
) -> ThinkingControl | None:
    """Where the answer starts (when a grammar applies to it) and the reasoning budget, if any."""
    if fmt is None or mode is None or (not constrained and budget is None):
        return None
    return ThinkingControl(mode.value, fmt.reasoning.start_id, fmt.reasoning.end_id, budget)
