"""The chat page at /, driven in a real headless Chromium against a live server on the embedded model.

Playwright for Python drives the distribution's Chromium (`apt-get install chromium`); where
either is missing the browser tests skip and say why. The server is the app as `m3lm serve`
serves it (`LiveServer`), or `m3lm serve` itself, over real HTTP. Every page runs with the network
cut off except its server: a request anywhere else is aborted and fails the test, as does a
console error (a Content-Security-Policy violation is one), an uncaught exception or a dialog.

Replies are the story model's own, except where a test needs markup the model never writes (a
tool call, HTML in a reply): there the engine's sampler is scripted, and the reply still goes
through the engine, the reply parser, SSE and the page. A reply is held midway by making the
engine's sampler wait, so nothing here depends on the machine's speed.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

import m3lm
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.server.app import create_server_app
from m3lm.server.engine_client import AsyncEngine
from m3lm.server.protocol import Limits
from m3lm.server.web import CONTENT_SECURITY_POLICY
from tests.support.live_server import LiveServer, Script, wait_idle
from tests.support.processes import start_serve, wait_healthy

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # the page's tests skip; the server-side ones still run
    sync_playwright = None

NAME = "story"
WAIT_MS = 120_000  # an outer bound for page states on a busy machine, never a speed claim
WEB = Path(m3lm.__file__).parent / "server" / "web"
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}


@pytest.fixture(scope="module")
def browser():
    if sync_playwright is None:
        pytest.skip("playwright is not installed (it is in requirements/test.txt)")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium)")
    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=chromium)
        except Exception as e:  # a browser that cannot start here (missing libraries, no sandbox)
            pytest.skip(f"{chromium} does not start: {str(e).splitlines()[0]}")
        yield browser
        browser.close()


def serve_story(api_key=None, web_ui=True):
    """The embedded model served as `m3lm serve` serves it, on a thread: its sampler can be swapped."""
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu")
    engine = AsyncEngine(LLMEngine(model, tok, EngineConfig(max_model_len=1024, max_num_seqs=4)), 16)
    server = LiveServer(create_server_app(engine.start(), tok, NAME, api_key, Limits(), web_ui=web_ui))
    server.engine = engine
    return server


@pytest.fixture(scope="module")
def story():
    server = serve_story()
    yield server
    server.stop()


@pytest.fixture
def llm(story):
    """The story server's engine, idle; a sampler a test sets is put back afterwards."""
    engine = story.engine.engine
    real = engine.sampler
    yield engine
    if isinstance(engine.sampler, Pause):
        engine.sampler.go.set()
    wait_idle(story.engine, timeout=60)
    engine.sampler = real


class Pause:
    """The engine's own sampler, except that a step with a request `after` tokens long waits until
    `go` is set: a reply held midway, however fast or slow the machine."""

    def __init__(self, sampler, after: int):
        self.sampler, self.after, self.go = sampler, after, threading.Event()

    def __call__(self, logits, params, prompt_ids, output_ids, generators):
        if any(len(o) >= self.after for o in output_ids):
            self.go.wait(300)
        return self.sampler(logits, params, prompt_ids, output_ids, generators)


class Guard:
    """A page on a network cut off except for `origin`: records what it tried elsewhere (aborted),
    every request, the chat requests' bodies, console errors, uncaught exceptions and dialogs."""

    def __init__(self, context, page, origin: str):
        self.origin = origin
        self.outside, self.requests, self.chats, self.errors, self.dialogs = [], [], [], [], []
        context.route("**/*", self._route)
        page.on("request", self._request)
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("dialog", self._dialog)

    def _route(self, route):
        url = route.request.url
        if origin(url) == self.origin:
            route.continue_()
        else:
            self.outside.append(url)
            route.abort("internetdisconnected")

    def _request(self, request):
        self.requests.append(request.url)
        if request.url.endswith("/v1/chat/completions"):
            self.chats.append(request.post_data_json)

    def _dialog(self, dialog):
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def check(self, refused: int | None = None):
        """Nothing tried beyond the server, no dialog, and no console error but the browser's own
        line for a response with the `refused` status."""
        assert self.outside == [] and self.dialogs == []
        line = f"the server responded with a status of {refused}"
        assert [e for e in self.errors if refused is None or line not in e] == []


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def open_page(browser, url: str, init_script: str | None = None, **context_options):
    context = browser.new_context(**context_options)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.guard = Guard(context, page, origin(url))
    if init_script:
        page.add_init_script(init_script)
    page.goto(url)
    return page


@pytest.fixture
def page(browser, story):
    page = open_page(browser, story.url, viewport={"width": 960, "height": 640})
    expect(page.locator("body")).to_have_attribute("data-state", "ready")
    yield page
    page.context.close()
    page.guard.check()


def settings(page, **values) -> None:
    """Opens the settings and sets them (element id, with _ for -: value)."""
    if not page.locator("#settings").evaluate("d => d.open"):
        page.click("#settings summary")
    for name, value in values.items():
        field = page.locator("#" + name.replace("_", "-"))
        if name == "thinking":
            field.select_option(value)
        else:
            field.fill(value)


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def reply_done(page):
    """The last reply, once its usage line is in (the stream's last chunk before [DONE])."""
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".stats")).to_contain_text("finish: ")
    expect(page.locator("body")).to_have_attribute("data-state", "ready")
    return reply


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def wait_until(condition, what: str, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# ---- the server's side: no browser needed ----


def test_the_page_is_served_with_its_security_headers(story):
    for path, kind in [("/", "text/html"), ("/web/app.js", "text/javascript"), ("/web/app.css", "text/css")]:
        r = httpx.get(story.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.content == (WEB / ("index.html" if path == "/" else path.rsplit("/", 1)[1])).read_bytes()
    for rule in ("default-src 'self'", "script-src 'self'", "object-src 'none'", "frame-ancestors 'none'"):
        assert rule in CONTENT_SECURITY_POLICY
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY and "http" not in CONTENT_SECURITY_POLICY
    assert httpx.get(story.url + "/?body=x").content == (WEB / "index.html").read_bytes()
    assert (
        httpx.get(story.url + "/web/web.py").status_code == httpx.get(story.url + "/web/").status_code == 404
    )
    paths = httpx.get(story.url + "/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/web") for p in paths)


def test_the_model_card_gives_context_and_capacity(story):
    card = client(story).models.list().data[0]
    engine = story.engine.engine
    assert card.id == NAME and card.model_extra["max_model_len"] == engine.max_model_len == 1024
    assert card.model_extra["max_num_seqs"] == engine.config.max_num_seqs == 4
    assert card.model_extra["kv_cache_tokens"] == engine.blocks.num_pages * engine.blocks.page_size


def test_the_page_writes_text_never_markup():
    """The page's own code: no HTML parsing of strings, no inline script or style (which the CSP
    would refuse), and no address but the server's own paths."""
    script = (WEB / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function("):
        assert sink not in script
    html = (WEB / "index.html").read_text()
    assert re.findall(r"<script[^>]*>", html) == ['<script src="/web/app.js" defer>']
    assert "<style" not in html and not re.search(r"<[^>]*\s(style|on\w+)=", html)
    assert not re.search(r"https?:|[\"'`(]//", html + script)


def test_no_web_ui_leaves_slash_a_404():
    server = serve_story(api_key="sk-web", web_ui=False)
    try:
        key = {"Authorization": "Bearer sk-web"}
        for path in ("/", "/web/app.js"):
            r = httpx.get(server.url + path, headers=key)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
            assert httpx.get(server.url + path).status_code == 401  # no longer public either
        assert httpx.get(server.url + "/v1/models", headers=key).status_code == 200
    finally:
        server.stop()


# ---- the page in a browser ----


def test_a_reply_streams_into_the_page(page, story, llm):
    held = 48  # tokens the engine writes before it waits
    engine = story.engine.engine
    expect(page.locator("#model")).to_have_text(NAME)
    expect(page.locator("#context")).to_have_text("1,024 tokens")
    kv = f"{engine.blocks.num_pages * engine.blocks.page_size:,}"
    expect(page.locator("#capacity")).to_have_text(f"4 sequences at once, {kv} tokens of KV cache")
    question = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = client(story).chat.completions.create(model=NAME, messages=question, temperature=0)
    head = client(story).chat.completions.create(
        model=NAME, messages=question, temperature=0, max_tokens=held
    )
    text, partial = whole.choices[0].message.content, head.choices[0].message.content
    assert text.startswith(partial) and 0 < len(partial) < len(text)
    pause = llm.sampler = Pause(llm.sampler, after=held)
    settings(page, temperature="0")
    page.click("#settings summary")  # folded again
    send(page, question[0]["content"])
    reply = page.locator(".msg.assistant").last
    # held midway: the page shows the first tokens while the request is still open
    page.wait_for_function(
        "t => document.querySelector('.msg.assistant .content').textContent === t", arg=partial
    )
    expect(page.locator("body")).to_have_attribute("data-state", "streaming")
    expect(page.locator("#stop")).to_be_enabled()
    assert reply.locator(".stats").text_content() == ""
    if os.environ.get("M3LM_SCREENSHOT"):  # docs/chat-page.png: the page mid-reply
        page.screenshot(path=os.environ["M3LM_SCREENSHOT"])
    pause.go.set()
    reply_done(page)
    assert reply.locator(".content").text_content() == text
    stats = reply.locator(".stats").text_content()
    u = whole.usage
    assert f"prompt {u.prompt_tokens} tokens" in stats and f"reply {u.completion_tokens} tokens" in stats
    assert "tok/s" in stats and "finish: stop" in stats
    assert page.guard.chats == [
        {
            "model": NAME,
            "messages": question,
            "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"thinking_mode": "adaptive"},
            "temperature": 0,
        }
    ]
    # the next turn carries the conversation, and finds its earlier part cached
    send(page, "And then?")
    stats = reply_done(page).locator(".stats").text_content()
    cached = int(re.search(r"\((\d+) cached\)", stats)[1])
    assert cached > 0 and cached % engine.blocks.page_size == 0
    assert page.guard.chats[-1]["messages"] == [
        *question,
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And then?"},
    ]
    page.click("#clear")
    expect(page.locator("#conversation > li")).to_have_count(0)
    send(page, "Hi")
    reply_done(page)
    assert page.guard.chats[-1]["messages"] == [{"role": "user", "content": "Hi"}]


def test_stop_ends_a_reply_midway(page, story, llm):
    pause = llm.sampler = Pause(llm.sampler, after=8)
    settings(page, temperature="0")
    question = "Tell me about the moon."
    send(page, question)
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".content")).not_to_be_empty()
    page.click("#stop")
    expect(reply.locator(".note")).to_have_text("stopped")
    expect(page.locator("body")).to_have_attribute("data-state", "ready")
    shown = reply.locator(".content").text_content()
    # the server saw the client go while the engine was still held: the request was aborted
    wait_until(lambda: story.engine.num_active == 0, "the stopped request is still open")
    pause.go.set()
    wait_idle(story.engine, timeout=60)
    assert reply.locator(".content").text_content() == shown and reply.locator(".stats").text_content() == ""
    whole = client(story).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": question}], temperature=0
    )
    assert whole.choices[0].message.content.startswith(shown) and len(shown) < len(
        whole.choices[0].message.content
    )
    # what was shown stays in the conversation
    send(page, "Go on.")
    reply_done(page)
    assert page.guard.chats[-1]["messages"][1] == {"role": "assistant", "content": shown}


def test_a_thinking_reply_shows_its_reasoning_folded(page, story):
    settings(page, thinking="enabled", temperature="0", max_tokens="40")
    send(page, "Tell me a story about a dog.")
    reply = reply_done(page)
    expected = client(story).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Tell me a story about a dog."}],
        temperature=0,
        max_tokens=40,
        extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}},
    )
    reasoning = expected.choices[0].message.model_extra["reasoning_content"]
    assert reasoning  # the prompt ends inside <mm:think>: the story is the reasoning
    details = reply.locator("details.reasoning")
    assert details.evaluate("d => d.open") is False
    expect(details.locator(".reasoning-text")).to_be_hidden()
    assert details.locator(".reasoning-text").text_content() == reasoning
    assert reply.locator(".content").text_content() == (expected.choices[0].message.content or "")
    details.locator("summary").click()
    expect(details.locator(".reasoning-text")).to_be_visible()
    assert "reply 40 tokens" in reply.locator(".stats").text_content()
    assert page.guard.chats[-1]["chat_template_kwargs"] == {"thinking_mode": "enabled"}
    sent = page.guard.chats[-1]
    assert sent["max_tokens"] == 40 and sent["temperature"] == 0


def test_bad_input_gets_a_clear_error_and_loses_nothing(browser, story):
    page = open_page(browser, story.url)
    try:
        expect(page.locator("body")).to_have_attribute("data-state", "ready")
        settings(page, tools="[{not json")
        send(page, "Hello there")
        expect(page.locator("#error")).to_contain_text("Tools: not valid JSON")
        settings(page, tools="", temperature="5")
        page.click("#send")
        expect(page.locator("#error")).to_contain_text("Temperature: ")
        assert page.guard.chats == []  # neither reached the server
        settings(page, temperature="", tools='[{"type": "function", "function": {}}]')
        page.click("#send")  # the server refuses it: its message shows, the text goes back
        expect(page.locator("#error")).to_have_text("tools.0.function.name: Field required")
        expect(page.locator("#prompt")).to_have_value("Hello there")
        expect(page.locator("#conversation > li")).to_have_count(0)
        settings(page, tools="", max_tokens="4")
        page.click("#send")
        reply_done(page)
        assert page.locator("#error").text_content() == ""
        assert [c["messages"] for c in page.guard.chats] == [[{"role": "user", "content": "Hello there"}]] * 2
    finally:
        page.context.close()
    page.guard.check(refused=400)


def script_reply(tokenizer, *parts) -> list[int]:
    """Token ids of a reply: special-token names as themselves, other strings encoded as text."""
    special = set(tokenizer.hf.all_special_tokens) | {"]<]minimax[>[", "<tool_call>", "</tool_call>"}
    ids = []
    for part in parts:
        ids += [tokenizer.hf.convert_tokens_to_ids(part)] if part in special else tokenizer.encode(part)
    return ids


def test_a_tool_call_renders_and_its_result_goes_back(page, story, llm):
    """The call's tokens are scripted at the sampler (the story model never writes one); the
    server parses them into `tool_calls` and streams them as it does any model's."""
    ns = "]<]minimax[>["
    call = ["<tool_call>", ns, '<invoke name="get_weather">', ns, "<city>Paris", ns, "</city>"]
    call += [ns, "<days>3", ns, "</days>", ns, "</invoke>", ns, "</tool_call>"]
    tok, real = llm.tokenizer, llm.sampler
    llm.sampler = Script(
        script_reply(
            tok, "<mm:think>", "the user wants weather", "</mm:think>", "Let me look.", ns, *call, "[e~["
        )
    )
    settings(page, tools=json.dumps([GET_WEATHER]))
    send(page, "What is the weather in Paris?")
    reply_done(page)
    reply = page.locator(".msg.assistant").first
    expect(reply.locator(".stats")).to_contain_text("finish: tool_calls")
    expect(reply.locator(".tool-call .call-name")).to_have_text("get_weather(…)")
    args = reply.locator(".tool-call .call-args").text_content()
    assert args == json.dumps({"city": "Paris", "days": 3}, indent=2)
    assert reply.locator(".content").text_content() == "Let me look."
    assert reply.locator("details.reasoning").evaluate("d => d.open") is False
    assert reply.locator(".reasoning-text").text_content() == "the user wants weather"
    assert page.guard.chats[-1]["tools"] == [GET_WEATHER]
    # the result, typed by hand, goes back with the call and the model answers it
    llm.sampler = real
    reply.locator(".tool-reply textarea").fill("sunny, 21 C")
    reply.locator(".tool-reply button").click()
    expect(reply.locator(".tool-result")).to_have_text("→ sunny, 21 C")
    answer = reply_done(page)
    expect(answer.locator(".stats")).to_contain_text("finish: stop")
    history = page.guard.chats[-1]["messages"]
    made = history[1]["tool_calls"][0]
    assert made["id"].startswith("call_") and made["function"]["name"] == "get_weather"
    assert json.loads(made["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert history[1]["content"] == "Let me look."
    assert history[2] == {"role": "tool", "tool_call_id": made["id"], "content": "sunny, 21 C"}


def test_markup_shows_as_text_and_runs_nothing(browser, story, llm):
    """In a page without its CSP (the CSP alone would stop the handlers; this is the page's own
    text handling): markup from the user and from the model shows as text and runs nothing."""
    payload = "<img src=x onerror=\"window.ran.push('img');alert('img')\"><script>window.ran.push('script');alert(1)</script>"
    model_text = "<b>bold</b><img src=x onerror=\"window.ran.push('reply')\">"
    thought = "<script>window.ran.push('thought')</script>"
    llm.sampler = Script(
        script_reply(llm.tokenizer, "<mm:think>", thought, "</mm:think>", model_text, "[e~[")
    )
    page = open_page(browser, story.url, "window.ran = []", bypass_csp=True)
    try:
        expect(page.locator("body")).to_have_attribute("data-state", "ready")
        settings(page, system=payload)
        send(page, payload)
        reply = reply_done(page)
        assert page.locator(".msg.user .text").text_content() == payload
        assert reply.locator(".content").text_content() == model_text
        assert reply.locator(".reasoning-text").text_content() == thought
        assert page.locator("#conversation img, #conversation script, #conversation b").count() == 0
        assert page.evaluate("window.ran") == []
        assert not any(urlsplit(u).path == "/x" for u in page.guard.requests)
        assert page.guard.chats[-1]["messages"][0] == {"role": "system", "content": payload}
    finally:
        page.context.close()
    page.guard.check()


def test_the_page_needs_nothing_but_its_server(browser, story):
    page = open_page(browser, story.url)
    try:
        expect(page.locator("body")).to_have_attribute("data-state", "ready")
        settings(page, max_tokens="8")
        send(page, "Hello")
        reply_done(page)
        paths = {urlsplit(u).path for u in page.guard.requests}
        assert {"/", "/web/app.js", "/web/app.css", "/v1/models", "/v1/chat/completions"} <= paths
        assert {origin(u) for u in page.guard.requests} == {story.url}
    finally:
        page.context.close()
    page.guard.check()


def test_the_page_fits_a_phone(browser, story):
    page = open_page(
        browser, story.url, viewport={"width": 360, "height": 740}, is_mobile=True, has_touch=True
    )
    try:
        expect(page.locator("body")).to_have_attribute("data-state", "ready")
        settings(page, max_tokens="60")
        send(page, "Tell me a story about a very, very long and winding river.")
        reply_done(page)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        for selector in ("#prompt", "#send", "#stop", "#clear", "#temperature", "#tools", ".msg.assistant"):
            box = page.locator(selector).bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= 360, selector
    finally:
        page.context.close()
    page.guard.check()


def test_the_key_prompt_with_m3lm_serve_api_key(browser):
    key = "sk-web-page"
    proc, url = start_serve(Path(m3lm.DEFAULT_MODEL), "--api-key", key, "--max-model-len", "512")
    try:
        wait_healthy(proc, url)
        # the page's files need no key; the API does
        assert httpx.get(url + "/").status_code == httpx.get(url + "/web/app.js").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        page = open_page(browser, url)
        form = page.locator("#key-form")
        expect(form).to_be_visible()
        expect(page.locator("body")).to_have_attribute("data-state", "locked")
        expect(page.locator("#prompt")).to_be_disabled()
        page.fill("#key-input", "sk-wrong")
        page.click("#key-form button")
        expect(page.locator("#key-error")).to_have_text(
            "The server refused this key: invalid or missing API key."
        )
        expect(form).to_be_visible()
        assert page.evaluate("sessionStorage.getItem('m3lm.apiKey')") is None
        page.fill("#key-input", key)
        page.click("#key-form button")
        expect(page.locator("#model")).to_have_text("story")
        expect(form).to_be_hidden()
        assert page.evaluate("sessionStorage.getItem('m3lm.apiKey')") == key
        assert page.evaluate("localStorage.length") == 0 and page.evaluate("document.cookie") == ""
        settings(page, max_tokens="12")
        send(page, "Once upon a time")
        assert "reply 12 tokens" in reply_done(page).locator(".stats").text_content()
        page.reload()  # the tab keeps the key
        expect(page.locator("body")).to_have_attribute("data-state", "ready")
        other = page.context.new_page()  # another tab does not
        other.goto(url)
        expect(other.locator("#key-form")).to_be_visible()
        page.context.close()
        page.guard.check(refused=401)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
