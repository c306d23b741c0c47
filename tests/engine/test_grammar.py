"""Structured output below HTTP: grammars (`m3lm.grammar`), the engine's mask and matchers
(`m3lm.engine.constraints`), on the embedded story model's real tokenizer and weights."""

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

import m3lm
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams, StructuredOutput, ThinkingControl
from m3lm.engine.constraints import Constraint, Masks, mask_logits
from m3lm.engine.engine import LLMEngine
from m3lm.grammar import M3Tokens, bind_markers, check, grammar, library_message, m3_tool_calls, xml_schema
from m3lm.text.reasoning import ReplyFormat, ThinkingMode, parse_reply
from m3lm.text.tool_calls import ToolCallParser, parse_tool_calls

STORY = Path(m3lm.__file__).parent / "assets" / "story"
NS = "]<]minimax[>["


@pytest.fixture(scope="module")
def story():
    model, tok = m3lm.load(STORY, device="cpu")
    return model, tok


@pytest.fixture(scope="module")
def fmt(story):
    return ReplyFormat.from_tokenizer(story[1].hf)


@pytest.fixture(scope="module")
def ids(fmt):
    return M3Tokens(fmt.tools.ns_id, fmt.tools.open_id, fmt.tools.close_id)


def engine_of(story, **cfg) -> LLMEngine:
    model, tok = story
    return LLMEngine(model, tok, EngineConfig(**{"max_model_len": 1024, "max_num_seqs": 16, **cfg}))


def run(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> list:
    seqs = [engine.add_request(prompt, p) for p in params]
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
    return seqs


# -- grammars -------------------------------------------------------------------------------------


def test_bind_markers_turns_marker_text_into_its_token_and_leaves_the_rest():
    ebnf = (
        'a ::= (("x]<]minimax[>[<n>" [\\]"<] "]<]minimax[>[" b))\n'
        'b ::= TagDispatch(\n  loop_after_dispatch=false,\n  excludes=("]<]minimax[>[")\n)\n'
        'c ::= (("\\"]<]minimax[>[\\n"))\n'
    )
    out = bind_markers(ebnf, {NS: 7})
    assert 'a ::= ((("x" Token(7) "<n>") [\\]"<] (Token(7)) b))' in out
    assert 'excludes=("]<]minimax[>[")' in out  # string-level exclusions stay text
    assert 'c ::= ((("\\"" Token(7) "\\n")))' in out
    with pytest.raises(ValueError):
        bind_markers(ebnf, {'a"b': 1})


def test_a_spec_the_library_refuses_is_a_value_error_that_names_the_problem(ids):
    with pytest.raises(ValueError, match="parenthesis is not closed"):
        check(StructuredOutput("regex", "(("))
    with pytest.raises(ValueError, match="JSON schema"):
        check(StructuredOutput("json", '{"type": "object", "properties": {"a": {"type": "nope"}}}'))
    with pytest.raises(ValueError, match="choice"):
        check(StructuredOutput("choice", "[]"))
    # string limits are more than M3's XML argument grammar can carry: the call's structure is
    # enforced without them (real tool schemas hold them), never refused
    limited = {"type": "string", "maxLength": 3, "minLength": 1, "pattern": "^[a-z]+$", "format": "uri"}
    tool = {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"s": limited, "pattern": {"type": "array", "items": limited}},
            "$defs": {"d": limited},
        },
    }
    check(m3_tool_calls([tool], "required", True, ids))
    assert xml_schema(tool["parameters"]) == {
        "type": "object",
        "properties": {"s": {"type": "string"}, "pattern": {"type": "array", "items": {"type": "string"}}},
        "$defs": {"d": {"type": "string"}},
    }
    with pytest.raises(ValueError, match="element name"):
        m3_tool_calls(
            [{"name": "f", "parameters": {"properties": {"a b": {"type": "integer"}}}}], "f", True, ids
        )
    assert library_message(RuntimeError("[01:02:03] /x/y.cc:9: Check failed: (a) is false: why")) == "why"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book_room",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "nights": {"type": "integer", "minimum": 1, "maximum": 30},
                    "guest": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                        "required": ["name"],
                        "additionalProperties": False,
                    },
                    "tags": {
                        "type": "array",
                        "items": {"enum": ["quiet", "high floor", 7, None]},
                        "maxItems": 3,
                    },
                    "rate": {"type": "number", "minimum": 0, "maximum": 500},
                    "note": {"type": ["string", "null"]},
                },
                "required": ["nights", "guest", "tags"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "notify",
            "parameters": {
                "type": "object",
                "properties": {"channel": {"enum": ["sms", "mail"]}},
                "required": ["channel"],
            },
        },
    },
]


def walk(compiled, rng: random.Random, vocab: int, special_from: int, ns: int, limit: int = 600) -> list[int]:
    """A random path through the grammar: each step a token the mask allows (markers favoured,
    the namespace marker first, so values end), until the matcher terminates."""
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out = []
    while not m.is_terminated():
        assert len(out) < limit, "the walk did not end"
        m.fill_next_token_bitmask(bitmask)
        words = bitmask[0].tolist()
        allowed = [i for i in range(vocab) if (words[i // 32] >> (i % 32)) & 1]
        special = [i for i in allowed if i >= special_from]
        markers = [i for i in special if i not in m.stop_token_ids]
        ending = [ns] if ns in markers else markers or special
        pick = rng.choice(ending if special and rng.random() < 0.3 else allowed)
        assert m.accept_token(pick)
        out.append(pick)
    return out


BOUNDED = {
    "type": "function",
    "function": {
        "name": "file_issue",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 2, "maxLength": 6},
                "priority": {"type": "integer", "minimum": 1, "maximum": 3},
                "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
                "owner": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
                "body": {"type": "string", "maxLength": 3, "format": "email"},
                "labels": {"type": "array", "items": {"type": "string"}},
                "reporter": {"$ref": "#/$defs/person"},
                "watchers": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/person"},
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["title", "priority", "code", "reporter"],
            "$defs": {
                "person": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 1, "maxLength": 5},
                        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}},
                    },
                    "required": ["name"],
                }
            },
        },
    },
}


def test_bounded_string_parameters_are_enforced_in_m3s_xml(story, fmt, ids):
    """Lengths and patterns of a tool's parameters (LangChain's max_length, MCP servers' patterns),
    also in nested objects, arrays and `$ref`s, hold on every path through the grammar: the parser reads calls that validate against the
    whole schema, limits included (a `format` is an annotation). Paths through byte tokens that
    do not make whole characters are left out: their text is not what the grammar counted."""
    model, tok = story
    compiled = engine_of(story).grammars.submit(m3_tool_calls([BOUNDED], "required", False, ids)).result()
    schema = BOUNDED["function"]["parameters"]
    rng, checked = random.Random(1), 0
    for _ in range(90):
        reply = walk(compiled, rng, model.args.vocab_size, min(tok.all_special_ids), ids.ns, limit=4000)[:-1]
        pieces = [(t, tok.decode([t], skip_special_tokens=False)) for t in reply]
        calls = parse_tool_calls(pieces, fmt.tools, [BOUNDED]).calls
        assert len(calls) == 1 and calls[0].name == "file_issue"
        args = json.loads(calls[0].arguments)
        if "\ufffd" in json.dumps(args, ensure_ascii=False):
            continue
        jsonschema.validate(args, schema, format_checker=None)
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("choice", ["required", "notify", "auto"])
def test_m3_tool_grammar_makes_calls_our_parser_reads_and_xgrammar_builtin_tag_accepts(
    story, fmt, ids, choice
):
    """On the real tokenizer: every path through the grammar is M3's format with the markers as
    their single tokens; the parser (streamed and whole) finds calls whose arguments validate; and
    the same text is in the language of xgrammar's own `minimax_m3` structural tag."""
    model, tok = story
    engine = engine_of(story)
    spec = m3_tool_calls(TOOLS, choice, True, ids)
    compiled = engine.grammars.submit(spec).result()
    builtin_choice = choice
    if choice == "notify":
        builtin_choice = {"type": "function", "function": {"name": "notify"}}
    builtin = xgr.get_model_structural_tag(
        "minimax_m3", tools=TOOLS, tool_choice=builtin_choice, reasoning="disabled"
    )
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=model.args.vocab_size, stop_token_ids=[4086])
    builtin_compiled = xgr.GrammarCompiler(info).compile_structural_tag(builtin)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(0)
    eos = sorted(tok.eos_token_ids)
    seen_calls = 0
    for _ in range(40):
        path = walk(compiled, rng, model.args.vocab_size, min(tok.all_special_ids), ids.ns)
        assert path[-1] in eos
        reply = path[:-1]
        pieces = [(t, tok.decode([t], skip_special_tokens=False)) for t in reply]
        # the namespace marker only ever comes as its token
        assert all(NS not in text for t, text in pieces if t != ids.ns)
        whole = parse_tool_calls(pieces, fmt.tools, TOOLS)
        parser = ToolCallParser(fmt.tools, TOOLS)
        events = [e for t, text in pieces for e in parser.feed(t, text)] + parser.finish()
        assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in whole.calls]
        assert events or not pieces
        if choice != "auto":
            assert whole.calls and not whole.content
        for call in whole.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            if choice == "notify":
                assert call.name == "notify"
        seen_calls += len(whole.calls)
        if whole.calls:  # xgrammar's own tag (markers as text) accepts the same reply
            m = xgr.GrammarMatcher(builtin_compiled)
            assert m.accept_string(tok.decode(reply, skip_special_tokens=False)), tok.decode(reply)
            assert m.accept_token(eos[0])
    assert seen_calls >= 10


def test_a_request_without_a_grammar_leaves_its_row_alone():
    logits = torch.randn(3, 64)
    before = logits.clone()
    constrained = Constraint(None, ThinkingControl("enabled", 5, 6, budget=0))
    mask_logits([None, constrained, Constraint(None, None)], logits)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).tolist() == [i == 6 for i in range(64)]  # the budget forces the closer


def test_the_reasoning_state_follows_the_thinking_mode_on_token_ids(story):
    engine = engine_of(story)
    so = StructuredOutput("choice", '["yes", "no"]')
    compiled = engine.grammars.submit(so)
    V, start, end, eos = 4096, 4087, 4088, 4086

    def allowed(c):
        logits = torch.zeros(1, V)
        mask_logits([c], logits)
        return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())

    compiled.result()
    enabled = Constraint(compiled, ThinkingControl("enabled", start, end, budget=2))
    assert enabled.start() is None
    free = allowed(enabled)
    assert eos not in free and len(free) > 4000  # reasoning: anything but a stop token
    assert enabled.accept(11) and enabled.accept(12)
    assert allowed(enabled) == {end}  # the budget is spent
    assert enabled.accept(end)
    answer = allowed(enabled)
    assert answer and start not in answer and end not in answer and len(answer) < 50
    adaptive = Constraint(compiled, ThinkingControl("adaptive", start, end))
    adaptive.start()
    assert allowed(adaptive) == answer | {start, end}  # the first token decides
    assert adaptive.accept(start) and eos not in allowed(adaptive)
    direct = Constraint(compiled, ThinkingControl("adaptive", start, end))
    direct.start()
    token = min(answer)
    assert direct.accept(token) and start not in allowed(direct)  # answered at once: the grammar runs
    assert not direct.accept(start)  # and refuses a marker


@pytest.mark.parametrize("threads", [0, 2])
def test_masks_filled_at_once_are_each_row_filled_alone(story, threads):
    """`Masks` (every grammar's row on xgrammar's batch matcher, on one thread as the engine's
    takes these few rows, or on two; a reused buffer) gives the rows that `mask_logits` gives one
    at a time, for rows in every state, twice in a row."""
    engine = engine_of(story)
    V, start, end = 4096, 4087, 4088
    schema = StructuredOutput(
        "json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    choice = engine.grammars.submit(StructuredOutput("choice", '["yes", "no"]'))
    obj = engine.grammars.submit(schema)

    def constraint(grammar, thinking=None):
        c = Constraint(grammar, thinking)
        c.start()
        return c

    rows = [
        constraint(obj),
        None,
        constraint(choice),
        constraint(obj, ThinkingControl("adaptive", start, end)),  # grammar and the markers
        constraint(choice, ThinkingControl("enabled", start, end)),  # reasoning: no stop token
        constraint(obj, ThinkingControl("enabled", start, end, budget=0)),  # only the closer
        Constraint(None, None),
    ]
    obj.result(), choice.result()
    masks = engine.masks if not threads else Masks(V, torch.device("cpu"), threads, slots_per_thread=1)
    for step in range(2):
        logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(step))
        want = logits.clone()
        mask_logits(rows, want)
        got = logits.clone()
        masks.fill(rows).apply(got)
        assert torch.equal(got, want)
        allowed = torch.isfinite(got).sum(-1).tolist()
        assert allowed[1] == allowed[6] == V and allowed[5] == 1 and len(set(allowed)) >= 4
        for i in (0, 2):  # the grammars move on: the next step's rows differ
            assert rows[i].accept(int(torch.isfinite(got[i]).nonzero()[-1]))
    assert masks.fill([None, Constraint(None, None)]) is None


@pytest.mark.cuda
def test_masks_on_the_gpu_are_the_cpus(story):
    """The pinned buffer's copy and the tensor-op masking on a GPU: the CPU reference's rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    engine, V = engine_of(story), 4096
    obj = engine.grammars.submit(StructuredOutput("json", json.dumps({"type": "object"})))
    choice = engine.grammars.submit(StructuredOutput("choice", '["yes", "no"]'))
    rows = [Constraint(obj, None), None, Constraint(choice, None)]
    for c in rows:
        if c is not None:
            c.start()
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(0))
    want = logits.clone()
    mask_logits(rows, want)
    got = logits.cuda()
    Masks(V, torch.device("cuda")).fill(rows).apply(got)
    assert torch.equal(got.cpu(), want)


# -- the engine -----------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_engine_json_schema_with_n_preemption_prefix_cache_and_one_compile(story):
    """A pool so small that requests are preempted and recomputed: every choice still validates
    (the matcher stays with its request), the schema compiles once for all of them, and a request
    that starts on the cached prompt makes the same reply."""
    _, tok = story
    engine = engine_of(story, kv_cache_tokens=16 * 16, max_model_len=160)
    prompt = tok.encode("Once upon a time there was a little dog who liked to run in the park. " * 3)
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=i, structured=spec) for i in range(8)]
    seqs = run(engine, prompt, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.grammars.compiles == 1
    again = run(engine, prompt, params[:1])[0]
    assert again.num_prefix_cached >= 16 and again.output_ids == seqs[0].output_ids
    for seq in seqs:
        assert seq.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(seq.output_ids, skip_special_tokens=True)), SCHEMA)


def test_the_same_seed_gives_the_same_structured_reply_alone_or_in_a_batch(story):
    _, tok = story
    prompt = tok.encode("Once upon a time")
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    p = SamplingParams(max_tokens=100, temperature=1.0, seed=7, structured=spec)
    alone = run(engine_of(story), prompt, [p])[0].output_ids
    others = [replace(p, seed=s) for s in range(5)] + [p]
    assert run(engine_of(story), prompt, others)[-1].output_ids == alone


def test_logprobs_are_those_of_the_masked_logits(story):
    """The reported log-probabilities are the model's, renormalised over what the grammar allows
    (computed here from a plain forward pass and the choices' prefixes)."""
    model, tok = story
    choices = ["yes", "no", "maybe"]
    spec = StructuredOutput("choice", json.dumps(choices))
    prompt = tok.encode("Once upon a time")
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=3, logprobs=5, structured=spec)
    seq = run(engine_of(story), prompt, [p])[0]
    assert tok.decode(seq.output_ids, skip_special_tokens=True) in choices
    allowed = [
        t
        for t in range(len(tok.hf))
        if t not in tok.all_special_ids and (s := tok.decode([t])) and any(c.startswith(s) for c in choices)
    ]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1].float()
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]
    want = torch.log_softmax(masked, -1)
    first = seq.logprobs[0]
    assert first.logprob == pytest.approx(want[first.token_id].item(), abs=1e-4)
    top = want.topk(5)
    for (t, lp), wt, wlp in zip(first.top, top.indices.tolist(), top.values.tolist(), strict=True):
        if math.isfinite(wlp):
            assert t == wt and lp == pytest.approx(wlp, abs=1e-4)
        else:
            assert lp == float("-inf")


def test_a_grammar_that_cannot_compile_ends_its_request_with_an_error_and_others_go_on(story):
    _, tok = story
    engine = engine_of(story)
    prompt = tok.encode("Once")
    bad = engine.add_request(prompt, SamplingParams(max_tokens=5, structured=StructuredOutput("regex", "((")))
    good = engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0))
    errors = []
    while engine.has_unfinished() or engine._compiling:
        errors += [o.error for o in engine.step() if o.finish_reason == "error"]
    assert bad.finish_reason == "error" and "parenthesis" in errors[0]
    assert good.finish_reason == "length"


def test_a_grammar_that_admits_no_token_ends_its_request_and_others_go_on(story):
    _, tok = story
    engine = engine_of(story)
    prompt = tok.encode("Once")
    none = StructuredOutput("regex", "[^\\x00-\\U0010FFFF]")  # a class of no character
    bad = engine.add_request(prompt, SamplingParams(max_tokens=5, structured=none))
    good = engine.add_request(
        prompt, SamplingParams(max_tokens=5, structured=StructuredOutput("regex", "a+"))
    )
    errors = []
    while engine.has_unfinished() or engine._compiling:
        errors += [o.error for o in engine.step() if o.finish_reason == "error"]
    assert bad.finish_reason == "error" and errors == [
        "structured output: the grammar admits no token (nothing can match it)"
    ]
    assert good.finish_reason == "length" and good.output_ids


def test_a_compile_past_its_budget_is_refused_and_a_queued_one_nobody_waits_for_is_cancelled(
    story, monkeypatch
):
    """Compiles run on two threads: with both held, a request past the budget fails (and its
    grammar stays refused: the next request for it fails at once), and a queued compile whose
    requests were all aborted never runs."""
    import threading

    from m3lm.engine import constraints
    from m3lm.engine import engine as engine_mod

    _, tok = story
    engine = engine_of(story)
    gate, compiled = threading.Event(), []
    real = constraints.Grammars._compile

    def held(self, spec):
        compiled.append(spec.value)
        assert gate.wait(30)
        return real(self, spec)

    monkeypatch.setattr(constraints.Grammars, "_compile", held)
    prompt = tok.encode("Once")
    specs = [StructuredOutput("regex", p) for p in ("a+", "b+", "c+")]
    first, second, queued = (
        engine.add_request(prompt, SamplingParams(max_tokens=3, structured=s)) for s in specs
    )
    engine.abort(queued.request_id)  # its compile waits behind the two held ones
    monkeypatch.setattr(engine_mod, "GRAMMAR_COMPILE_BUDGET_S", 0.0)
    out = engine.step()
    assert {o.request_id: o.error for o in out} == {
        r.request_id: "structured output: the grammar took longer than 0 s to compile (this server's budget): simplify it"
        for r in (first, second)
    }
    gate.set()
    again = engine.add_request(prompt, SamplingParams(max_tokens=3, structured=specs[0]))
    monkeypatch.setattr(engine_mod, "GRAMMAR_COMPILE_BUDGET_S", 60.0)
    errors = []
    while engine.has_unfinished() or engine._compiling:
        errors += [o.error for o in engine.step() if o.request_id == again.request_id]
    assert again.finish_reason == "error" and errors[0].startswith(
        "structured output: the grammar took longer"
    )
    engine.grammars._pool.shutdown(wait=True)
    assert sorted(compiled) == ["a+", "b+"]  # c+ was cancelled before it ran


def test_a_tool_call_reply_ends_with_the_block_and_parses(story, fmt, ids):
    """The engine path of a forced call, thinking on with a budget: the reply reasons, closes,
    calls, and stops; the reply parser finds the call."""
    _, tok = story
    engine = engine_of(story)
    spec = m3_tool_calls(TOOLS, "notify", True, ids)
    thinking = ThinkingControl("enabled", fmt.reasoning.start_id, fmt.reasoning.end_id, budget=3)
    p = SamplingParams(max_tokens=200, temperature=1.0, seed=1, structured=spec, thinking=thinking)
    seq = run(engine, tok.encode("Once"), [p])[0]
    assert seq.finish_reason == "stop"
    pieces = [(t, tok.decode([t], skip_special_tokens=False)) for t in seq.output_ids[:-1]]
    reply = parse_reply(pieces, fmt, ThinkingMode.ENABLED, TOOLS)
    assert len(tok.encode(reply.reasoning)) >= 1 and reply.content == ""
    assert [c.name for c in reply.tool_calls] == ["notify"]
    assert json.loads(reply.tool_calls[0].arguments)["channel"] in ("sms", "mail")


def test_grammar_of_each_kind_builds(ids):
    for spec in (
        StructuredOutput("json_object"),
        StructuredOutput("regex", "[a-c]{2}"),
        StructuredOutput("grammar", 'root ::= "x" [0-9]'),
        StructuredOutput("choice", '["a", "b"]'),
        m3_tool_calls(TOOLS, "auto", False, ids, str(grammar(StructuredOutput("json", json.dumps(SCHEMA))))),
    ):
        assert "root" in str(grammar(spec))
