"""One reasoning vocabulary over real HTTP with the official clients, on the embedded story model:
chat's `reasoning_effort`, Responses' `reasoning.effort` and Anthropic's `output_config.effort`
are the thinking mode and budget of `effort.EFFORTS`, enforced as chat's `thinking_token_budget`,
and a mode or budget the request gives itself wins. The story model ends its reasoning with its
end-of-text token, not a closer, so the budgets show as reasoning lengths with `ignore_eos`."""

import json

import anthropic
import openai
import pytest

import m3lm
from m3lm.server.effort import EFFORTS, FLASH_EFFORTS, M3_EFFORTS, efforts_of
from tests.support.live_server import API_KEY
from tests.support.paths import FIXTURES
from tests.support.story_server import NAME

STORY_CONTEXT = 1024
PROMPT = "Tell me a story about a dog."
MAX = 600  # past the low effort's budget, short of the medium one's
LOW = EFFORTS["low"][1]


@pytest.fixture
def openai_client(story_live):
    return openai.OpenAI(base_url=story_live.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def anthropic_client(story_live):
    return anthropic.Anthropic(base_url=story_live.url, api_key=API_KEY, max_retries=0)


def chat(client, **kw):
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX, temperature=0, **kw
    )
    msg = r.choices[0].message
    thought = r.usage.completion_tokens_details.reasoning_tokens
    return (
        msg.model_extra.get("reasoning_content") or "",
        msg.content or "",
        r.usage.completion_tokens,
        thought,
    )


def test_the_budgets_sit_inside_the_story_models_reach():
    assert LOW < MAX < EFFORTS["medium"][1]


def test_chat_reasoning_effort_is_a_reasoning_budget(openai_client):
    low = chat(openai_client, reasoning_effort="low", extra_body={"ignore_eos": True})
    assert low == chat(
        openai_client,
        extra_body={
            "ignore_eos": True,
            "thinking_token_budget": LOW,
            "chat_template_kwargs": {"thinking_mode": "enabled"},
        },
    )
    medium = chat(openai_client, reasoning_effort="medium", extra_body={"ignore_eos": True})
    none = chat(openai_client, reasoning_effort="none", extra_body={"ignore_eos": True})
    assert medium[0].startswith(low[0]) and len(medium[0]) > len(low[0])  # the same words, cut at 512 tokens
    assert low[1] and not medium[1]  # low answers after its budget; medium reasons to max_tokens
    assert low[3] == LOW + 1 and medium[3] == MAX  # reasoning tokens: the budget and its closer
    assert none[0] == "" and none[1] and none[3] == 0


@pytest.mark.parametrize("effort", ["low", "medium", "none"])
def test_responses_effort_is_chats(openai_client, effort):
    r = openai_client.responses.create(
        model=NAME, input=PROMPT, max_output_tokens=MAX, temperature=0, reasoning={"effort": effort}
    )
    reasoning, answer, tokens, _ = chat(openai_client, reasoning_effort=effort)
    got = {o.type: o.content[0].text for o in r.output}
    assert (got.get("reasoning", ""), got.get("message", "")) == (reasoning, answer)
    assert r.usage.output_tokens == tokens and (effort == "none") == (not reasoning)


def test_a_budget_or_mode_of_the_request_wins_over_its_effort(openai_client):
    own_budget = chat(openai_client, reasoning_effort="low", extra_body={"thinking_token_budget": 20})
    assert own_budget == chat(
        openai_client,
        extra_body={"thinking_token_budget": 20, "chat_template_kwargs": {"thinking_mode": "enabled"}},
    )
    own_mode = chat(
        openai_client,
        reasoning_effort="high",
        extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},
    )
    assert own_mode[0] == "" and own_mode == chat(openai_client, reasoning_effort="none")


def test_anthropic_effort_is_the_same_budget_and_thinking_wins(openai_client, anthropic_client):
    def thinking_and_text(thinking=None, effort=None):
        extra = {"temperature": 0} | ({"output_config": {"effort": effort}} if effort else {})
        kw = {"thinking": thinking} if thinking else {}
        m = anthropic_client.messages.create(
            model=NAME, max_tokens=MAX, messages=[{"role": "user", "content": PROMPT}], extra_body=extra, **kw
        )
        blocks = {b.type: b for b in m.content}
        return (blocks["thinking"].thinking if "thinking" in blocks else ""), (
            blocks["text"].text if "text" in blocks else ""
        )

    reasoning, answer, *_ = chat(openai_client, reasoning_effort="low")
    assert thinking_and_text(effort="low") == (reasoning, answer)
    # thinking's own budget is taken over the effort's
    own = thinking_and_text(thinking={"type": "enabled", "budget_tokens": 20}, effort="low")
    assert own == thinking_and_text(thinking={"type": "enabled", "budget_tokens": 20})
    assert len(own[0]) < len(reasoning)
    with pytest.raises(anthropic.BadRequestError, match="effort"):
        anthropic_client.messages.create(
            model=NAME,
            max_tokens=8,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body={"output_config": {"effort": "extreme"}},
        )


@pytest.mark.parametrize("effort", ["extreme", {"level": "low"}, ["low"], 3])
def test_an_unknown_effort_is_a_400(openai_client, effort):
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat(openai_client, reasoning_effort=effort)


def test_the_m3_card_states_its_vocabulary_and_no_default(openai_client):
    card = openai_client.models.retrieve(NAME).model_extra
    assert card["reasoning_efforts"] == list(EFFORTS) and card["default_reasoning_effort"] is None


def test_a_template_that_reads_reasoning_effort_is_m3_1_flashs():
    templates = [m3lm.DEFAULT_MODEL / "tokenizer_config.json", *FIXTURES.glob("*/tokenizer_config.json")]
    for path in templates:  # the story model's and the fixtures' M3 templates
        assert efforts_of(json.loads(path.read_text())["chat_template"]) is M3_EFFORTS, path
    template = json.loads(templates[0].read_text())["chat_template"]
    flash = template.replace("' ~ mode ~ '", "' ~ mode ~ reasoning_effort ~ '")
    assert efforts_of(flash) is FLASH_EFFORTS
    assert efforts_of({"default": template, "tool_use": flash}) is FLASH_EFFORTS
    assert efforts_of("{% set reasoning_effort = 'x' %}{{ reasoning_effort }}") is M3_EFFORTS  # its own
    assert efforts_of("{{ reasoning_effort") is M3_EFFORTS  # a broken template: rendering says why
    assert efforts_of(None) is None and efforts_of("") is None
