"""Ray Serve: replicas of `m3lm serve` behind one OpenAI endpoint, placed by Ray's prefix-aware router.

    pip install 'm3lm[ray]'
    serve run m3lm.serve_ray:build num_replicas=2 serve_args="--model DIR --tensor-parallel-size 8"

Two deployments. `Replica` (one per model copy) runs `m3lm serve`'s own ASGI app and engine process
in the replica and answers requests forwarded to it. `Ingress` (the HTTP route) reads each request
whole, names the text whose prefix the engine caches, and forwards it through a handle whose
router is Ray's `PrefixCacheAffinityRouter`: a request goes to the replica that served the longest
prefix of its text, or, with no such replica, to the one that has been sent the least text.

Ray Serve LLM's own deployment (`LLMServer`) is not used: its request and response types are
vLLM's or SGLang's, and it will not import without one of them installed. Its router needs only
an argument with a `prompt` attribute, which `Forwarded` is.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from m3lm.server.protocol import ANTHROPIC_PATH, error_body_for

# Ray's router by its defining module: the public re-export (ray.serve.llm.request_router) sits in
# a package that imports vLLM. The module moves between Ray's releases, hence the exact pin.
PREFIX_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
)
REPLICA_HEADER = "x-m3lm-replica"  # which replica answered: its Ray Serve replica id
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}


@dataclass
class Forwarded:
    """One HTTP request as the ingress forwards it. `prompt` is what the router matches prefixes on."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    client: tuple[str, int] | None
    prompt: str


def routing_text(path: str, body: bytes) -> str:
    """The text a request's prompt starts with, in order (system, messages, prompt), for the
    router's prefix match; the path for a request without one (the router needs some text)."""
    try:
        req = json.loads(body) if body else {}
    except ValueError:
        req = {}
    if not isinstance(req, dict):
        req = {}
    return _text([req.get(k) for k in ("system", "instructions", "messages", "input", "prompt")]) or path


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, int):  # a prompt of token ids
        return f"{value} "
    if isinstance(value, dict):
        return _text(value.get("text")) + _text(value.get("content"))
    return ""


def stream_error(path: str, message: str) -> bytes:
    """An error event in the stream's own API, ending a stream a replica could not finish."""
    if path == ANTHROPIC_PATH:
        body = json.dumps(error_body_for(path, message, "service_unavailable", status=503))
        return f"event: error\ndata: {body}\n\n".encode()
    if path == "/v1/responses":
        body = json.dumps({"type": "error", "code": "server_error", "message": message})
        return f"event: error\ndata: {body}\n\n".encode()
    body = json.dumps(error_body_for(path, message, "service_unavailable", status=503))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class Replica:
    """`m3lm serve`'s app and engine in one Ray Serve replica, given `m3lm serve`'s flags."""

    def __init__(self, serve_args: list[str]):
        from m3lm.cli import build_parser, serve_settings
        from m3lm.server.app import start_app

        args = build_parser().parse_args(["serve", *serve_args])
        self.app, self.engine = start_app(**serve_settings(args))
        self.name = serve.get_replica_context().replica_id.to_full_id_str()

    async def forward(self, req: Forwarded) -> AsyncIterator:
        """The app's answer to `req`: (status, headers) first, then the body's pieces as it sends them."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},  # spec 2.0: Starlette listens for the hang-up while it streams
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.path.encode(),
            "query_string": req.query.encode("latin-1"),
            "root_path": "",
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in req.headers],
            "client": req.client,
            "server": None,
        }
        gone = asyncio.Event()
        sent = False
        messages: asyncio.Queue = asyncio.Queue()

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()  # set when the ingress stops reading: the client has gone
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(scope, receive, messages.put)
            finally:
                messages.put_nowait(None)

        task = asyncio.ensure_future(run())
        try:
            while (msg := await messages.get()) is not None:
                if msg["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", ())]
                    yield msg["status"], [*headers, (REPLICA_HEADER, self.name)]
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body", False):
                        break
            await task
        finally:
            gone.set()

    def check_health(self) -> None:
        """Ray replaces a replica whose engine stopped or stalled (what /health turns 503 on)."""
        if self.engine.health_error is not None:
            raise RuntimeError(self.engine.health_error)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


class Ingress:
    """The HTTP route: every request read whole, forwarded to the replica the router picks, its
    answer streamed back. A replica lost before it answers is a 503; lost mid-stream, an error
    event ends the stream."""

    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request: Request):
        body = await request.body()
        path = request.url.path
        fwd = Forwarded(
            request.method,
            path,
            request.url.query,
            [(k, v) for k, v in request.headers.items() if k not in _HOP_BY_HOP],
            body,
            (request.client.host, request.client.port) if request.client else None,
            routing_text(path, body),
        )
        answer = self.replicas.forward.remote(fwd)
        try:
            status, headers = await answer.__anext__()
        except (RayError, StopAsyncIteration) as e:
            answer.cancel()
            message = f"the replica serving this request was lost ({type(e).__name__}); retry"
            return JSONResponse(error_body_for(path, message, "service_unavailable", status=503), 503)
        headers = {k: v for k, v in headers if k.lower() not in _HOP_BY_HOP}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._rest(answer, path, sse), status, headers)

    async def _rest(self, answer, path: str, sse: bool) -> AsyncIterator[bytes]:
        try:
            async for piece in answer:
                yield piece
        except RayError as e:
            if not sse:
                raise  # a body cut short: the client's read fails
            yield stream_error(path, f"the replica serving this stream was lost ({type(e).__name__})")
        finally:
            answer.cancel()  # the client hung up (or all is read): the replica's request ends


def build(args: dict) -> serve.Application:
    """The application `serve run m3lm.serve_ray:build KEY=VALUE ...` deploys. Keys:
    `serve_args`: `m3lm serve`'s flags for every replica (one string; --host and --port are Ray's);
    `num_replicas` (2); `num_cpus` per replica (1); `num_gpus` per replica (default
    --tensor-parallel-size, 0 with --device cpu); `imbalanced_threshold`: the router places by
    prefix while the replicas' queues differ by at most this many requests, else by load
    (default: always by prefix)."""
    from m3lm.cli import build_parser

    unknown = set(args) - {"serve_args", "num_replicas", "num_cpus", "num_gpus", "imbalanced_threshold"}
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    serve_args = shlex.split(str(args.get("serve_args", "")))
    flags = build_parser().parse_args(["serve", *serve_args])  # a bad flag fails here, not in every replica
    gpus = float(args.get("num_gpus", 0 if flags.device == "cpu" else flags.tensor_parallel_size))
    router = {"imbalanced_threshold": float(args.get("imbalanced_threshold", "inf"))}
    replica = serve.deployment(
        Replica,
        num_replicas=int(args.get("num_replicas", 2)),
        ray_actor_options={"num_cpus": float(args.get("num_cpus", 1)), "num_gpus": gpus},
        max_ongoing_requests=flags.max_queue,  # m3lm admits or refuses (503) on its own
        graceful_shutdown_timeout_s=flags.drain_timeout,
        health_check_period_s=5,
        request_router_config=RequestRouterConfig(
            request_router_class=PREFIX_ROUTER, request_router_kwargs=router
        ),
    )
    ingress = serve.deployment(Ingress, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    return ingress.bind(replica.bind(serve_args))
