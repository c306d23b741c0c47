"""The OpenAI-compatible HTTP server: the app (its routes are `routes.py`'s, `responses.py`'s and
`anthropic.py`'s; the chat page at / is `web.py`'s), auth, limits, errors, and `serve`. Every error
is an OpenAI error object (Anthropic's on Anthropic's routes) with a truthful status. The API key
guards every route but /health and the page's files and is compared in constant time. Model
compute runs in the engine process (`m3lm.engine.engine_loop`); this one parses, tokenizes,
detokenizes and streams.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from functools import partial

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from m3lm.config import LoadSpec
from m3lm.errors import M3lmError
from m3lm.server import anthropic, responses, routes, web
from m3lm.server.asgi import ApiKeyAuth, DrainingServer, JsonErrors, RequestLimits, guarded_h11
from m3lm.server.effort import efforts_of
from m3lm.server.engine_client import AsyncEngine
from m3lm.server.handlers import ApiError, ServerState
from m3lm.server.lifecycle import bind, stop_on_signals
from m3lm.server.metrics import Metrics
from m3lm.server.protocol import (
    Limits,
    body_bound,
    error_body_for,
)
from m3lm.text.reasoning import ReplyFormat
from m3lm.version import __version__

log = logging.getLogger("m3lm.server")


def build_app(
    engine: AsyncEngine,
    tokenizer,
    model_name: str,
    limits: Limits | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    limits = limits or Limits()
    metrics = metrics or Metrics(model_name)
    fmt = None
    if tokenizer is not None:
        try:
            fmt = ReplyFormat.from_tokenizer(tokenizer.hf)
        except ValueError:
            log.info("the tokenizer has no reasoning/tool-call markers: replies are plain content")
    efforts = efforts_of(tokenizer.hf.chat_template) if tokenizer is not None else None
    state = ServerState(engine, tokenizer, model_name, limits, metrics, engine.default_params(), fmt, efforts)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        state.draining = True
        state.checks.close()
        engine.stop()

    # No trailing-slash redirects: their Location would be built from the client's Host header.
    # /openapi.json describes the API; no /docs or /redoc pages (they load their assets from a CDN)
    app = FastAPI(
        title="m3lm",
        version=__version__,
        lifespan=lifespan,
        redirect_slashes=False,
        docs_url=None,
        redoc_url=None,
    )
    app.state.m3lm = state
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    for router in (routes.router, anthropic.router, responses.router):
        app.include_router(router)
    return app


async def _api_error(request: Request, e: ApiError):
    return e.response(request.scope["path"])


async def _invalid(request: Request, e: RequestValidationError):
    """The first validation error, in the shape of the route's API."""
    error_of = partial(error_body_for, request.scope["path"])
    first = e.errors()[0] if e.errors() else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    if first.get("type") == "json_invalid":  # the location is a byte offset, not a field
        why = (first.get("ctx") or {}).get("error")
        at = first.get("loc", ())[-1:]
        where = f" ({why} at character {at[0]})" if why and at else ""
        return JSONResponse(error_of(f"the request body is not valid JSON{where}", status=400), 400)
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        # no body, or one that is not an object (or not sent as JSON)
        msg = "the request body must be a JSON object (sent with Content-Type: application/json)"
        return JSONResponse(error_of(msg, status=400), 400)
    msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
    return JSONResponse(error_of(msg, param=loc or None, status=400), 400)


async def _http_error(request: Request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    body = error_body_for(request.scope["path"], str(e.detail), kind, status=e.status_code)
    return JSONResponse(body, e.status_code, headers=e.headers)


async def _internal(request: Request, e: Exception):
    log.exception("internal error")
    message = f"internal error: {type(e).__name__}"
    return JSONResponse(error_body_for(request.scope["path"], message, "internal_error", status=500), 500)


def create_server_app(
    engine: AsyncEngine,
    tokenizer,
    model_name: str,
    api_key: str | Sequence[str] | None,
    limits: Limits,
    cache_salt_by_api_key: bool = False,
    web_ui: bool = True,
):
    """The ASGI app as served: JSON for any fault, the key checked on the headers, then the size
    and time limits, then the FastAPI app. With `cache_salt_by_api_key` each key's requests share
    cached pages only among themselves. `web_ui`: the chat page at / (its files need no key; its
    API calls do)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if cache_salt_by_api_key and not keys:
        raise ValueError("cache_salt_by_api_key needs API keys")
    metrics = Metrics(model_name)
    engine.metrics = metrics
    app = build_app(engine, tokenizer, model_name, limits, metrics)
    state = app.state.m3lm
    state.salt_by_tenant = cache_salt_by_api_key
    state.keys_share = len(keys) > 1  # each key's requests bounded to a share of the queue
    if web_ui:
        web.add_web_ui(app)
    # Without a tokenizer prompts are token ids: 24 bytes of JSON each at most, as 2 characters are.
    chars = tokenizer.max_token_chars if tokenizer is not None else 2
    bound = body_bound(limits, state.max_prompt_tokens, chars)
    # no key: liveness, the chat page's files and the tokenizer's public facts (lm-eval reads them
    # before it sends a key); /metrics keeps the key (Prometheus sends it as a bearer token)
    public = {"/health", "/tokenizer_info", *(web.PATHS if web_ui else ())}
    guarded = RequestLimits(app, bound, limits.max_header_bytes, limits.body_timeout_s, public)
    return JsonErrors(ApiKeyAuth(guarded, keys, public) if keys else guarded)


def server_config(app, limits: Limits, grace_s: float, **kwargs) -> uvicorn.Config:
    """uvicorn's settings as served: connection caps and timeouts from `limits`."""
    return uvicorn.Config(
        app,
        http=guarded_h11(limits),
        timeout_keep_alive=limits.idle_timeout_s,
        timeout_graceful_shutdown=grace_s,
        # unfinished headers are held up to the header bound and room for the request line (h11
        # refuses more itself with a 431); RequestLimits answers a 431 past the bound
        h11_max_incomplete_event_size=limits.max_header_bytes + (8 << 10),
        ws="none",  # no WebSocket route: an upgrade request is an HTTP request like the rest
        log_config=None,  # uvicorn's lines in the server's own format (its loggers reach the root's)
        **kwargs,
    )


def room_for_connections(limits: Limits) -> Limits:
    """`limits` once this process may open enough files for its connection cap: the soft limit
    is raised as far as the hard one allows, and the cap lowered to what is left if that is not
    enough (a listener out of descriptors stops accepting anyone)."""
    import resource

    reserve = 256  # the listener, the engine's sockets, model and log files
    need = limits.max_connections + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(soft - reserve, 16)
        log.warning("at most %d open files: the connection cap is lowered to %d", soft, cap)
        limits = replace(limits, max_connections=cap)
    return limits


def draining_server(config: uvicorn.Config, app, grace_s: float) -> DrainingServer:
    """The server of `app` (from `create_server_app`), draining on SIGTERM."""
    inner = app
    while not isinstance(inner, FastAPI):
        inner = inner.app
    state: ServerState = inner.state.m3lm

    def start_drain(signal_name: str) -> None:
        state.draining = True
        log.info(
            "%s: draining %d open request(s) for up to %g s", signal_name, state.engine.num_active, grace_s
        )

    return DrainingServer(
        config,
        grace_s,
        start_drain,
        lambda: state.engine.num_active,
        lambda: state.engine.interrupt_all("the server is shutting down"),
    )


def serve(
    load: LoadSpec,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | Sequence[str] | None = None,
    served_model_name: str | None = None,
    grace_s: float = 30.0,
    limits: Limits | None = None,
    cache_salt_by_api_key: bool = False,
    threads: int | None = None,
    web_ui: bool = True,
    **engine_kwargs,
) -> None:
    """Start the engine process (it loads `load`'s model), then run uvicorn until SIGINT/SIGTERM.

    This process serves HTTP and turns ids into text; the engine process schedules and runs the
    model (and, under tensor parallelism, drives the other ranks). Under torchrun rank 0 is the
    engine already, so its loop runs on a thread here and the other ranks follow. `threads`:
    torch's CPU threads in the process that runs the model (`m3lm.threads`); `web_ui`: the chat
    page at /; `engine_kwargs`: EngineConfig fields.
    """
    from m3lm.config import EngineConfig
    from m3lm.device import resolve_device, under_torchrun
    from m3lm.model_dir import check_dir

    limits = room_for_connections(limits or Limits())
    name = served_model_name or str(load.model_dir).rstrip("/").rsplit("/", 1)[-1]
    load.check(under_torchrun())
    resolve_device(load.device)  # a device this machine lacks is refused before anything starts
    if under_torchrun():
        # rank 0 holds the port from the start; the other ranks follow its steps and serve nothing
        sock = bind(host, port) if os.environ.get("RANK", "0") == "0" else None
        from m3lm.engine.engine import LLMEngine  # this process is the engine too: rank 0
        from m3lm.engine.launch import load_for_engine

        with stop_on_signals(), _closed_on_error(sock):
            loaded = load_for_engine(load)
        if loaded is None:  # a follower rank: rank 0 has stopped
            return
        model, tokenizer, group = loaded
        try:
            llm_engine = LLMEngine(model, tokenizer, EngineConfig(**engine_kwargs))
            engine = AsyncEngine(
                llm_engine, limits.max_queue, cpu_threads=threads, timeout_s=limits.engine_timeout_s
            )
            _serve(
                engine,
                tokenizer,
                sock,
                name,
                host,
                port,
                grace_s,
                limits,
                api_key,
                cache_salt_by_api_key,
                web_ui,
            )
        finally:
            group.shutdown()
        return
    check_dir(load.model_dir)
    EngineConfig(**engine_kwargs)  # a bad setting is refused here, before the engine starts
    sock = bind(host, port)
    with _closed_on_error(sock), stop_on_signals():
        engine, tokenizer = _spawn_engine(load, limits, threads, engine_kwargs)
    _serve(engine, tokenizer, sock, name, host, port, grace_s, limits, api_key, cache_salt_by_api_key, web_ui)


def start_app(
    load: LoadSpec,
    api_key: str | Sequence[str] | None = None,
    served_model_name: str | None = None,
    limits: Limits | None = None,
    cache_salt_by_api_key: bool = False,
    threads: int | None = None,
    web_ui: bool = True,
    grace_s: float = 30.0,
    **engine_kwargs,
) -> tuple[object, AsyncEngine]:
    """`serve`'s ASGI app and its engine process, started and ready, for a host that runs the app
    itself (a Ray Serve replica, `m3lm/serve_ray.py`): no socket, no uvicorn, no signal handlers.
    `grace_s` is the host's to honour; the caller stops the engine."""
    load.check(False)
    limits = limits or Limits()
    engine, tokenizer = _spawn_engine(load, limits, threads, engine_kwargs)
    engine.start()
    name = served_model_name or str(load.model_dir).rstrip("/").rsplit("/", 1)[-1]
    return create_server_app(engine, tokenizer, name, api_key, limits, cache_salt_by_api_key, web_ui), engine


def _spawn_engine(load: LoadSpec, limits: Limits, threads: int | None, engine_kwargs: dict):
    """(an AsyncEngine whose process loads `load`'s model once started, the tokenizer or None)."""
    from m3lm.model_dir import check_dir
    from m3lm.tokenizer import load_tokenizer
    from m3lm.wire import EngineSpec

    path = check_dir(load.model_dir)
    tokenizer = None if load.skip_tokenizer_init else load_tokenizer(path)
    spec = EngineSpec(
        replace(load, model_dir=str(path)),
        engine_kwargs,
        tuple(sorted(tokenizer.eos_token_ids)) if tokenizer is not None else (),
        logging.getLogger().getEffectiveLevel(),
        threads,
    )
    return AsyncEngine.spawn(spec, tokenizer, limits.max_queue, limits.engine_timeout_s), tokenizer


@contextmanager
def _closed_on_error(sock):
    try:
        yield
    except BaseException:
        if sock is not None:
            sock.close()
        raise


def _serve(
    engine: AsyncEngine, tokenizer, sock, name, host, port, grace_s, limits, api_key, salt_by_key, web_ui
):
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    log.info("bound %s; it answers once the model is loaded", url)
    try:
        with stop_on_signals():  # until uvicorn handles the signals, they stop the start-up at once
            engine.start()
        app = create_server_app(engine, tokenizer, name, api_key, limits, salt_by_key, web_ui)
        # (the engine process has logged its summary; this process adds what it knows)
        log.info(
            "serving %s on %s%s; warm-up %.1f s",
            name,
            url,
            " (chat page at /)" if web_ui else "",
            engine.info.warmup_s,
        )
        # Streams still open when the drain ends get their error event; the rest of the grace is for that.
        config = server_config(app, limits, grace_s=5.0, host=host, port=port, log_level="info")
        server = draining_server(config, app, grace_s)
        engine.on_dead = lambda _: setattr(server, "should_exit", True)
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        # the engine must be idle before the followers are told to stop; one that has not
        # answered Ready yet has nothing to finish and is killed at once
        engine.stop(timeout=10.0 if engine.info is not None else 0.0)
        if sock is not None:
            sock.close()
    if engine.error is not None:
        raise M3lmError(f"the engine stopped: {engine.error}")
