"""Speculative decoding: the accept/reject rule, prompt lookup drafting, and the engine's
verification (greedy output token for token the same, sampled output distributed as the target's)."""

import math
import random

import pytest
import torch
from safetensors.torch import load_file

import m3lm
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine
from m3lm.engine.sequence import Sequence
from m3lm.errors import ConfigError
from m3lm.speculative import ngram
from m3lm.speculative.config import SpeculativeConfig
from m3lm.speculative.rejection import acceptance, residual, verify
from tests.support.checkpoints import random_prompt as prompt
from tests.support.paths import golden_params

GREEDY = {"temperature": 0.0, "ignore_eos": True}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive(seed: int) -> list[int]:
    """A prompt that repeats itself, so that prompt lookup finds drafts."""
    part = prompt(7, seed)
    return part * 3 + part[:3]


def run_engine(model, prompts, params, tokenizer=None, **config):
    engine = LLMEngine(model, tokenizer, EngineConfig(**config))
    for i, p in enumerate(prompts):
        engine.add_request(p, params if isinstance(params, m3lm.SamplingParams) else params[i], str(i))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            logprobs[o.request_id].extend(o.new_logprobs)
            assert o.finish_reason != "error", o.error
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_pages
    return out, logprobs, engine


# --- the rule ------------------------------------------------------------------------------------


def distributions(n: int, V: int, seed: int, zeros: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 2
    if zeros:  # some tokens dropped by a filter, as top-k / top-p / min-p leave them
        logits[torch.rand(n, V, generator=g) < 0.3] = float("-inf")
        logits[:, 0] = 0.0  # at least one kept
    return logits.softmax(-1)


@pytest.mark.parametrize("one_hot", [True, False])
def test_accept_then_residual_is_exactly_the_target(one_hot):
    """Sum over drafts d ~ q of [accept d] + [reject d] * residual = p, for every p and q."""
    V = 7
    p, q = distributions(50, V, 1), distributions(50, V, 2, zeros=False)
    for row in range(50):
        out = torch.zeros(V, dtype=torch.float64)
        for d in range(V):
            qd = torch.zeros(V) if one_hot else q[row]
            weight = 1.0 / V if one_hot else float(q[row, d])  # one-hot: any draft, uniformly
            if one_hot:
                qd[d] = 1.0
            dt = torch.tensor(d)
            a = float(acceptance(p[row], None if one_hot else qd, dt))
            r = residual(p[row], None if one_hot else qd, dt).double()
            out[d] += weight * a
            out += weight * (1 - a) * r
        assert torch.allclose(out, p[row].double(), atol=1e-6)


@pytest.mark.parametrize("one_hot", [True, False])
def test_verify_samples_the_target_at_every_position(one_hot):
    """Many rows through `verify`: the first emitted token follows p_0 and, after an accepted
    first draft, the second follows p_1, whatever the drafts are."""
    N, V, K = 200_000, 5, 2
    g = torch.Generator().manual_seed(3)
    p = distributions(K + 1, V, 4)
    q = distributions(K, V, 5, zeros=False)
    logits = p.log()[None].expand(N, K + 1, V)
    if one_hot:
        drafts, probs = torch.tensor([[1, 3]]).expand(N, K), None
    else:
        drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], 1)
        probs = q[None].expand(N, K, V)
    uniforms = torch.rand(N, K, generator=g)
    noise = torch.empty(N, V).exponential_(generator=g)
    accepted, nxt = verify(
        logits, drafts, torch.full((N,), K), torch.zeros(N, dtype=torch.bool), uniforms, noise, probs
    )
    emitted = torch.cat([drafts, torch.zeros(N, 1, dtype=torch.long)], 1).scatter(
        1, accepted[:, None], nxt[:, None]
    )
    first = torch.bincount(emitted[:, 0], minlength=V) / N
    sigma = (p[0] * (1 - p[0]) / N).sqrt()
    assert ((first - p[0]).abs() <= 5 * sigma + 1e-9).all(), (first, p[0])
    kept = accepted >= 1
    second = torch.bincount(emitted[kept, 1], minlength=V) / kept.sum()
    sigma = (p[1] * (1 - p[1]) / kept.sum()).sqrt()
    assert ((second - p[1]).abs() <= 5 * sigma + 1e-9).all(), (second, p[1])


def test_verify_greedy_keeps_the_drafts_that_are_the_argmax():
    logits = torch.tensor(
        [
            [[0.0, 5, 1], [2, 1, 0], [0, 0, 3], [1, 0, 0]],  # argmax 1, 0, 2, 0
            [[0.0, 5, 1], [2, 1, 0], [0, 0, 3], [1, 0, 0]],
            [[0.0, 5, 1], [2, 1, 0], [0, 0, 3], [1, 0, 0]],
            [[4.0, 4, 1], [2, 1, 0], [0, 0, 3], [1, 0, 0]],  # a tie: the lowest id
        ]
    )
    drafts = torch.tensor([[1, 0, 2], [1, 2, 2], [1, 0, 2], [1, 0, 0]])
    num = torch.tensor([3, 3, 1, 3])
    greedy = torch.ones(4, dtype=torch.bool)
    accepted, nxt = verify(logits, drafts, num, greedy, torch.zeros(4, 3), torch.ones(4, 3))
    assert accepted.tolist() == [3, 1, 1, 0]
    assert nxt.tolist() == [0, 0, 0, 0]


def test_prompt_lookup_takes_the_latest_longest_match():
    seq = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    assert ngram.propose(seq, 3, 1, 2) == [4, 7, 1]  # "1 2" last seen before 4
    assert ngram.propose([*seq, 3], 2, 1, 3) == [9, 1]  # "1 2 3" once, at the start
    assert ngram.propose([*seq, 3], 2, 4, 4) == []  # "2 ... 3" of four tokens: never before
    assert ngram.propose([4, 4, 4], 5, 1, 2) == [4]  # only what follows the match
    assert ngram.propose([8], 3, 1, 1) == []


def _propose_by_windows(tokens, k, n_min, n_max):
    """Prompt lookup as its definition reads: each suffix length from the longest, every window."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        hits = [s for s in range(L - n) if tokens[s : s + n] == tokens[L - n :]]
        if hits:
            return tokens[hits[-1] + n : hits[-1] + n + k]
    return []


def test_prompt_lookup_matches_its_definition_on_random_text():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randrange(1, 60))]
        n_min = rng.randint(1, 4)
        n_max = rng.randint(n_min, 6)
        k = rng.randint(1, 5)
        assert ngram.propose(tokens, k, n_min, n_max) == _propose_by_windows(tokens, k, n_min, n_max)


def test_prompt_lookup_over_a_growing_sequence_sees_every_token():
    rng = random.Random(1)
    seq = Sequence(0, "r", [rng.randrange(4) for _ in range(5)], SamplingParams(), 1000)
    lookup = ngram.Lookup()
    while seq.num_tokens < 700:  # past the first array's size
        assert lookup.propose(seq, 3, 1, 4) == _propose_by_windows(seq.token_ids, 3, 1, 4)
        seq.output_ids += [rng.randrange(4) for _ in range(rng.randint(1, 4))]


def test_speculative_config_is_read_as_vllm_spells_it():
    c = EngineConfig(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert c.speculative_config == SpeculativeConfig("ngram", 4, 3, 3)
    assert SpeculativeConfig.parse({"method": "ngram"}).prompt_lookup_min == 5
    for bad, why in [
        ({"method": "medusa"}, "not supported"),
        ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "above"),
        ({"method": "eagle3"}, 'needs "model"'),
        ({"method": "ngram", "draft_model": "x"}, "unknown key"),
        ("{not json", "not JSON"),
    ]:
        with pytest.raises(ConfigError, match=why):
            EngineConfig(speculative_config=bad)


# --- the engine ----------------------------------------------------------------------------------


def test_greedy_output_is_the_same_with_prompt_lookup(tiny):
    prompts = [repetitive(i) for i in range(4)] + [prompt(30, seed=9)]
    params = m3lm.SamplingParams(max_tokens=24, logprobs=2, **GREEDY)
    plain, plain_lp, _ = run_engine(tiny, prompts, params)
    spec, spec_lp, engine = run_engine(tiny, prompts, params, speculative_config=NGRAM)
    assert spec == plain
    st = engine.speculator.stats
    assert st.num_accepted_tokens > 0 and st.num_draft_tokens > st.num_accepted_tokens  # both outcomes
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    for i in plain:
        a, b = plain_lp[i], spec_lp[i]
        assert [x.token_id for x in b] == plain[i]
        assert torch.allclose(
            torch.tensor([x.logprob for x in a]), torch.tensor([x.logprob for x in b]), atol=1e-5
        )
        assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in x.top] for x in b]


@pytest.mark.parametrize("budget", [3, 5, 64])
def test_greedy_output_is_the_same_under_chunked_prefill_and_small_budgets(tiny, budget):
    """A budget smaller than a sequence's drafts cuts them; prefills share the step with them."""
    prompts = [repetitive(i) for i in range(3)]
    params = m3lm.SamplingParams(max_tokens=20, **GREEDY)
    plain, _, _ = run_engine(tiny, prompts, params, max_num_batched_tokens=budget)
    spec, _, _ = run_engine(tiny, prompts, params, max_num_batched_tokens=budget, speculative_config=NGRAM)
    assert spec == plain


def test_greedy_output_is_the_same_across_preemption(tiny):
    prompts = [repetitive(i) for i in range(4)]
    params = m3lm.SamplingParams(max_tokens=16, **GREEDY)
    roomy, _, _ = run_engine(tiny, prompts, params)
    tight, _, engine = run_engine(
        tiny, prompts, params, kv_cache_tokens=64, max_model_len=48, speculative_config=NGRAM
    )
    assert engine.scheduler.num_preemptions > 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert tight == roomy


def test_greedy_output_is_the_same_with_prefix_caching(tiny):
    """Requests sharing a long prefix start on its cached pages; the pages that only rejected
    drafts reached are never named, so later prompts never start on them."""
    shared = repetitive(5) * 2
    prompts = [shared + prompt(3, seed=i) for i in range(4)]
    params = m3lm.SamplingParams(max_tokens=24, **GREEDY)
    plain, _, _ = run_engine(tiny, prompts, params, prefix_caching=False)
    engine = LLMEngine(tiny, None, EngineConfig(speculative_config=NGRAM))
    for round_ in range(2):  # the second round starts on pages the first one named
        out = {}
        for i, p in enumerate(prompts):
            engine.add_request(p, params, f"{round_}-{i}")
            out[str(i)] = []
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id.split("-")[1]].extend(o.new_token_ids)
        assert out == plain
        engine.blocks.check()
    assert engine.scheduler.prefix_cached_tokens > 0
    # continuations too: each first request's whole text (prompt and output) as a new prompt
    again = run_engine(tiny, [prompts[0] + plain["0"][:-1]], m3lm.SamplingParams(max_tokens=1, **GREEDY))
    assert again[0]["0"] == plain["0"][-1:]


def test_seeded_sampling_with_speculation_does_not_depend_on_the_batch(tiny):
    params = m3lm.SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    p = repetitive(2)
    alone, _, _ = run_engine(tiny, [p], params, speculative_config=NGRAM)
    crowd, _, _ = run_engine(tiny, [repetitive(3), p], params, speculative_config=NGRAM)
    assert crowd["1"] == alone["0"]


def test_penalties_and_bias_apply_to_each_verified_position(tiny):
    """Greedy with a repetition penalty and a logit bias: each draft's row sees the drafts before
    it as output, so the tokens are those of plain decoding."""
    params = m3lm.SamplingParams(
        max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5, logit_bias=((60, 2.0),), **GREEDY
    )
    prompts = [repetitive(i) for i in range(3)]
    plain, _, _ = run_engine(tiny, prompts, params)
    spec, _, engine = run_engine(tiny, prompts, params, speculative_config=NGRAM)
    assert spec == plain and engine.speculator.stats.num_drafts > 0


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at the standard normal's z (0.999 for 3.09),
    by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_output_follows_the_target_distribution(tiny):
    """600 seeded requests of three tokens (temperature 0.9, top-k 3, a logit bias that leaves
    three likely tokens, so that prompt lookup drafts often and is often wrong): the empirical
    distribution of the outputs matches the model's own, computed from full forwards, by a
    chi-square test."""
    p = [0, 1, 2, 0, 2, 1, 1, 0, 2, 2]
    n, steps = 600, 3
    bias = tuple((t, -100.0) for t in range(3, 96))
    params = [
        m3lm.SamplingParams(
            max_tokens=steps, temperature=0.9, top_k=3, logit_bias=bias, seed=1000 + i, ignore_eos=True
        )
        for i in range(n)
    ]
    out, _, engine = run_engine(
        tiny, [p] * n, params, speculative_config=NGRAM, max_num_seqs=n, max_num_batched_tokens=4096
    )
    st = engine.speculator.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # drafts both accepted and rejected
    exact: dict[tuple, float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(steps):
            grown = {}
            for prefix, pr in exact.items():
                logits = tiny(torch.tensor([p + list(prefix)]))[0, -1]
                logits[3:] -= 100.0
                top = (logits / 0.9).topk(3)
                for t, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True):
                    grown[(*prefix, t)] = pr * q
            exact = grown
    counts: dict[tuple, int] = {}
    for ids in out.values():
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    assert set(counts) <= set(exact)
    # categories expected fewer than 5 times are pooled
    big = [k for k, v in exact.items() if v * n >= 5]
    small = [k for k in exact if k not in big]
    observed = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in small)]
    expected = [exact[k] * n for k in big] + [sum(exact[k] for k in small) * n]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    assert stat < chi2_critical(len(observed) - 1), (stat, observed, expected)


def test_the_story_model_gives_the_same_story_with_prompt_lookup():
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    prompts = [tok.encode(t) for t in ("Once upon a time", "Tom and Lily went to the park. Tom")]
    params = m3lm.SamplingParams(max_tokens=80, **GREEDY)
    plain, _, _ = run_engine(model, prompts, params)
    spec, _, engine = run_engine(model, prompts, params, speculative_config={**NGRAM, "prompt_lookup_min": 2})
    assert spec == plain and engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("fixture", golden_params())
def test_golden_greedy_with_prompt_lookup(fixture):
    model, _ = m3lm.load(fixture, device="cpu", dtype=torch.float32)
    exp = load_file(fixture / "expected.safetensors")
    want = exp["greedy.output_ids"].tolist()
    ids = exp["greedy.input_ids"][0].tolist()
    params = m3lm.SamplingParams(max_tokens=len(want), **GREEDY)
    out, _, engine = run_engine(model, [ids, ids[: len(ids) // 2] * 2], params, speculative_config=NGRAM)
    assert out["0"] == want
    assert engine.speculator.stats.num_drafts > 0


# --- EAGLE-3 drafters ------------------------------------------------------------------------------


def drafter_config(model, **over) -> dict:
    """The published drafter's config.json, its shapes scaled down to `model` (head dim 128 -> 16,
    64 KV heads -> one per query head; the full vocabulary with its own embedding and lm_head)."""
    from m3lm.models.eagle3 import published_config

    a = model.args
    c = published_config(
        hidden_size=a.hidden_size,
        num_attention_heads=a.hidden_size // 16,
        num_key_value_heads=a.hidden_size // 16,
        head_dim=16,
        intermediate_size=2 * a.hidden_size,
        vocab_size=a.vocab_size,
        layer_ids=[1, a.num_hidden_layers // 2, a.num_hidden_layers - 1],
    )
    return {**c, **over}


def eagle(path) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": 3}


def test_a_random_drafter_in_the_published_format_loads_and_drafts(tiny, tmp_path):
    from m3lm.models.eagle3 import random_drafter

    path = random_drafter(tmp_path / "drafter", drafter_config(tiny), seed=1)
    prompts = [repetitive(i) for i in range(3)] + [prompt(30, seed=9)]
    params = m3lm.SamplingParams(max_tokens=20, **GREEDY)
    plain, _, _ = run_engine(tiny, prompts, params)
    spec, _, engine = run_engine(tiny, prompts, params, speculative_config=eagle(path))
    assert spec == plain
    st = engine.speculator.stats
    assert st.num_draft_tokens >= 3 * len(prompts)  # every sequence drafted, k at a time
    assert engine.runner.capture == (1, 1, 2)


def test_the_kv_pool_counts_the_drafters_pages(tiny, tmp_path):
    """The drafter's key/value pool has a page for each of the model's, so a pool sized in bytes
    holds pages of both: the memory given is not overrun by the drafter's."""
    from m3lm.cache.kv_cache import KVCache
    from m3lm.models.eagle3 import random_drafter

    path = random_drafter(tmp_path / "drafter", drafter_config(tiny), seed=1)
    a = tiny.args
    target = KVCache.bytes_per_page(a, tiny.lm_head.weight.dtype)
    c = drafter_config(tiny)
    drafter = 2 * a.index_block_size * c["num_key_value_heads"] * c["head_dim"] * 4  # fp32
    memory = 40 * (target + drafter) + target  # 40 pages of both, not 41 of the model's alone
    plain = LLMEngine(tiny, None, EngineConfig(kv_cache_memory=memory, max_model_len=64))
    engine = LLMEngine(
        tiny, None, EngineConfig(kv_cache_memory=memory, max_model_len=64, speculative_config=eagle(path))
    )
    assert plain.blocks.num_pages > 40 and engine.blocks.num_pages == 40
    pool = engine.speculator.drafter.k
    assert pool.shape[0] == engine.cache.k[0].shape[0] == 41  # the spare page too
    assert engine.info.pool_bytes == 40 * (target + drafter)


def test_a_drafter_that_shares_the_targets_embedding_and_lm_head(tiny, tmp_path):
    """Without embed_tokens and lm_head tensors the drafter uses the target's; with the target
    itself as the source of its drafts it proposes something."""
    from m3lm.models.eagle3 import random_drafter

    path = random_drafter(tmp_path / "d", drafter_config(tiny), seed=2, shared=("embed_tokens", "lm_head"))
    params = m3lm.SamplingParams(max_tokens=16, **GREEDY)
    prompts = [repetitive(1), prompt(20, seed=3)]
    plain, _, _ = run_engine(tiny, prompts, params)
    spec, _, engine = run_engine(tiny, prompts, params, speculative_config=eagle(path))
    assert spec == plain and engine.speculator.stats.num_drafts > 0
    head = engine.speculator.drafter.head
    assert head.embed_tokens is None and head._shared[0] is tiny.model.embed_tokens


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda c, d: c.update(architectures=["LlamaForCausalLM"]), "is not an EAGLE-3 drafter"),
        (lambda c, d: c.update(hidden_size=32), "hidden states of size 32"),
        (lambda c, d: c.update(target_hidden_size=80), "hidden states of size 80"),
        (lambda c, d: c.update(vocab_size=97), "vocab_size = 97"),
        (lambda c, d: c.update(intermediate_size=64), r"midlayer.mlp.down_proj.weight has shape \(64, 128\)"),
        (
            lambda c, d: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 9, 2]),
            "three layer ids",
        ),
        (
            lambda c, d: d.pop("midlayer.self_attn.k_proj.weight"),
            "missing tensor midlayer.self_attn.k_proj.weight",
        ),
        (lambda c, d: d.update(extra=torch.zeros(1)), "unexpected tensor 'extra'"),
        (lambda c, d: d.update(d2t=torch.full((96,), 5)), "d2t maps draft ids outside"),
    ],
)
def test_a_malformed_drafter_is_a_one_line_error(tiny, tmp_path, change, why):
    import json

    from safetensors.torch import save_file

    from m3lm.errors import CheckpointError
    from m3lm.models.eagle3 import random_drafter

    path = random_drafter(tmp_path / "d", drafter_config(tiny), seed=3)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    change(config, tensors)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=why) as e:
        LLMEngine(tiny, None, EngineConfig(speculative_config=eagle(path)))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fixture", golden_params())
def test_golden_greedy_with_a_random_drafter_batched_cached_and_preempted(fixture, tmp_path):
    from m3lm.models.eagle3 import random_drafter

    model, _ = m3lm.load(fixture, device="cpu", dtype=torch.float32)
    exp = load_file(fixture / "expected.safetensors")
    want = exp["greedy.output_ids"].tolist()
    ids = exp["greedy.input_ids"][0].tolist()
    path = random_drafter(tmp_path / "d", drafter_config(model), seed=4)
    params = m3lm.SamplingParams(max_tokens=len(want), **GREEDY)
    prompts = [ids, ids[: len(ids) // 2] + ids, ids[:5]]
    plain, _, _ = run_engine(model, prompts, params)
    assert plain["0"] == want
    out, _, engine = run_engine(model, prompts * 2, params, speculative_config=eagle(path))
    assert [out[str(i)] for i in range(3)] == [plain[str(i)] for i in range(3)]
    assert [out[str(i + 3)] for i in range(3)] == [plain[str(i)] for i in range(3)]
    assert engine.scheduler.prefix_cached_tokens > 0  # the repeated prompts started on cached pages
    need = len(ids) * 2 + len(want)
    tight, _, engine = run_engine(
        model, prompts, params, speculative_config=eagle(path), kv_cache_tokens=need + 16, max_model_len=need
    )
    assert engine.scheduler.num_preemptions > 0
    assert tight == plain


def test_structured_output_requests_run_without_speculation():
    """A request whose logits a grammar masks gets no drafts; beside it a plain request does,
    and both make the tokens they make without speculation."""
    from m3lm.core import StructuredOutput

    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    text = tok.encode("Tom had a red ball. Tom had a red ball. Tom had a")
    so = StructuredOutput("regex", "( red ball\\.| big dog\\.){1,6}")
    params = [
        m3lm.SamplingParams(max_tokens=30, structured=so, **GREEDY),
        m3lm.SamplingParams(max_tokens=30, **GREEDY),
    ]
    plain, _, _ = run_engine(model, [text, text], params, tokenizer=tok)
    engine = LLMEngine(model, tok, EngineConfig(speculative_config={**NGRAM, "prompt_lookup_min": 2}))
    constrained = engine.add_request(text, params[0], "0")
    free = engine.add_request(text, params[1], "1")
    drafted = {"0": 0, "1": 0}
    out = {"0": [], "1": []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        drafted["0"] += len(constrained.draft_ids)
        drafted["1"] += len(free.draft_ids)
    assert out == plain
    assert drafted["0"] == 0 and constrained.num_drafts == 0
    assert drafted["1"] > 0 and free.num_drafts > 0


def test_the_story_model_with_its_drafter_tells_the_same_stories_batched():
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    prompts = [tok.encode(t) for t in ("Once upon a time", "Tom and Lily went to the park.", "The sun was")]
    params = m3lm.SamplingParams(max_tokens=60, **GREEDY)
    plain, _, _ = run_engine(model, prompts, params)
    spec = {"method": "eagle3", "model": str(m3lm.DEFAULT_DRAFTER), "num_speculative_tokens": 3}
    out, _, engine = run_engine(model, prompts, params, speculative_config=spec)
    assert out == plain
    assert engine.speculator.stats.mean_acceptance_length > 1.5  # a trained drafter, not a random one


def test_sequences_decoding_beside_a_prompt_draft_as_they_would_alone():
    """With verification as rows (as on a GPU), a step that prefills one prompt while others
    decode drafts those others all at once, the prompt alone: the drafts, and so the accepted
    counts, are those of drafting each sequence by itself (verification as chunks)."""
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    texts = ("Once upon a time", "Tom and Lily went to the park.", "The sun was", "A little dog")
    params = m3lm.SamplingParams(max_tokens=40, **GREEDY)
    spec = {"method": "eagle3", "model": str(m3lm.DEFAULT_DRAFTER), "num_speculative_tokens": 3}

    def staggered(as_rows: bool):
        engine = LLMEngine(model, None, EngineConfig(speculative_config=spec))
        engine.runner.verify_rows = as_rows
        out, mixed = {}, 0
        for i, t in enumerate(texts):  # a new prompt after every 3 steps: it prefills beside decodes
            engine.add_request(tok.encode(t), params, str(i))
            for _ in range(3 if i + 1 < len(texts) else 10**6):
                if not engine.has_unfinished():
                    break
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
                mixed += bool(engine.runner.rows) and len(engine.runner.rows) < len(engine.runner.spans)
        st = engine.speculator.stats
        return out, (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens), mixed

    rows, rows_stats, mixed = staggered(True)
    chunks, chunks_stats, _ = staggered(False)
    assert mixed >= 2  # steps with a prompt beside decoding rows happened
    assert rows == chunks and rows_stats == chunks_stats
