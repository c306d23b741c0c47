"""The embedded story model served over real HTTP with the served settings (fp32 on the CPU),
for the tests of each API; `scripted` makes its sampler write a fixed reply (tool calls, which
the story model does not write by itself)."""

from collections.abc import Callable
from contextlib import contextmanager

import torch

import m3lm
from m3lm.config import EngineConfig
from m3lm.engine.engine import LLMEngine
from m3lm.sampler import SampleOutput
from m3lm.server.app import create_server_app
from m3lm.server.engine_client import AsyncEngine
from m3lm.server.protocol import Limits
from tests.support.live_server import API_KEY, LiveServer, Script

NAME = "story"


@contextmanager
def story_server(max_model_len: int = 256, checkpoint=m3lm.DEFAULT_MODEL):
    """A LiveServer with `.engine`, `.model` and `.tok` (`checkpoint`: a copy of the story model)."""
    model, tok = m3lm.load(checkpoint, device="cpu", dtype="float32")
    engine = AsyncEngine(
        LLMEngine(model, tok, EngineConfig(max_model_len=max_model_len, max_num_seqs=8))
    ).start()
    server = LiveServer(create_server_app(engine, tok, NAME, API_KEY, Limits()))
    server.engine, server.model, server.tok = engine, model, tok
    try:
        yield server
    finally:
        server.stop()  # its lifespan stops the engine


class PromptScript:
    """A sampler writing `reply(prompt_ids)` for each request (its last id repeated)."""

    def __init__(self, reply: Callable[[list[int]], list[int]]):
        self.reply = reply

    def __call__(self, logits, params, prompt_ids, output_ids, generators):
        replies = [self.reply(p) for p in prompt_ids]
        return SampleOutput(
            torch.tensor([r[min(len(o), len(r) - 1)] for r, o in zip(replies, output_ids, strict=True)])
        )


@contextmanager
def scripted(server, reply: list[int] | Callable[[list[int]], list[int]]):
    """Every request to `server` replies with `reply` (token ids, or a function of the prompt's)
    while this is open."""
    engine = server.engine.engine
    sampler = Script(reply) if isinstance(reply, list) else PromptScript(reply)
    sampler, engine.sampler = engine.sampler, sampler
    try:
        yield
    finally:
        engine.sampler = sampler


def tool_call_ids(tok, name: str, args: list[tuple[str, str]]) -> list[int]:
    """M3's tool-call block calling `name` with leaf arguments, as the model writes it."""
    ns = tok.hf.convert_tokens_to_ids("]<]minimax[>[")
    open_, close_ = (tok.hf.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
    pieces = [f'<invoke name="{name}">']
    for key, value in args:
        pieces += [f"<{key}>{value}", f"</{key}>"]
    pieces.append("</invoke>")
    return [ns, open_] + [t for p in pieces for t in (ns, *tok.encode(p))] + [ns, close_]


@contextmanager
def failing_after(server, n: int):
    """While this is open, each request's text fails after `n` tokens (its detokenizer raises)."""
    engine = server.engine
    real_add = engine.add

    def add(ids, params, rid=None):
        stream = real_add(ids, params, rid)
        detok, seen = stream._text.detok, []
        real = detok.add

        def flaky(token_id):
            seen.append(token_id)
            if len(seen) > n:
                raise RuntimeError("decoder exploded")
            return real(token_id)

        detok.add = flaky
        return stream

    engine.add = add
    try:
        yield
    finally:
        engine.add = real_add
