"""The connection side of the server: what guards it before a route runs, and how it stops.

From the socket in: `guarded_h11` gives every phase of a connection a deadline, keeps idle
sockets from locking clients out, and answers malformed requests with an OpenAI error object;
`ApiKeyAuth` refuses a request on its headers, before any body is read; `RequestLimits` bounds
header and body sizes and the time a body may take. `DrainingServer` turns SIGTERM into a drain: /health and new requests get 503 while the
open ones finish, and whatever is still open at the deadline is ended with an error.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Collection, Sequence

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from m3lm.server.protocol import Limits, error_body, error_body_for

log = logging.getLogger("m3lm.server")


async def send_error(
    send, status: int, message: str, type_: str = "invalid_request_error", extra_headers=(), path: str = ""
) -> None:
    """An error response before the app answers, in the shape of the API `path` belongs to."""
    body = json.dumps(error_body_for(path, message, type_, status=status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += extra_headers
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class JsonErrors:
    """Pure ASGI, outermost: a fault anywhere below that escapes before a response has started is
    answered with an OpenAI error object (uvicorn would send plain text); after it has started,
    the connection is closed as uvicorn does."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started:
                raise
            log.exception("internal error")
            message = f"internal error: {type(e).__name__}"
            await send_error(send, 500, message, "internal_error", path=scope["path"])


class ApiKeyAuth:
    """Pure ASGI: every path but the `public` ones needs `Authorization: Bearer <key>` or (as
    Anthropic's clients send it) `x-api-key: <key>` for one of `api_keys`, each compared in
    constant time. The request's `state.tenant` is then a digest of its key.

    Pure ASGI rather than an HTTP middleware so that the app keeps the real `receive`, through which
    a handler learns that its client has gone.
    """

    def __init__(self, app, api_keys: Sequence[str], public: Collection[str] = ("/health",)):
        assert api_keys, "no API key"
        self.app, self.public = app, frozenset(public)
        self.keys = [
            (f"Bearer {k}".encode(), k.encode(), hashlib.sha256(k.encode()).hexdigest()) for k in api_keys
        ]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.public:
            headers = dict(scope.get("headers") or [])
            bearer, key = headers.get(b"authorization", b""), headers.get(b"x-api-key")
            tenant = None
            for expected_bearer, expected_key, digest in self.keys:
                # every key and both headers are compared: the time says nothing of which matched
                by_bearer = hmac.compare_digest(bearer, expected_bearer)
                by_key = key is not None and hmac.compare_digest(key, expected_key)
                if by_bearer or by_key:
                    tenant = digest
            if tenant is None:
                message = "invalid or missing API key"
                return await send_error(send, 401, message, "authentication_error", path=scope["path"])
            scope.setdefault("state", {})["tenant"] = tenant
        return await self.app(scope, receive, send)


class RequestLimits:
    """Pure ASGI: headers over `header_limit` bytes get 431, bodies over `limit` get 413, and a body
    that has not fully arrived `body_timeout_s` after the headers gets 408. The `public` paths
    (those served without a key) take no body: a request announcing one gets a 413 at once, before
    any of it is read, and its connection closes.

    The body is read (at most `limit` bytes) before the app sees the request.
    """

    def __init__(
        self, app, limit: int, header_limit: int, body_timeout_s: float, public: Collection[str] = ()
    ):
        self.app, self.limit, self.header_limit, self.body_timeout_s = (
            app,
            limit,
            header_limit,
            body_timeout_s,
        )
        self.public = frozenset(public)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope.get("headers") or []
        if sum(len(k) + len(v) + 4 for k, v in raw) > self.header_limit:
            message = f"request headers over {self.header_limit} bytes"
            return await send_error(send, 431, message, path=scope["path"])
        headers = dict(raw)
        if scope["path"] in self.public and (
            headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        ):
            message = f"{scope['path']} takes no request body"
            return await send_error(
                send, 413, message, extra_headers=[(b"connection", b"close")], path=scope["path"]
            )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await send_error(send, 413, f"request body over {self.limit} bytes", path=scope["path"])
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            message = f"the request body did not arrive within {self.body_timeout_s:g} s"
            return await send_error(send, 408, message, path=scope["path"])
        if body is None:  # the client went away
            return None
        if len(body) > self.limit:
            return await send_error(send, 413, f"request body over {self.limit} bytes", path=scope["path"])
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _read_body(self, receive) -> bytes | None:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
            if size > self.limit:
                break  # refused by the caller; the rest is never read
            more = message.get("more_body", False)
        return b"".join(chunks)


LINGER_S = 2.0  # how long the unread body of an answered request is drained before closing


def guarded_h11(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on every phase of a connection, whatever its
    requests' fate, and OpenAI error objects for what it refuses itself.

    - Headers: a connection whose request headers take over `limits.header_timeout_s` (from its
      opening, or from the first byte of a later request on it) is closed. The body has its own
      deadline in `RequestLimits` (408).
    - After a response: a connection whose request body was never read (a 401, 408 or 413 sent
      before the body came) is closed within `LINGER_S`, so a client trickling bytes into it holds
      nothing. Idle keep-alive connections close after uvicorn's `timeout_keep_alive`.
    - Writing: a client that reads nothing of a response for `limits.write_timeout_s` is cut off.
    - Beyond `limits.max_connections`, a new connection closes the one that has waited longest
      without a request under way (idle sockets cannot lock clients out); only when every
      connection has a request under way is the newcomer refused, with a JSON 503.
    - A request that is not HTTP gets a JSON 400, one whose headers outgrow h11's buffer a 431.
    """
    attrs = {"limits": limits, "waiting": collections.OrderedDict(), "dropped": set()}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attrs)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every phase of a connection (`guarded_h11`)."""

    limits: Limits
    # The connections waiting for a request (or lingering), the one waiting longest first; and
    # those closed to make room whose loss the event loop has not reported yet (one server's).
    waiting: collections.OrderedDict[H11Protocol, None]
    dropped: set[H11Protocol]
    _header_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _lingering = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.waiting[self] = None
        self._arm()
        if (
            len(self.connections) - len(self.dropped) > self.limits.max_connections
            and not self._drop_longest_waiting()
        ):
            log.warning("over %d connections, all busy: a new one is refused", self.limits.max_connections)
            self.app = _too_many_connections

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the rest of a body nobody reads
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request begun, its headers not yet whole
            if self._header_timer is None:
                self._arm()
        else:
            self._disarm()
            self.waiting.pop(self, None)

    def on_response_complete(self) -> None:
        unread = self.conn.their_state is h11.SEND_BODY  # (the next cycle may start below)
        super().on_response_complete()
        if unread and not self.transport.is_closing():
            self._linger()
        elif self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.waiting[self] = None  # kept alive, waiting from now on

    def _linger(self) -> None:
        """End a connection whose request was answered before it was all read. Closing at once,
        with its bytes unread, would reset the connection and could destroy the answer before
        the client reads it; so the answer is followed by an end of stream, what still comes is
        read and dropped for `LINGER_S` seconds, and then the connection is closed whatever the
        client does."""
        self._lingering = True
        self.waiting[self] = None
        self.waiting.move_to_end(self, last=False)  # worth nothing: the first to go
        try:
            self.transport.write_eof()
        except OSError:  # the client has gone already
            self.transport.close()
            return
        self.loop.call_later(LINGER_S, self.transport.close)

    def connection_lost(self, exc) -> None:
        self.waiting.pop(self, None)
        self.dropped.discard(self)
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._not_reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _not_reading(self) -> None:
        self._write_timer = None
        self.transport.abort()  # close() would wait for the unread bytes to be flushed

    def _drop_longest_waiting(self) -> bool:
        victim = next((c for c in self.waiting if c is not self), None)
        if victim is None:
            return False
        del self.waiting[victim]
        self.dropped.add(victim)
        victim.transport.close()
        return True

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this from its `except h11.RemoteProtocolError`, so the error is at hand.
        status = getattr(sys.exc_info()[1], "error_status_hint", 400)
        if status == 431:
            text = "request headers too large"
        else:
            status, text = 400, f"malformed HTTP request: {msg}"
        body = json.dumps(error_body(text, status=status)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=status, headers=headers, reason=_REASONS[status]),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self._linger()


_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


async def _too_many_connections(scope, receive, send) -> None:
    await send_error(
        send,
        503,
        "the server has too many open connections; retry later",
        "service_unavailable",
        [(b"retry-after", b"1"), (b"connection", b"close")],
        path=scope.get("path", ""),
    )


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM or Ctrl-C (SIGINT) drains: `start_drain(signal name)` is called
    (the app then answers /health and new requests with 503) and the server keeps listening until
    `open_requests()` is 0 or `grace_s` has passed; then `end_open()` ends what is still open, and
    the server shuts down. A second signal ends what is open at once (with its error: streams get
    their error event and [DONE], whole replies a JSON 503) and shuts down; a signal after that
    forces the exit, as uvicorn does. The process then exits normally (status 0)."""

    def __init__(
        self,
        config: uvicorn.Config,
        grace_s: float,
        start_drain: Callable[[str], None],
        open_requests: Callable[[], int],
        end_open: Callable[[], None],
    ):
        super().__init__(config)
        self.grace_s, self.start_drain, self.open_requests, self.end_open = (
            grace_s,
            start_drain,
            open_requests,
            end_open,
        )
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # stopping already: a further signal forces it, as in uvicorn
            return super().handle_exit(sig, frame)
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.grace_s
            self.start_drain(signal.Signals(sig).name)
            return
        # A second signal: stop now, but end what is open with an error first.
        log.warning("stopping now: ending %d open request(s)", self.open_requests())
        self.end_open()
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            open_now = self.open_requests()
            if open_now and time.monotonic() >= self.drain_deadline:
                log.warning("grace period over: ending %d open request(s)", open_now)
                self.end_open()
                open_now = 0
            if not open_now:
                self.should_exit = True
        return await super().on_tick(counter)
