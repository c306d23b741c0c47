"""The offline batched API: many prompts through one engine, same results as one at a time."""

import pytest

import m3lm
from m3lm.llm import LLM
from tests.support.checkpoints import write_chat_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("llm"), seed=9)


def test_generate_batches_prompts_in_order(path):
    llm = LLM(path, device="cpu", max_num_seqs=4, max_num_batched_tokens=32)
    prompts = ["once upon a time", "the fox", [5, 6, 7, 8, 9, 10], "in paris the weather is"]
    params = m3lm.SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == [prompts[0], prompts[1], None, prompts[3]]
    assert [o.request_id for o in outs] == ["req-0", "req-1", "req-2", "req-3"]
    model, tok = llm.model, llm.tokenizer
    for p, o in zip(prompts, outs, strict=True):
        alone = m3lm.generate(model, tok, p, max_tokens=9, temperature=0.0, ignore_eos=True)
        assert o.outputs[0].token_ids == alone.token_ids and o.outputs[0].text == alone.text
        assert o.outputs[0].finish_reason == "length"
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_pages


def test_chat_and_per_prompt_params(path):
    llm = LLM(path, device="cpu")
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "tell me a story"}]]
    params = [
        m3lm.SamplingParams(max_tokens=3, temperature=0.0),
        m3lm.SamplingParams(max_tokens=5, temperature=0.0),
    ]
    outs = llm.chat(convs, params, chat_template_kwargs={"thinking_mode": "disabled"})
    assert [len(o.outputs[0].token_ids) <= n for o, n in zip(outs, (3, 5), strict=True)] == [True, True]
    ids = llm.tokenizer.apply_chat_template(convs[1], thinking_mode="disabled")
    assert outs[1].prompt_token_ids == ids
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["x"], params)


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_chat_replies_are_split_as_the_server_splits_them(path, thinking):
    """`LLM.chat` keeps each reply parsed (reasoning, answer, tool calls) by the text layer the
    server uses: with thinking on, the prompt ends inside the reasoning, so a reply without the
    closing marker is all reasoning; with it off, all answer."""
    from m3lm.text.reasoning import ReplyFormat

    llm = LLM(path, device="cpu")
    conv = [{"role": "user", "content": "tell me a story"}]
    params = m3lm.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = llm.chat(conv, params, chat_template_kwargs={"thinking_mode": thinking})[0]
    tok, ids = llm.tokenizer, out.outputs[0].token_ids
    assert not ReplyFormat.from_tokenizer(tok.hf).marker_ids & set(ids)  # one channel throughout
    text = tok.decode(ids, skip_special_tokens=True)
    reply = out.outputs[0].reply
    assert text and (reply.reasoning, reply.content) == ((text, "") if thinking == "enabled" else ("", text))
    assert reply.tool_calls == [] and out.outputs[0].text == text
    assert llm.generate(out.prompt_token_ids, params)[0].outputs[0].reply is None  # plain prompts
