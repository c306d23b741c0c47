"""The OpenAI API's routes and the server's own: /v1/chat/completions, /v1/completions,
/v1/models[/{id}], /health, /metrics, /tokenize, /detokenize, /tokenizer_info. Each reads the
app's `ServerState` from the request; the Responses and Anthropic routes are their modules'."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from m3lm.server.chat_completions import chat_completion
from m3lm.server.completions import completion
from m3lm.server.handlers import ApiError, ServerState, served
from m3lm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    documented_errors,
)
from m3lm.text.schema_values import template_messages

COMMON = documented_errors(400, 401, 404, 413, 422, 431, 500, 503)
GENERATION = {
    **COMMON,
    200: {
        "content": {"application/json": {}, "text/event-stream": {}},
        "description": "a reply or an SSE stream",
    },
}

router = APIRouter()


def state_of(request: Request) -> ServerState:
    return request.app.state.m3lm


@router.get("/health", responses={503: {"description": "draining, failed or not answering"}})
async def health(request: Request):
    state = state_of(request)
    error = "the server is shutting down" if state.draining else state.engine.health_error
    if error is None:
        return {"status": "ok"}
    return JSONResponse({"status": "unhealthy", "error": error}, 503)


def model_card(state: ServerState) -> dict:
    """The served model's card with the context length (vLLM's field), the capacity (sequences
    run at once and tokens the KV cache holds) and, for a model with a chat template, its effort
    levels."""
    info = state.engine.info
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "m3lm",
        "max_model_len": state.max_model_len,
        "max_num_seqs": info.max_num_seqs,
        "kv_cache_tokens": info.kv_tokens,
        **(state.efforts.card() if state.efforts is not None else {}),
    }


@router.get("/v1/models", responses=COMMON)
async def models(request: Request):
    return {"object": "list", "data": [model_card(state_of(request))]}


@router.get("/v1/models/{model_id:path}", responses=COMMON)
async def model(model_id: str, request: Request):
    state = state_of(request)
    state.check_model(model_id)
    return model_card(state)


@router.get("/tokenizer_info", responses=COMMON)
async def tokenizer_info(request: Request):
    """The tokenizer's special tokens, class and chat template, for clients that tokenize
    through the server (/tokenize, /detokenize)."""
    state = state_of(request)
    if state.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    return state.tokenizer.info(state.max_model_len)


@router.get("/metrics", response_class=PlainTextResponse, responses=COMMON)
async def prometheus(request: Request):
    state = state_of(request)
    return PlainTextResponse(state.metrics.render(state.engine.info))


@router.post("/v1/chat/completions", responses=GENERATION)
async def chat(req: ChatCompletionRequest, request: Request):
    return await chat_completion(served(request, req), req, request)


@router.post("/v1/completions", responses=GENERATION)
async def complete(req: CompletionRequest, request: Request):
    return await completion(served(request, req), req, request)


@router.post("/tokenize", responses=COMMON)
async def tokenize(req: TokenizeRequest, request: Request):
    state = state_of(request)
    state.check_model(req.model)
    tokenizer, limit = state.tokenizer, state.max_prompt_tokens
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages")
    try:
        if req.messages is not None:
            msgs = template_messages([m.for_template() for m in req.messages])
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            # as chat renders it: an M3.1-Flash template gets its default effort
            kwargs = req.chat_template_kwargs
            if state.efforts is not None:
                kwargs, _ = state.efforts.resolve(None, "reasoning_effort", kwargs, None)
            ids = await run_in_threadpool(tokenizer.chat_prompt, msgs, tools, True, kwargs, limit)
        else:
            tokenizer.check_fits(req.prompt, limit)
            ids = await run_in_threadpool(tokenizer.encode, req.prompt)
    except ValueError as e:
        raise ApiError(400, str(e), param=getattr(e, "param", None)) from None
    if len(ids) > limit:  # what cannot be a prompt is not listed: the answer stays small
        raise ApiError(400, f"the text has {len(ids)} tokens; a prompt holds at most {limit}")
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


@router.post("/detokenize", responses=COMMON)
async def detokenize(req: DetokenizeRequest, request: Request):
    state = state_of(request)
    state.check_model(req.model)
    if state.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    vocab = state.engine.info.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise ApiError(400, f"token ids must be in [0, {vocab})")
    return {"prompt": await run_in_threadpool(state.tokenizer.decode, req.tokens)}
