"""The Python generation API: `generate` and `stream_generate`, in the style of mlx-lm."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from m3lm.config import SESSION_CONTEXT, EngineConfig
from m3lm.core import SamplingParams, StepOutput, TokenLogprob
from m3lm.engine.engine import LLMEngine
from m3lm.models.minimax_m3 import MiniMaxM3
from m3lm.text.detokenize import TextStream


@dataclass
class GenerationChunk:
    """One increment of a streamed generation."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the engine's prefix cache (`session_engine`)
    # with speculative decoding: tokens a verification step emitted on average so far
    acceptance_length: float | None = None
    compile_s: float = 0.0  # seconds the engine's decode steps spent compiling so far (CPU --compile)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # the generated ids only
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    prompt_time: float  # seconds to the first generated token
    generation_time: float  # seconds from the first to the last token
    logprobs: list[TokenLogprob] | None = None

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        n = self.generation_tokens - 1
        return n / self.generation_time if n > 0 and self.generation_time > 0 else 0.0


def prompt_ids(
    tokenizer,
    prompt: str | Sequence[int] | None = None,
    messages: list[dict] | None = None,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids from a text prompt, a list of ids, or chat messages through the chat template."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    if messages is not None:
        if tokenizer is None:
            raise ValueError("messages need a tokenizer with a chat template")
        return tokenizer.apply_chat_template(messages, tools=tools, **(chat_template_kwargs or {}))
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass a list of token ids instead")
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def stream_generate(
    model: MiniMaxM3,
    tokenizer,
    prompt: str | Sequence[int] | None = None,
    *,
    messages: list[dict] | None = None,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    sampling_params: SamplingParams | None = None,
    msa_dense_window: float | None = None,
    prefill_chunk_size: int = 2048,
    engine: LLMEngine | None = None,
    pool: dict[str, Any] | None = None,
    speculative_config: Any = None,
    **sampling: Any,
) -> Iterator[GenerationChunk]:
    """Yield text increments as they are decided. `sampling` takes SamplingParams fields
    (max_tokens, temperature, top_p, top_k, min_p, penalties, seed, stop, stop_token_ids,
    ignore_eos, logprobs); unset ones default to the checkpoint's generation_config.json.

    Without `engine`, one sized to this prompt runs it; with one (`session_engine`), the prompt
    starts on the pages its earlier requests left cached (a chat's history is computed once),
    and a prompt longer than its context raises ValueError before anything runs. `pool`: the KV
    pool's EngineConfig fields for the engine made here (default: the request's length);
    `speculative_config` its `SpeculativeConfig` (or a dict, or its JSON text)."""
    ids = prompt_ids(tokenizer, prompt, messages, tools, chat_template_kwargs)
    gen_cfg = getattr(model, "generation_config", {})
    params = sampling_params or SamplingParams.from_generation_config(gen_cfg, **sampling)
    if engine is None:
        engine = _one_request_engine(
            model,
            tokenizer,
            len(ids) + params.max_tokens,
            msa_dense_window,
            prefill_chunk_size,
            pool,
            speculative_config,
        )
    elif engine.has_unfinished():
        raise ValueError("the engine is running another request")
    seq = engine.add_request(ids, params)
    texts = {seq.request_id: TextStream(tokenizer, params)} if tokenizer is not None else {}
    try:
        for out in with_text(engine, texts):
            yield GenerationChunk(
                text=out.new_text,
                token_ids=out.new_token_ids,
                finish_reason=out.finish_reason,
                logprobs=out.new_logprobs,
                prompt_tokens=len(seq.prompt_ids),
                generation_tokens=len(seq.output_ids),
                cached_tokens=seq.num_prefix_cached,
                acceptance_length=1 + seq.num_accepted / seq.num_drafts if seq.num_drafts else None,
                compile_s=getattr(engine.runner.graphs, "compile_s", 0.0),
            )
    finally:  # a consumer that stops early (or an error) leaves a shared engine idle
        engine.abort(seq.request_id)


def with_text(engine: LLMEngine, texts: dict[str, TextStream]) -> Iterator[StepOutput]:
    """Step `engine` until it is idle, each output with its text (for the requests in `texts`);
    a request a stop string ends is aborted in the engine then and there."""
    while engine.has_unfinished():
        for out in engine.step():
            text = texts.get(out.request_id)
            if text is not None and text.fill(out):
                engine.abort(out.request_id)
            yield out


def session_engine(
    model: MiniMaxM3,
    tokenizer=None,
    max_model_len: int | None = None,
    msa_dense_window: float | None = None,
    prefill_chunk_size: int = 2048,
    pool: dict[str, Any] | None = None,
    speculative_config: Any = None,
) -> LLMEngine:
    """An engine for one request at a time whose prompts share prefixes (a chat REPL): its cache
    keeps each request's pages after it ends, so `stream_generate(..., engine=...)` computes
    only what a prompt adds to the longest prefix seen before. It holds max_model_len tokens
    (default: `SESSION_CONTEXT`, at most the model's), prompt and reply together; `pool`: the KV
    pool's EngineConfig fields (default: a pool of max_model_len tokens); `speculative_config`
    as in `stream_generate`."""
    return _one_request_engine(
        model,
        tokenizer,
        max_model_len or SESSION_CONTEXT,
        msa_dense_window,
        prefill_chunk_size,
        pool,
        speculative_config,
    )


def _one_request_engine(
    model, tokenizer, context, msa_dense_window, prefill_chunk_size, pool=None, speculative_config=None
) -> LLMEngine:
    """An engine for one sequence at a time of up to `context` tokens (at most the model's), its
    pool that long unless `pool` (kv_cache_tokens, kv_cache_memory, gpu_memory_utilization) says;
    other EngineConfig fields in `pool` (cpu_compile) pass through."""
    context = min(context, model.args.max_position_embeddings)
    pool = pool or {}
    sized = any(k in pool for k in ("kv_cache_tokens", "kv_cache_memory", "gpu_memory_utilization"))
    config = EngineConfig(
        max_num_seqs=1,
        max_model_len=context,
        max_num_batched_tokens=prefill_chunk_size,
        msa_dense_window=msa_dense_window,
        speculative_config=speculative_config,
        **({} if sized else {"kv_cache_tokens": context}),
        **pool,
    )
    return LLMEngine(model, tokenizer, config, getattr(model, "generation_config", {}))


def generate(
    model: MiniMaxM3,
    tokenizer,
    prompt: str | Sequence[int] | None = None,
    **kwargs: Any,
) -> GenerationResult:
    """Generate to completion; same arguments as `stream_generate`."""
    start = time.perf_counter()
    first = None
    text, ids, lps, reason, n_prompt = [], [], [], "length", 0
    for chunk in stream_generate(model, tokenizer, prompt, **kwargs):
        first = first or time.perf_counter()
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        lps.extend(chunk.logprobs)
        reason = chunk.finish_reason or reason
        n_prompt = chunk.prompt_tokens
    end = time.perf_counter()
    return GenerationResult(
        text="".join(text),
        token_ids=ids,
        finish_reason=reason,
        prompt_tokens=n_prompt,
        generation_tokens=len(ids),
        prompt_time=(first or end) - start,
        generation_time=end - (first or end),
        logprobs=lps or None,
    )


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Peak memory of this process: CUDA allocator peak on a GPU, max RSS on the CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
