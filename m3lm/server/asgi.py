"""The connection side of the server: what guards it before a route runs, and how it stops.

From the socket in: `guarded_h11` closes connections whose request headers do not arrive in time
and answers malformed requests with an OpenAI error object; `ApiKeyAuth` refuses a request on its
headers, before any body is read; `RequestLimits` bounds header and body sizes and the time a body
may take. `DrainingServer` turns SIGTERM into a drain: /health and new requests get 503 while the
open ones finish, and whatever is still open at the deadline is ended with an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import signal
import time
from collections.abc import Callable, Collection, Sequence

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from m3lm.server.protocol import error_body

log = logging.getLogger("m3lm.server")


async def send_error(send, status: int, message: str, type_: str = "invalid_request_error") -> None:
    body = json.dumps(error_body(message, type_, code=status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyAuth:
    """Pure ASGI: every path but the `public` ones needs `Authorization: Bearer <key>` for one of
    `api_keys` (each compared in constant time). The request's `state.tenant` is then a digest of
    its key.

    Pure ASGI rather than an HTTP middleware so that the app keeps the real `receive`, through which
    a handler learns that its client has gone.
    """

    def __init__(self, app, api_keys: Sequence[str], public: Collection[str] = ("/health",)):
        assert api_keys, "no API key"
        self.app, self.public = app, frozenset(public)
        self.keys = [(f"Bearer {k}".encode(), hashlib.sha256(k.encode()).hexdigest()) for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.public:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            tenant = None
            for expected, digest in self.keys:  # every key is compared: the time says nothing of which
                if hmac.compare_digest(given, expected):
                    tenant = digest
            if tenant is None:
                return await send_error(send, 401, "invalid or missing API key", "authentication_error")
            scope.setdefault("state", {})["tenant"] = tenant
        return await self.app(scope, receive, send)


class RequestLimits:
    """Pure ASGI: headers over `header_limit` bytes get 431, bodies over `limit` get 413, and a body
    that has not fully arrived `body_timeout_s` after the headers gets 408.

    The body is read (at most `limit` bytes) before the app sees the request.
    """

    def __init__(self, app, limit: int, header_limit: int, body_timeout_s: float):
        self.app, self.limit, self.header_limit, self.body_timeout_s = (
            app,
            limit,
            header_limit,
            body_timeout_s,
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope.get("headers") or []
        if sum(len(k) + len(v) + 4 for k, v in raw) > self.header_limit:
            return await send_error(send, 431, f"request headers over {self.header_limit} bytes")
        length = dict(raw).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await send_error(send, 413, f"request body over {self.limit} bytes")
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            return await send_error(
                send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s"
            )
        if body is None:  # the client went away
            return None
        if len(body) > self.limit:
            return await send_error(send, 413, f"request body over {self.limit} bytes")
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


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take over `header_timeout_s`
    (from its opening, or from the first byte of a later request on it), and answering a request that
    is not HTTP with an OpenAI error object rather than plain text."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # a request begun, its headers not yet whole
                if self._header_timer is None:
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"malformed HTTP request: {msg}", code=400)).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return GuardedH11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM or Ctrl-C (SIGINT) drains: `start_drain(signal name)` is called
    (the app then answers /health and new requests with 503) and the server keeps listening until
    `open_requests()` is 0 or `grace_s` has passed; then `end_open()` ends what is still open, and
    the server shuts down. A second signal ends what is open and stops at once. Nothing is
    re-raised afterwards: the process exits normally (status 0)."""

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
        if self.drain_deadline is None and not self.should_exit:
            self.drain_deadline = time.monotonic() + self.grace_s
            self.start_drain(signal.Signals(sig).name)
            return
        if self.open_requests():
            self.end_open()  # their streams get an error event and [DONE], and end now
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
