"""Generation through the paged caches: golden greedy decode, chunked prefill, batching, policies."""

import pytest
import torch
from safetensors.torch import load_file

import m3lm
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from tests.support.checkpoints import random_prompt as prompt
from tests.support.paths import golden_params

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def run_engine(model, prompts, params, **config) -> dict[str, list[int]]:
    engine = LLMEngine(model, None, EngineConfig(**config))
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_pages
    return out


def count_computed(engine: LLMEngine) -> dict[str, int]:
    """Positions the engine's runner computes, per request id, as it runs (filled in place)."""
    computed: dict[str, int] = {}
    real_run = engine.runner.run

    def run(plan, tables):
        for seq, n in plan:
            computed[seq.request_id] = computed.get(seq.request_id, 0) + n
        return real_run(plan, tables)

    engine.runner.run = run
    return computed


@pytest.mark.parametrize("fixture", golden_params())
@pytest.mark.parametrize("chunk", [2048, 1, 5, 8])
def test_greedy_matches_golden(fixture, chunk):
    model, _ = m3lm.load(fixture, device="cpu", dtype=torch.float32)
    exp = load_file(fixture / "expected.safetensors")
    want = exp["greedy.output_ids"]
    res = m3lm.generate(
        model,
        None,
        exp["greedy.input_ids"][0].tolist(),
        max_tokens=len(want),
        logprobs=0,
        prefill_chunk_size=chunk,
        **GREEDY,
    )
    assert res.token_ids == want.tolist()
    assert res.finish_reason == "length" and res.generation_tokens == len(want)
    ref = torch.log_softmax(exp["greedy.step_logits"], -1).gather(1, want[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in res.logprobs])
    assert torch.allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("fixture", golden_params())
def test_compiled_greedy_matches_golden(fixture):
    # The CPU's compiled decode step (`--compile`), compiled at the first decode step.
    model, _ = m3lm.load(fixture, device="cpu", dtype=torch.float32)
    exp = load_file(fixture / "expected.safetensors")
    want = exp["greedy.output_ids"]
    res = m3lm.generate(
        model, None, exp["greedy.input_ids"][0].tolist(), max_tokens=len(want), logprobs=0,
        pool={"cpu_compile": True}, **GREEDY,
    )  # fmt: skip
    assert res.token_ids == want.tolist()
    ref = torch.log_softmax(exp["greedy.step_logits"], -1).gather(1, want[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in res.logprobs]), ref, atol=1e-4)


def test_decode_matches_full_forward(tiny):
    """Token-by-token decode through the caches gives the logits of one full causal forward."""
    p = prompt(30)
    res = m3lm.generate(tiny, None, p, max_tokens=12, logprobs=0, **GREEDY)
    with torch.inference_mode():
        full = tiny(torch.tensor([p + res.token_ids[:-1]]))[0, len(p) - 1 :]
    assert res.token_ids == full.argmax(-1).tolist()
    lp = torch.log_softmax(full, -1).gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([x.logprob for x in res.logprobs]), lp, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 13])
def test_chunked_prefill_matches_one_prefill(tiny, chunk):
    p = prompt(41, seed=2)
    one = run_engine(tiny, [p], m3lm.SamplingParams(max_tokens=8, **GREEDY))
    assert (
        run_engine(tiny, [p], m3lm.SamplingParams(max_tokens=8, **GREEDY), max_num_batched_tokens=chunk)
        == one
    )


def test_batch_equals_each_alone(tiny):
    a, b = prompt(37, seed=3), prompt(9, seed=4)
    params = m3lm.SamplingParams(max_tokens=10, **GREEDY)
    both = run_engine(tiny, [a, b], params, max_num_batched_tokens=16)
    assert both["0"] == run_engine(tiny, [a], params)["0"]
    assert both["1"] == run_engine(tiny, [b], params)["0"]


def test_preemption_recomputes_the_same_tokens(tiny):
    """With a cache too small for all requests, preempted sequences still produce the same output."""
    prompts = [prompt(20, seed=i) for i in range(4)]
    params = m3lm.SamplingParams(max_tokens=16, **GREEDY)
    roomy = run_engine(tiny, prompts, params)
    tight_engine = run_engine(tiny, prompts, params, kv_cache_tokens=64, max_model_len=40)
    assert tight_engine == roomy


def test_seeded_sampling_is_reproducible_in_any_batch(tiny):
    params = m3lm.SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    p = prompt(15, seed=5)
    alone = run_engine(tiny, [p], params)["0"]
    assert run_engine(tiny, [p], params)["0"] == alone
    crowd = run_engine(tiny, [prompt(22, seed=6), p], params)
    assert crowd["1"] == alone


def test_msa_dense_window_does_what_it_says(tiny):
    """F = 2 keeps a sparse layer dense for t < 2 * topk * S (24 here) and exact MSA beyond."""
    from m3lm.layers.batch import ForwardBatch

    attn = tiny.model.layers[1].self_attn
    assert attn.sparse
    t = 40
    x = torch.randn(t, tiny.args.hidden_size, generator=torch.Generator().manual_seed(0))

    def run(f):
        with torch.inference_mode():
            return attn(x, ForwardBatch(torch.arange(t), [t], msa_dense_window=f))

    exact, dense, window = run(None), run(1e9), 2 * 3 * 4
    approx = run(2.0)
    assert torch.allclose(approx[:window], dense[:window], atol=1e-6)
    assert torch.allclose(approx[window:], exact[window:], atol=1e-6)
    # Between the exact dense window (12) and 24 it really is an approximation.
    assert not torch.allclose(exact[12:window], dense[12:window], atol=1e-3)
    assert torch.allclose(exact[:12], dense[:12], atol=1e-6)


def test_engine_rejects_bad_prompts(tiny):
    engine = LLMEngine(tiny, None, EngineConfig(max_model_len=32))
    params = m3lm.SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], params)
    with pytest.raises(ValueError, match="32"):
        engine.add_request(prompt(32), params)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 96], params)
    seq = engine.add_request(prompt(30), m3lm.SamplingParams(max_tokens=100, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert len(seq.output_ids) == 2 and seq.finish_reason == "length"  # capped by the context


def test_abort_frees_pages(tiny):
    engine = LLMEngine(tiny, None, EngineConfig(max_num_batched_tokens=8))
    engine.add_request(prompt(30), m3lm.SamplingParams(max_tokens=50), request_id="x")
    engine.step()  # mid-prefill
    assert engine.blocks.num_used > 0
    engine.abort("x")
    assert engine.blocks.num_free == engine.blocks.num_pages and not engine.has_unfinished()


def first_new(tokens: list[int], start: int) -> int:
    """Index of the first token at or after `start` that did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_and_eos(tiny):
    p, free = next(
        (p, f)
        for p in (prompt(12, seed=s) for s in range(8, 40))
        if len(set(f := m3lm.generate(tiny, None, p, max_tokens=8, **GREEDY).token_ids)) >= 3
    )
    j = first_new(free, 1)
    res = m3lm.generate(tiny, None, p, max_tokens=8, temperature=0.0, stop_token_ids=[free[j]])
    assert res.token_ids == free[: j + 1] and res.finish_reason == "stop"
    tiny.generation_config = {"eos_token_id": [free[j]]}
    try:
        assert m3lm.generate(tiny, None, p, max_tokens=8, temperature=0.0).token_ids == free[: j + 1]
        assert m3lm.generate(tiny, None, p, max_tokens=8, **GREEDY).token_ids == free  # ignore_eos
    finally:
        tiny.generation_config = {}


@pytest.fixture(scope="module")
def fixture_model():
    from tests.support.paths import FIXTURES

    path = FIXTURES / "minimax-m3-tiny"
    if not path.is_dir():
        pytest.skip("no golden fixtures")
    return m3lm.load(path, device="cpu")


def test_text_generation_and_stop_strings(fixture_model):
    model, tok = fixture_model
    assert tok is not None and model.generation_config["eos_token_id"] == 502
    full = m3lm.generate(model, tok, "Once upon a time", max_tokens=40, **GREEDY)
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    chunks = list(m3lm.stream_generate(model, tok, "Once upon a time", max_tokens=40, **GREEDY))
    assert "".join(c.text for c in chunks) == full.text
    # A stop string that spans tokens: the text ends right before it and it is never printed.
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = full.text.index(stop)
    res = m3lm.generate(model, tok, "Once upon a time", max_tokens=40, stop=[stop], **GREEDY)
    assert res.text == full.text[:cut] and res.finish_reason == "stop"


def test_chat_messages_use_the_template(fixture_model):
    model, tok = fixture_model
    messages = [{"role": "user", "content": "hello"}]
    res = m3lm.generate(
        model,
        tok,
        messages=messages,
        chat_template_kwargs={"thinking_mode": "enabled"},
        max_tokens=3,
        **GREEDY,
    )
    ids = tok.apply_chat_template(messages, thinking_mode="enabled")
    assert ids.count(tok.bos_token_id) == 1
    assert res.prompt_tokens == len(ids)
    assert res.token_ids == m3lm.generate(model, tok, ids, max_tokens=3, **GREEDY).token_ids


def test_sampling_defaults_come_from_generation_config(fixture_model):
    from m3lm.engine.engine import LLMEngine

    model, tok = fixture_model
    params = LLMEngine(model, tok, EngineConfig(max_model_len=64)).default_params(max_tokens=5)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 0.95, 40, 5)
    a = m3lm.generate(model, tok, "Once", max_tokens=12, seed=7, ignore_eos=True)
    b = m3lm.generate(model, tok, "Once", max_tokens=12, seed=7, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.text == b.text


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_prefix_cache_gives_the_same_tokens_and_skips_the_shared_prompt(tiny):
    page = tiny.args.index_block_size
    shared = prompt(30, seed=5)
    prompts = [shared + prompt(7, seed=6), shared + prompt(3, seed=7), shared[:13], shared, prompt(9, seed=8)]
    params = m3lm.SamplingParams(max_tokens=6, **GREEDY)
    want = run_engine(tiny, prompts, params, prefix_caching=False)
    engine = LLMEngine(tiny, None, EngineConfig())
    computed = count_computed(engine)
    earlier: list[list[int]] = []  # what earlier requests left in the cache: all but their last token
    total = 0
    for i, p in enumerate(prompts):  # one after another, so each finds what the earlier ones left
        seq = engine.add_request(p, params, request_id=str(i))
        while engine.has_unfinished():
            engine.step()
        common = max((common_prefix(p, e) for e in earlier), default=0)
        assert seq.num_prefix_cached == min(common, len(p) - 1) // page * page
        total += seq.num_prefix_cached
        assert computed[str(i)] == len(p) - seq.num_prefix_cached + len(seq.output_ids) - 1
        assert seq.output_ids == want[str(i)]
        earlier.append(seq.token_ids[:-1])
        engine.blocks.check()
    assert engine.scheduler.prefix_cached_tokens == total > 0 and engine.blocks.num_idle > 0


def test_session_engine_reuses_earlier_prompts_and_stays_usable(tiny):
    """`stream_generate(..., engine=session_engine(...))`: a prompt that extends an earlier
    request starts on its cached pages and gives the tokens of a fresh engine; a consumer that
    stops early leaves the engine idle for the next request; a prompt past its context is refused."""
    from m3lm.generation import session_engine, stream_generate

    page = tiny.args.index_block_size
    engine = session_engine(tiny, max_model_len=64)
    assert engine.max_model_len == 64
    first = prompt(21, seed=3)
    got1 = [c for c in stream_generate(tiny, None, first, engine=engine, max_tokens=5, **GREEDY)]
    out1 = [t for c in got1 for t in c.token_ids]
    second = first + out1 + prompt(6, seed=4)  # the next turn: history, reply, new message
    got2 = [c for c in stream_generate(tiny, None, second, engine=engine, max_tokens=5, **GREEDY)]
    fresh = m3lm.generate(tiny, None, second, max_tokens=5, **GREEDY)
    assert [t for c in got2 for t in c.token_ids] == fresh.token_ids
    assert got1[-1].cached_tokens == 0
    # the first request wrote its prompt and all but its last generated token
    assert got2[-1].cached_tokens == (len(first) + len(out1) - 1) // page * page > 0
    stream = stream_generate(tiny, None, prompt(10, seed=9), engine=engine, max_tokens=20, **GREEDY)
    next(stream)
    stream.close()  # the consumer stops after one increment
    assert not engine.has_unfinished()
    assert len(list(stream_generate(tiny, None, first, engine=engine, max_tokens=3, **GREEDY))) >= 1
    with pytest.raises(ValueError, match="context holds 64"):
        next(stream_generate(tiny, None, prompt(64, seed=1), engine=engine, max_tokens=3, **GREEDY))
    engine.blocks.check()


def test_requests_with_one_prompt_arriving_together_compute_it_once(tiny):
    """n choices of one prompt: the first computes the prompt; the others wait for its pages
    and compute only the last page, with the same tokens as without the prefix cache."""
    page = tiny.args.index_block_size
    p, n = prompt(23, seed=11), 3
    params = m3lm.SamplingParams(max_tokens=4, **GREEDY)
    want = run_engine(tiny, [p] * n, params, prefix_caching=False)
    engine = LLMEngine(tiny, None, EngineConfig())
    computed = count_computed(engine)
    seqs = [engine.add_request(p, params, request_id=str(i)) for i in range(n)]
    while engine.has_unfinished():
        engine.step()
        engine.blocks.check()
    assert [s.output_ids for s in seqs] == [want[str(i)] for i in range(n)]
    cached = (len(p) - 1) // page * page
    assert [s.num_prefix_cached for s in seqs] == [0] + [cached] * (n - 1)
    assert [computed[str(i)] for i in range(n)] == [len(p) + 3] + [len(p) - cached + 3] * (n - 1)
