"""One reply's life after admission, the same for the four APIs: its engine outputs read in
arrival order, a stop string's end, keep-alives, the reply streamed or collected, and its `Slots`
released on every way out. Each API is a writer of its own wire format:

- `opening()` -> SSE bytes sent before any output (chat's role deltas, Responses' `created`);
- `chunks(choice, out, events)` -> the SSE bytes of one engine output of a choice (`events`: its
  typed reply events, `Choice.events`); a coroutine, for what it builds off the event loop;
- `keepalive()` -> the bytes sent after `keepalive_s` without output;
- `closing(choices)` -> the last SSE bytes (usage, stop reasons, OpenAI's `[DONE]`);
- `failed(error)` -> the SSE bytes of a failure after the headers (an `ApiError`);
- `take(choice, events)`: a whole reply's events (Anthropic's blocks, Responses' items);
- `whole(choices)` -> the whole reply as JSON, built on the replies' threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from m3lm.core import StepOutput
from m3lm.server.choice import Choice, token_logprobs
from m3lm.server.engine_client import EngineDead, Interrupted, RequestStream
from m3lm.server.handlers import ApiError, ServerState, Slots
from m3lm.text.reasoning import ReplyEvent

log = logging.getLogger("m3lm.server")


async def answer(
    state: ServerState, request: Request, slots: Slots, choices: list[Choice], writer, stream: bool
):
    """The reply of admitted `slots` (one `Choice` each) in `writer`'s format: an SSE stream that
    owns the slots from here, or the whole reply once every choice has finished. The slots are
    released however this ends (an error, the client gone, a cancelled handler)."""
    try:
        if stream:
            return _OwningStream(_events(state, writer, slots.streams, choices), slots)
        try:
            await collect_unless_gone(request, _collect(state, writer, slots.streams, choices))
        finally:
            slots.release()
        return await state.json_reply(writer.whole, choices)
    except BaseException:
        slots.release()
        raise


async def outputs(
    streams: list[RequestStream], choices: list[Choice], tick: float | None = None
) -> AsyncIterator[tuple[Choice, StepOutput, list[ReplyEvent]] | None]:
    """Each engine output of the admitted choices as (choice, output, its typed reply events), in
    arrival order; None every `tick` seconds without output (the keep-alives). A stop string a
    choice's text reaches ends its engine request here. The engine's failures are ApiErrors;
    choices the streams left unfinished end "abort"."""
    merged = merge(streams, tick)
    try:
        async for item in merged:
            if item is None:
                yield None
                continue
            i, out = item
            c = choices[i]
            if c.finish is not None:
                continue
            check_output(out)
            events = c.events(out)
            if c.stopped_by_string:
                streams[i].abort(completed=True)
            yield c, out, events
    except EngineDead as e:
        raise ApiError(500, f"the engine stopped: {e}", "internal_error") from None
    except Interrupted as e:  # stalled, or the server is shutting down
        raise ApiError(503, str(e), "service_unavailable") from None
    finally:
        await merged.aclose()
    for c in choices:
        c.finish = c.finish or "abort"


async def _events(state: ServerState, writer, streams: list[RequestStream], choices: list[Choice]):
    """The SSE body: a failure after the headers is the writer's error event, never a cut."""
    events = outputs(streams, choices, state.limits.keepalive_s)
    try:
        for data in writer.opening():
            yield data
        async for item in events:
            if item is None:
                yield writer.keepalive()
                continue
            for data in await writer.chunks(*item):
                yield data
        for data in writer.closing(choices):
            yield data
    except Exception as e:  # an ApiError, or a fault of ours: the client still hears why
        if not isinstance(e, ApiError):
            log.exception("a stream failed")
            e = ApiError(500, f"internal error: {type(e).__name__}", "internal_error")
        for data in writer.failed(e):
            yield data
    finally:
        await events.aclose()


async def _collect(state: ServerState, writer, streams: list[RequestStream], choices: list[Choice]) -> None:
    """A whole reply's outputs into its choices (their logprobs too) and the writer."""
    async for c, out, events in outputs(streams, choices):  # type: ignore[misc]  # no tick: never None
        if state.tokenizer is not None and out.new_logprobs:
            c.logprobs += token_logprobs(state.tokenizer, out)
        c.prompt_logprobs = c.prompt_logprobs or out.prompt_logprobs
        writer.take(c, events)


def merge(
    streams: list[RequestStream], tick: float | None = None
) -> AsyncIterator[tuple[int, StepOutput] | None]:
    """Outputs of several streams as (index, output), in arrival order (their `Slots` free them).

    With `tick`, None comes after every `tick` seconds without an output (for keep-alives); waiting
    is never what ends a stream: a queued or slow request keeps its place.
    """
    # one stream, the common case, without a task and a queue between
    return _one(streams[0], tick) if len(streams) == 1 else _many(streams, tick)


async def _one(stream: RequestStream, tick: float | None) -> AsyncIterator[tuple[int, StepOutput] | None]:
    while True:
        try:
            out = await stream.next(tick)
        except StopAsyncIteration:
            return
        yield None if out is None else (0, out)


async def _many(
    streams: list[RequestStream], tick: float | None
) -> AsyncIterator[tuple[int, StepOutput] | None]:
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
        except BaseException as e:
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            try:
                i, item = await asyncio.wait_for(q.get(), tick)
            except TimeoutError:
                yield None
                continue
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def check_output(out: StepOutput) -> None:
    if out.finish_reason == "error":
        detail = out.error or "unknown error"
        if detail.startswith("structured output:"):  # the request's grammar, not the server
            raise ApiError(400, detail)
        raise ApiError(500, f"generation failed: {detail}", "internal_error")


async def collect_unless_gone(request: Request, collect) -> None:
    """Run `collect` unless the client disconnects first (the caller then releases the slots)."""
    task = asyncio.ensure_future(collect)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled
        gone.cancel()
        left = not task.done()
        if left:
            task.cancel()
    if left:
        raise ApiError(499, "client disconnected")
    task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already, so only a disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _OwningStream(StreamingResponse):
    """A streamed reply that releases its request's slots however the sending ends."""

    def __init__(self, content, slots: Slots):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.slots = slots

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slots.release()
