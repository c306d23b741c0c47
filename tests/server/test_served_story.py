"""The server on the embedded model in fp32 on the CPU, over real HTTP: echo and prompt logprobs
(lm-eval's loglikelihood requests), `/tokenizer_info`, `/v1/models/{id}`, and the conventions
clients look for (context-length errors, the end-to-end latency of every finished reply)."""

import re

import httpx
import openai
import pytest
import torch

from tests.support.live_server import API_KEY
from tests.support.story_server import NAME

TEXTS = ["Once upon a time there was a little girl named Lily.", "The dog ran to the park and"]


@pytest.fixture(scope="module")
def served(story_live):
    return story_live, story_live.model, story_live.tok


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key=API_KEY, max_retries=0)


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    """One plain full forward over the prompt: [P, V] (row p scores token p + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def test_echo_logprobs_are_the_models_log_softmax(served, client):
    """lm-eval's request: token ids, echo, logprobs 1, max_tokens 1, temperature 0."""
    _, model, tok = served
    prompts = [tok.encode(t) for t in TEXTS]
    r = client.completions.create(
        model=NAME, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    assert len(r.choices) == 2
    for ids, c in zip(prompts, sorted(r.choices, key=lambda c: c.index), strict=True):
        ref = log_softmax(model, ids)
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 1  # the prompt's tokens, then the generated one
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p in range(len(ids) - 1):
            assert abs(lp.token_logprobs[p + 1] - ref[p, ids[p + 1]].item()) < 1e-4
            best = ref[p].max().item()
            assert max(lp.top_logprobs[p + 1].values()) == pytest.approx(best, abs=1e-4)
        assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
        assert c.text.startswith(tok.decode(ids)) and len(c.text) > len(tok.decode(ids))
        # text_offset: where each listed token starts in the concatenated token texts
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        # the generated token is the model's greedy choice after the whole prompt
        assert tok.encode(lp.tokens[-1]) == [int(log_softmax(model, ids)[-1].argmax())]


def test_echo_with_max_tokens_zero_scores_only(served, client):
    _, model, tok = served
    r = client.completions.create(model=NAME, prompt=TEXTS[0], echo=True, max_tokens=0, logprobs=0)
    c = r.choices[0]
    assert c.text == TEXTS[0] and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    ids = tok.encode(TEXTS[0])
    ref = log_softmax(model, ids)
    got = c.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    assert got[1:] == pytest.approx([ref[p, ids[p + 1]].item() for p in range(len(ids) - 1)], abs=1e-4)
    r = client.completions.create(model=NAME, prompt=TEXTS[1], echo=True, max_tokens=0)
    assert r.choices[0].text == TEXTS[1] and r.choices[0].logprobs is None


def test_streamed_echo_starts_with_the_prompt(client):
    kw = {"model": NAME, "prompt": TEXTS[1], "echo": True, "logprobs": 2, "max_tokens": 6, "temperature": 0}
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text == TEXTS[1]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset


def test_vllm_prompt_logprobs_field(served, client):
    _, model, tok = served
    ids = tok.encode(TEXTS[0])
    r = client.completions.create(
        model=NAME, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    ref = log_softmax(model, ids)
    for p, entry in enumerate(plp[1:]):
        actual = entry[str(ids[p + 1])]
        assert actual["logprob"] == pytest.approx(ref[p, ids[p + 1]].item(), abs=1e-4)
        assert actual["rank"] == 1 + int((ref[p] > ref[p, ids[p + 1]]).sum())
        top = ref[p].topk(3).indices.tolist()
        assert all(str(t) in entry for t in top)
        assert [entry[str(t)]["rank"] for t in top] == [1, 2, 3]
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model=NAME, prompt="a", stream=True, extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    # chat scores its prompt with nothing to generate, as completions does
    messages = [{"role": "user", "content": TEXTS[1]}]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=0, extra_body={"prompt_logprobs": 1}
    )
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "length"
    assert len(plp) == len(prompt) == r.usage.prompt_tokens and r.usage.completion_tokens == 0
    ref = log_softmax(model, prompt)
    assert plp[-1][str(prompt[-1])]["logprob"] == pytest.approx(ref[-2, prompt[-1]].item(), abs=1e-4)


def test_models_retrieve_and_tokenizer_info(served, client):
    server, _, tok = served
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "not_found"  # OpenAI's clients type `code` as a string or null
    headers = {"Authorization": f"Bearer {API_KEY}"}
    info = httpx.get(server.url + "/tokenizer_info", headers=headers).json()
    assert info["eos_token"] == tok.hf.eos_token and info["model_max_length"] == 256
    assert info["chat_template"] == tok.hf.chat_template
    # what a remote-tokenizer client does with it: the eos token's id through /tokenize
    ids = httpx.post(server.url + "/tokenize", json={"prompt": info["eos_token"]}, headers=headers).json()
    assert ids["tokens"] == [tok.hf.eos_token_id]
    assert httpx.get(server.url + "/tokenizer_info").json() == info  # lm-eval reads it before any key


def test_too_long_prompts_read_as_context_length_errors(client):
    """Clients (litellm, LangChain) recognise a context overflow by vLLM's wording."""
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        client.completions.create(model=NAME, prompt=[5] * 300, max_tokens=1)
    assert "300" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt="once upon a time " * 2000, max_tokens=1)


def e2e_count(server) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return float(re.search(r"^m3lm:e2e_request_latency_seconds_count\S* (\S+)$", text, re.M)[1])


def test_a_reply_ended_by_a_stop_string_counts_in_the_latency(served, client):
    server = served[0]
    msgs = [{"role": "user", "content": "Tell me a story about a dog."}]
    kw = {"model": NAME, "messages": msgs, "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    stop = whole[6:10]
    assert len(stop) == 4 and whole.index(stop) == 6
    before = e2e_count(server)
    cut = client.chat.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == whole[:6]
    assert e2e_count(server) == before + 1


def test_echo_of_ids_outside_the_vocabulary_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=NAME, prompt=[-1], echo=True, max_tokens=1)


def test_logprobs_under_a_grammar_are_finite_whole_and_streamed(client):
    """Alternatives a grammar forbids have logprob -inf: they come as OpenAI's floor, -9999.0,
    the same in a whole reply and in its stream (JSON has no infinity; the schema no null)."""
    body = dict(
        model=NAME,
        messages=[{"role": "user", "content": "Yes or no?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "a",
                "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
            },
        },
        logprobs=True,
        top_logprobs=20,
        max_tokens=12,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},
    )
    whole = client.chat.completions.create(**body).choices[0].logprobs.content
    streamed = [
        e for ch in client.chat.completions.create(**body, stream=True) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]  # fmt: skip
    values = [[t.logprob for t in e.top_logprobs] for e in whole]
    again = [[t.logprob for t in e.top_logprobs] for e in streamed]
    assert len(again) == len(values) and all(
        a == pytest.approx(v, rel=1e-4) for a, v in zip(again, values, strict=True)
    )
    assert all(v >= -9999.0 for row in values for v in row)
    assert any(v == -9999.0 for row in values for v in row)  # a forbidden alternative
    assert all(e.logprob > -9999.0 for e in whole)  # the chosen tokens are allowed


def test_prompt_logprob_replies_are_bounded(served, client, monkeypatch):
    """A reply listing more prompt logprobs than the bound (prompt tokens x entries x n; the
    bound lowered here to fit this model's short context) is a 400 that says so, before it
    runs, on completions and chat; within it the same kind of request is served."""
    from m3lm.server import choice

    _, _, tok = served
    ids = tok.encode(TEXTS[0])
    monkeypatch.setattr(choice, "MAX_PROMPT_LOGPROBS", 40 * len(ids))
    over = dict(model=NAME, prompt=ids, max_tokens=1, n=2, echo=True, logprobs=5)
    with pytest.raises(openai.BadRequestError, match=f"{2 * 27 * len(ids):,} prompt logprobs .* bound of"):
        client.completions.create(**over, extra_body={"prompt_logprobs": 20})  # 6 + 21 entries a token
    messages = [{"role": "user", "content": TEXTS[0]}]
    with pytest.raises(openai.BadRequestError, match="over this server's bound"):
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=1, n=2, extra_body={"prompt_logprobs": 20}
        )
    ok = client.completions.create(**over, extra_body={"prompt_logprobs": 2})  # 6 + 3 entries a token
    assert len(ok.choices[1].model_extra["prompt_logprobs"]) == len(ids) and ok.choices[1].logprobs.tokens


def test_whole_replies_are_built_off_the_event_loop():
    import asyncio
    import threading

    from m3lm.server.handlers import ServerState

    state = ServerState(None, None, "m", None, None, None)

    async def main():
        loop = threading.current_thread().name
        response = await state.json_reply(lambda: {"built on": threading.current_thread().name})
        return loop, response

    loop, response = asyncio.run(main())
    built = response.body.decode()
    assert "m3lm-reply" in built and loop not in built
    state.replies.shutdown()
