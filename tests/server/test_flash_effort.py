"""MiniMax-M3.1-Flash's effort levels over real HTTP: a real `m3lm serve` process on a tiny
Flash-like checkpoint (the embedded model in the release's mixed layout, `flash_export`, with a
chat template that reads `reasoning_effort`), spoken to with the official `openai` and
`anthropic` clients. The template writes the level into the system turn, followed by three ` +`
a rank (six tokens: more than the levels' names differ by), so each level's prompt has its own
length: chat's prompt tokens (its `prompt_logprobs`) are
compared with the template rendered here, and the Responses and Messages APIs' prompt token
counts with that render's length."""

import json

import anthropic
import httpx
import openai
import pytest

import m3lm
from m3lm.tokenizer import load_tokenizer
from tests.support.paths import PATIENCE_S
from tests.support.processes import Serve
from tests.support.quant_exports import checkpoint_source, flash_export

LEVELS = ["low", "medium", "high", "xhigh", "max"]
ACCEPTED = "'low', 'medium', 'high', 'xhigh' or 'max'"  # how every refusal names them
NAME = "flash"
PROMPT = "Tell me a story about a dog."
MESSAGES = [{"role": "user", "content": PROMPT}]
# The story model's template made Flash-like: the effort in the system turn instead of the
# thinking mode, and a prompt that always opens the reasoning (thinking is always on).
EDITS = {
    "{%- set mode = thinking_mode | default('adaptive') -%}": "{%- set rank = "
    + json.dumps(LEVELS).replace('"', "'")
    + ".index(reasoning_effort) + 1 -%}",
    "Current thinking mode: ' ~ mode ~ '.": "Reasoning effort: ' ~ reasoning_effort ~ (' +' * 3 * rank) ~ '.",
    "{%- if mode == 'enabled' -%}{{- '<mm:think>' -}}{%- elif mode == 'disabled' -%}{{- '</mm:think>' -}}"
    "{%- endif -%}": "{{- '<mm:think>' -}}",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = flash_export(tmp_path_factory.mktemp("flash"), checkpoint_source(m3lm.DEFAULT_MODEL)).path
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    template = config["chat_template"]
    for old, new in EDITS.items():
        assert template.count(old) == 1, old
        template = template.replace(old, new)
    config_file.write_text(json.dumps({**config, "chat_template": template}))
    return path


@pytest.fixture(scope="module")
def expected(checkpoint):
    """Each level's prompt ids, as the template renders them with that level."""
    tok = load_tokenizer(checkpoint)
    ids = {level: tok.chat_prompt(MESSAGES, None, True, {"reasoning_effort": level}) for level in LEVELS}
    for level in LEVELS:
        assert f"Reasoning effort: {level}{' +' * 3 * (LEVELS.index(level) + 1)}." in tok.decode(ids[level])
    assert len({len(i) for i in ids.values()}) == len(LEVELS)  # a count names its level
    return ids


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Serve("--model", str(checkpoint), "--served-model-name", NAME, "--compile", "off")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.kill()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=PATIENCE_S)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=PATIENCE_S)


def chat_prompt_ids(oai, extra_body=None, **kw) -> list[int]:
    """The prompt the server rendered: its ids after the first, read from `prompt_logprobs`."""
    extra_body = {"prompt_logprobs": 0, **(extra_body or {})}
    r = oai.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=1, temperature=0, extra_body=extra_body, **kw
    )
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == r.usage.prompt_tokens
    return [int(next(iter(e))) for e in entries[1:]]


def responses_prompt(oai, **kw) -> tuple[int, str | None]:
    r = oai.responses.create(model=NAME, input=PROMPT, max_output_tokens=1, temperature=0, **kw)
    return r.usage.input_tokens, r.reasoning.effort


def messages_prompt(claude, **extra) -> int:
    m = claude.messages.create(
        model=NAME, max_tokens=1, messages=MESSAGES, extra_body={"temperature": 0, **extra}
    )
    counted = claude.messages.count_tokens(model=NAME, messages=MESSAGES, extra_body=extra).input_tokens
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    return counted


def test_the_model_card_states_the_levels_and_the_default(oai, server):
    card = oai.models.retrieve(NAME).model_extra
    assert card["reasoning_efforts"] == LEVELS and card["default_reasoning_effort"] == "max"
    listed = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert (listed["reasoning_efforts"], listed["default_reasoning_effort"]) == (LEVELS, "max")


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_reaches_the_template_from_every_api(oai, claude, expected, level):
    assert chat_prompt_ids(oai, reasoning_effort=level) == expected[level][1:]
    assert responses_prompt(oai, reasoning={"effort": level}) == (len(expected[level]), level)
    assert messages_prompt(claude, output_config={"effort": level}) == len(expected[level])


def test_without_an_effort_the_level_is_max(oai, claude, expected):
    assert chat_prompt_ids(oai) == expected["max"][1:]
    assert responses_prompt(oai) == (len(expected["max"]), "max")
    assert messages_prompt(claude) == len(expected["max"])
    assert messages_prompt(claude, thinking={"type": "adaptive"}) == len(expected["max"])


def test_the_template_variable_itself_is_checked_alike(oai, expected):
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "low"}}
    assert chat_prompt_ids(oai, extra_body=kwargs) == expected["low"][1:]
    with pytest.raises(openai.BadRequestError, match=ACCEPTED) as e:
        oai.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"reasoning_effort": "huge"}},
        )
    assert e.value.body["param"] == "chat_template_kwargs.reasoning_effort"


@pytest.mark.parametrize("effort", ["none", "minimal", "extreme"])
def test_a_level_the_model_lacks_is_a_400_naming_the_levels(oai, claude, effort):
    with pytest.raises(openai.BadRequestError, match=ACCEPTED) as e:
        oai.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1, reasoning_effort=effort)
    assert (e.value.body["param"], e.value.body["type"]) == ("reasoning_effort", "invalid_request_error")
    with pytest.raises(openai.BadRequestError, match=ACCEPTED) as e:
        oai.responses.create(model=NAME, input=PROMPT, max_output_tokens=1, reasoning={"effort": effort})
    assert e.value.body["param"] == "reasoning.effort"
    with pytest.raises(anthropic.BadRequestError, match=ACCEPTED) as e:
        claude.messages.create(
            model=NAME, max_tokens=1, messages=MESSAGES, extra_body={"output_config": {"effort": effort}}
        )
    assert e.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": f"output_config.effort: Input should be {ACCEPTED}"
                  + (" (this model always thinks: it has no level without reasoning)" if effort != "extreme" else "")},
    }  # fmt: skip


def test_thinking_cannot_be_turned_off(oai, claude):
    levels = "low, medium, high, xhigh, max"
    with pytest.raises(openai.BadRequestError, match=f"always thinks.*{levels}") as e:
        oai.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},
        )
    assert e.value.body["param"] == "chat_template_kwargs.thinking_mode"
    with pytest.raises(anthropic.BadRequestError, match=f"always thinks.*{levels}") as e:
        claude.messages.create(model=NAME, max_tokens=1, messages=MESSAGES, thinking={"type": "disabled"})
    assert e.value.body["type"] == "error"
    with pytest.raises(anthropic.BadRequestError, match="always thinks"):
        claude.messages.count_tokens(model=NAME, messages=MESSAGES, thinking={"type": "disabled"})
