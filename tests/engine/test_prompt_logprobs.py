"""Prompt logprobs (echo, lm-eval's loglikelihood): each prompt token's log-probability under
the model, computed in the engine's packed steps and checked against one plain full forward."""

import pytest
import torch

import m3lm
from m3lm.config import EngineConfig
from m3lm.core import SamplingParams
from m3lm.engine.engine import LLMEngine
from m3lm.llm import LLM


@pytest.fixture(scope="module")
def story():
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype="float32")
    return model, tok


def reference(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one full forward over the prompt: [P, V] (row p scores token p + 1)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()
    return torch.log_softmax(logits, dim=-1)


def prompts(tok) -> list[list[int]]:
    texts = [
        "Once upon a time there was a little girl named Lily. She loved to play outside in the sun.",
        "Tom had a red ball. He threw it to his dog, and the dog ran after it.",
        "The cat sat on the mat.",
    ]
    return [tok.encode(t) for t in texts]


def run(engine: LLMEngine, ids_list, params) -> list:
    seqs = [engine.add_request(ids, params) for ids in ids_list]
    outs = {s.request_id: [] for s in seqs}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return [outs[s.request_id] for s in seqs]


def check(model, ids, lps, k):
    ref = reference(model, ids)
    assert len(lps) == len(ids) - 1
    for p, lp in enumerate(lps):
        assert lp.token_id == ids[p + 1]
        assert abs(lp.logprob - ref[p, ids[p + 1]].item()) < 1e-4
        want = ref[p].topk(k)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert lp.rank == 1 + int((ref[p] > ref[p, ids[p + 1]]).sum())


@pytest.mark.parametrize("chunk", [2048, 7])  # whole prompts in one step, or chunked prefill
def test_prompt_logprobs_match_a_full_forward(story, chunk):
    model, tok = story
    ids_list = prompts(tok)
    engine = LLMEngine(
        model, None, EngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=chunk)
    )
    outs = run(engine, ids_list, SamplingParams(max_tokens=0, prompt_logprobs=3))
    for ids, out in zip(ids_list, outs, strict=True):
        assert [o.new_token_ids for o in out] == [[]]  # nothing generated
        assert out[-1].finished and out[-1].finish_reason == "length"
        check(model, ids, out[0].prompt_logprobs, 3)
    assert engine.blocks.num_used == 0


def test_prompt_logprobs_ignore_the_prefix_cache_and_leave_generation_alone(story):
    """A prompt found in the prefix cache is still scored whole; asking for prompt logprobs
    changes no generated token."""
    model, tok = story
    ids = prompts(tok)[0]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_model_len=512))
    plain = run(engine, [ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    scored = run(engine, [ids], SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0))[0]
    again = run(engine, [ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert again[0].num_prefix_cached > 0  # the cache holds the prompt's pages
    assert scored[0].num_prefix_cached == 0
    gen = [[t for o in out for t in o.new_token_ids] for out in (plain, scored, again)]
    assert gen[0] == gen[1] == gen[2] and len(gen[0]) == 8
    check(model, ids, scored[0].prompt_logprobs, 0)
    assert all(o.prompt_logprobs is None for o in scored[1:] + plain)


def test_llm_returns_prompt_logprobs_as_vllm_does(story):
    model, tok = story
    llm = LLM(model=m3lm.DEFAULT_MODEL, device="cpu", dtype="float32")
    ids = prompts(tok)[2]
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.outputs[0].token_ids == [] and out.prompt_logprobs[0] is None
    check(model, ids, out.prompt_logprobs[1:], 1)


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
