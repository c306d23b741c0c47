"""Forced output always arrives, and every reasoning budget holds, over HTTP on a fresh server.

One `m3lm serve` (the embedded story model unless `--model`) takes, with the official clients:

- `--calls` forced tool calls (`tool_choice` "required" or a named tool; tools with enums, numbers,
  nested objects, arrays and bounded strings) and `--schemas` JSON-schema replies, spread over chat
  completions, Responses and Anthropic Messages, at temperature 1 with thinking left at the
  template's default (adaptive) and `max_tokens` 400. Each reply is checked: one call (or one
  object) that validates against its schema. Reported per API: valid / sent, finish reasons, and
  how many replies reasoned first and for how many tokens. The story model never writes M3's
  namespace marker by itself, which ends a string in a call's XML, and repeats an array's items
  without end, so the tools' strings and arrays are bounded (a real checkpoint ends them; this
  one writes to `max_tokens`).
- every effort field and budget (chat `reasoning_effort` and `thinking_token_budget`, Responses
  `reasoning.effort`, Anthropic `output_config.effort` and `thinking.budget_tokens`) on prompts
  that reason past the budgets: the reasoning tokens of each reply against its documented bound,
  and Anthropic's over-budget case (a budget not under `max_tokens`: a 400 in Anthropic's words).

    python3 benchmarks/forced_output.py --out benchmarks/results/forced_output.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_bench
from serve_bench import REPO, Server, commit

from m3lm.bench.report import machine, write_section
from m3lm.server.effort import EFFORTS

KEY = "sk-forced"
STORY = REPO / "m3lm" / "assets" / "story"
MAX_TOKENS = 400
APIS = ("chat", "responses", "messages")

TOOLS = [
    {
        "name": "book_room",
        "description": "Book a hotel room.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
                "nights": {"type": "integer", "minimum": 1, "maximum": 14},
                "guest": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 24}, "vip": {"type": "boolean"}},
                    "required": ["name"],
                },
                "requests": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["quiet", "late checkout"]},
                    "maxItems": 2,
                },
            },
            "required": ["city", "nights", "guest"],
        },
    },
    {
        "name": "file_issue",
        "description": "File an issue in the tracker.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 3, "maxLength": 40},
                "priority": {"type": "integer", "minimum": 1, "maximum": 3},
                "key": {"type": "string", "pattern": "^[A-Z]{2,4}-[0-9]{1,4}$"},
                "assignee": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]},
            },
            "required": ["title", "priority", "key"],
        },
    },
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
]

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["title", "rating", "ok"],
        "additionalProperties": False,
    },
]

PROMPTS = [
    "Book me a room in Rome for three nights.",
    "Once upon a time there was a little dog.",
    "What should I do today?",
    "Tell me about the weather and a cat.",
]


class Clients:
    def __init__(self, url: str):
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        self.anthropic = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=600)
        self.url = url

    def reasoning_tokens(self, text: str) -> int:
        r = httpx.post(
            self.url + "/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {KEY}"}
        )
        return r.json()["count"] if text else 0


def forced(c: Clients, api: str, kind: str, i: int) -> dict:
    """One forced request: `kind` "call" (a tool call) or "schema" (a JSON object). Returns
    {ok, finish, reasoning (tokens; None where the API does not count them), why}."""
    prompt = PROMPTS[i % len(PROMPTS)]
    tool = TOOLS[i // len(APIS) % len(TOOLS)]  # every tool and schema on every API
    schema = SCHEMAS[i // len(APIS) % len(SCHEMAS)]
    named = i % 2 == 1
    msgs = [{"role": "user", "content": prompt}]
    if api == "chat":
        kw = {"model": "story", "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 1, "seed": i}
        if kind == "call":
            choice = {"type": "function", "function": {"name": tool["name"]}} if named else "required"
            kw |= {"tools": [{"type": "function", "function": t} for t in TOOLS], "tool_choice": choice}
            kw["parallel_tool_calls"] = False
        else:
            kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        r = c.openai.chat.completions.create(**kw)
        ch = r.choices[0]
        reasoning = r.usage.completion_tokens_details.reasoning_tokens
        if kind == "call":
            calls = ch.message.tool_calls or []
            got = [(x.function.name, x.function.arguments) for x in calls]
        else:
            got = [("", ch.message.content or "")]
        return check(kind, got, tool if named else None, schema, ch.finish_reason, reasoning)
    if api == "responses":
        kw = {"model": "story", "input": prompt, "max_output_tokens": MAX_TOKENS, "temperature": 1}
        if kind == "call":
            tools = [{"type": "function", **t} for t in TOOLS]
            choice = {"type": "function", "name": tool["name"]} if named else "required"
            kw |= {"tools": tools, "tool_choice": choice, "parallel_tool_calls": False}
        else:
            kw["text"] = {"format": {"type": "json_schema", "name": "out", "schema": schema}}
        r = c.openai.responses.create(**kw)
        reasoning = r.usage.output_tokens_details.reasoning_tokens
        if kind == "call":
            got = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
        else:
            got = [("", r.output_text)]
        return check(kind, got, tool if named else None, schema, r.status, reasoning)
    kw = {"model": "story", "messages": msgs, "max_tokens": MAX_TOKENS, "extra_body": {"temperature": 1}}
    if kind == "call":
        tools = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            for t in TOOLS
        ]
        choice = {"type": "tool", "name": tool["name"]} if named else {"type": "any"}
        choice["disable_parallel_tool_use"] = True
        kw |= {"tools": tools, "tool_choice": choice}
    else:
        kw["extra_body"]["output_config"] = {"format": {"type": "json_schema", "schema": schema}}
    m = c.anthropic.messages.create(**kw)
    thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
    if kind == "call":
        got = [(b.name, json.dumps(b.input)) for b in m.content if b.type == "tool_use"]
    else:
        got = [("", "".join(b.text for b in m.content if b.type == "text"))]
    return check(kind, got, tool if named else None, schema, m.stop_reason, c.reasoning_tokens(thinking))


def check(kind: str, got: list, tool: dict | None, schema: dict, finish, reasoning) -> dict:
    out = {"ok": False, "finish": finish, "reasoning": reasoning, "why": ""}
    if len(got) != 1:
        out["why"] = f"{len(got)} {'calls' if kind == 'call' else 'objects'}"
        return out
    name, text = got[0]
    if kind == "call":
        by_name = {t["name"]: t for t in TOOLS}
        if name not in by_name or (tool is not None and name != tool["name"]):
            out["why"] = f"called {name!r}"
            return out
        schema = by_name[name]["parameters"]
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        out["why"] = f"{type(e).__name__}: {str(e)[:80]}"
        return out
    out["ok"] = True
    return out


def forced_table(c: Clients, calls: int, schemas: int, workers: int) -> tuple[str, int, int]:
    jobs = [(APIS[i % 3], "call", i) for i in range(calls)] + [
        (APIS[i % 3], "schema", i) for i in range(schemas)
    ]
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda j: (j, forced(c, *j)), jobs))
    rows = [
        "| API | kind | valid / sent | finish | reasoned first | reasoning tokens (median, max) |",
        "|---|---|---|---|---|---|",
    ]
    groups = defaultdict(list)
    for (api, kind, _), r in results:
        groups[(api, kind)].append(r)
    for (api, kind), rs in sorted(groups.items()):
        ok = sum(r["ok"] for r in rs)
        finishes = ", ".join(f"{k} {v}" for k, v in Counter(r["finish"] for r in rs).most_common())
        thought = [r["reasoning"] for r in rs if r["reasoning"]]
        spread = f"{statistics.median(thought):.0f}, {max(thought)}" if thought else "-"
        rows.append(f"| {api} | {kind} | {ok} / {len(rs)} | {finishes} | {len(thought)} | {spread} |")
    bad = [
        f"- {api} {kind} #{i}: {r['why']} (finish {r['finish']})"
        for (api, kind, i), r in results
        if not r["ok"]
    ]
    valid = sum(r["ok"] for _, r in results)
    return "\n".join(rows + (["", *bad] if bad else [])), valid, len(results)


def budget_rows(c: Clients, max_tokens: int) -> str:
    """Each effort field and budget on prompts whose reasoning runs past it (the story model
    reasons on with `ignore_eos` in chat; on the other APIs as far as it goes): reasoning
    tokens (median and max over the prompts) against the documented bound."""
    msgs = lambda p: [{"role": "user", "content": p}]  # noqa: E731
    cases = []
    for effort in ("none", "low", "medium"):
        bound = 0 if EFFORTS[effort][0] == "disabled" else EFFORTS[effort][1] + 1  # the closer counts
        cases.append((f"chat `reasoning_effort` {effort}", bound, "chat", {"reasoning_effort": effort}))
    cases.append(("chat `thinking_token_budget` 100 (enabled)", 101, "chat", {"thinking_token_budget": 100}))
    for effort in ("none", "low", "medium"):
        bound = 0 if EFFORTS[effort][0] == "disabled" else EFFORTS[effort][1] + 1
        cases.append((f"Responses `reasoning.effort` {effort}", bound, "responses", {"effort": effort}))
    for effort in ("low", "medium"):
        cases.append(
            (
                f"Anthropic `output_config.effort` {effort}",
                EFFORTS[effort][1] + 1,
                "messages",
                {"effort": effort},
            )
        )
    cases.append(("Anthropic `thinking.budget_tokens` 100", 101, "messages", {"budget": 100}))

    def one(case, prompt, seed):
        _, _, api, opt = case
        if api == "chat":
            extra = {"ignore_eos": True}
            if "thinking_token_budget" in opt:
                extra |= {
                    "thinking_token_budget": opt["thinking_token_budget"],
                    "chat_template_kwargs": {"thinking_mode": "enabled"},
                }
            r = c.openai.chat.completions.create(
                model="story", messages=msgs(prompt), max_tokens=max_tokens, temperature=1, seed=seed,
                reasoning_effort=opt.get("reasoning_effort"), extra_body=extra,
            )  # fmt: skip
            return r.usage.completion_tokens_details.reasoning_tokens
        if api == "responses":
            r = c.openai.responses.create(
                model="story",
                input=prompt,
                max_output_tokens=max_tokens,
                temperature=1,
                reasoning={"effort": opt["effort"]},
            )
            return r.usage.output_tokens_details.reasoning_tokens
        kw = {
            "model": "story",
            "messages": msgs(prompt),
            "max_tokens": max_tokens,
            "extra_body": {"temperature": 1},
        }
        if "budget" in opt:
            kw["thinking"] = {"type": "enabled", "budget_tokens": opt["budget"]}
        else:
            kw["extra_body"]["output_config"] = {"effort": opt["effort"]}
        m = c.anthropic.messages.create(**kw)
        return c.reasoning_tokens("".join(b.thinking for b in m.content if b.type == "thinking"))

    jobs = [(case, p, s) for case in cases for s, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda j: one(*j), jobs))
    rows = [
        "| field | bound (reasoning tokens) | reasoning tokens (each prompt) | within |",
        "|---|---|---|---|",
    ]
    for k, case in enumerate(cases):
        vals = got[k * len(PROMPTS) : (k + 1) * len(PROMPTS)]
        rows.append(
            f"| {case[0]} | {case[1]} | {', '.join(map(str, vals))} | {all(v <= case[1] for v in vals)} |"
        )
    try:
        c.anthropic.messages.create(
            model="story",
            messages=msgs(PROMPTS[0]),
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 64},
        )
        over = "accepted (wrong)"
    except anthropic.BadRequestError as e:
        over = f"{e.status_code} {e.body['error']['type']}: {e.body['error']['message']}"
    rows.append("")
    rows.append(f"Anthropic `budget_tokens` 64 with `max_tokens` 64: {over}")
    rows.append(
        "\nAnthropic counts no reasoning tokens: its column is the thinking text's tokens through "
        "`/tokenize`. Chat runs with `ignore_eos` (the story model ends a reasoning with its "
        "end-of-text token, not a closer); Responses and Anthropic reason as far as the model goes."
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(STORY))
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--schemas", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--budget-max-tokens", type=int, default=2400, help="max_tokens of the budget runs")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    server = Server(args.model, KEY, ["--max-model-len", "4096"])
    try:
        server.wait_healthy(time.monotonic() + 900)
        c = Clients(server.url)
        t = time.perf_counter()
        table, valid, sent = forced_table(c, args.calls, args.schemas, args.workers)
        forced_s = time.perf_counter() - t
        budgets = budget_rows(c, args.budget_max_tokens)
    finally:
        server.stop()
    body = (
        f"### Forced output ({valid} / {sent} valid, {forced_s:.0f} s)\n\n{table}\n\n"
        f"### Reasoning budgets (max_tokens {args.budget_max_tokens})\n\n{budgets}"
    )
    print(body)
    if args.out:
        command = "python3 benchmarks/forced_output.py " + " ".join(sys.argv[1:])
        details = [f"Machine: {machine()}", f"Tree: {commit(REPO)}", f"Server: `{' '.join(server.argv)}`"]
        write_section(args.out, "Forced output and reasoning budgets", command, details, body)


if __name__ == "__main__":
    main()
