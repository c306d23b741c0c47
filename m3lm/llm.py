"""Offline batched generation in the style of vLLM: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from m3lm.config import EngineConfig, LoadSpec
from m3lm.core import SamplingParams, TokenLogprob
from m3lm.engine.engine import LLMEngine
from m3lm.generation import with_text
from m3lm.text.detokenize import TextStream
from m3lm.text.reasoning import ParsedReply, ReplyFormat, ReplyParser, detect_thinking_mode
from m3lm.text.reply import ReplyText


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    # from `LLM.chat`, for a checkpoint with reasoning and tool-call markers: the reply split
    # into reasoning, answer and tool calls (as the server splits it)
    reply: ParsedReply | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # with SamplingParams.prompt_logprobs: None for the first prompt token (nothing scores it),
    # then each prompt token's logprob and top alternatives, as vLLM returns them
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Loads a checkpoint once and runs many prompts through one continuous-batching engine."""

    def __init__(
        self,
        model: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        load_format: str = "auto",
        skip_tokenizer_init: bool = False,
        threads: int | None = None,
        **engine_kwargs: Any,
    ):
        """`threads`: torch's CPU threads (default: m3lm's choice for the model, unless
        OMP_NUM_THREADS or MKL_NUM_THREADS is set; `m3lm.threads`)."""
        from m3lm.engine.launch import load_for_engine
        from m3lm.threads import use_threads

        spec = LoadSpec(
            str(model), device, dtype, load_format=load_format, skip_tokenizer_init=skip_tokenizer_init
        )
        self.model, self.tokenizer, _ = load_for_engine(spec)
        if threads is not None:
            use_threads(self.model, threads)
        self.engine = LLMEngine(self.model, self.tokenizer, EngineConfig(**engine_kwargs))

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_params()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Text prompts or lists of token ids; outputs come back in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self._encode(p) for p in prompts]
        return self._run(texts, ids, sampling_params)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, each through the checkpoint's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a checkpoint with a tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [
            self.tokenizer.apply_chat_template(list(c), tools=tools, **(chat_template_kwargs or {}))
            for c in conversations
        ]
        return self._run([None] * len(ids), ids, sampling_params, tools=tools or [])

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a checkpoint with a tokenizer")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _run(self, texts_in, ids, sampling_params, tools: list[dict] | None = None) -> list[RequestOutput]:
        """`tools`: a chat's (None for plain prompts), whose replies are parsed."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(ids)
        else:
            params = list(sampling_params)
            if len(params) != len(ids):
                raise ValueError(f"{len(params)} sampling params for {len(ids)} prompts")
        for p in ids:
            self.engine.validate(p)
        seqs = [self.engine.add_request(p, sp) for p, sp in zip(ids, params, strict=True)]
        tok = self.tokenizer
        texts = {s.request_id: TextStream(tok, s.params) for s in seqs} if tok is not None else {}
        outputs = {
            s.request_id: CompletionOutput(0, "", [], None, [] if s.params.logprobs is not None else None)
            for s in seqs
        }
        replies = self._replies(seqs, tools) if tools is not None else {}
        for out in with_text(self.engine, texts):
            if out.request_id in replies:
                replies[out.request_id].events(out)
            o = outputs[out.request_id]
            o.text += out.new_text
            o.token_ids += out.new_token_ids
            if o.logprobs is not None:
                o.logprobs += out.new_logprobs
            o.finish_reason = out.finish_reason or o.finish_reason
        for rid, reply in replies.items():
            outputs[rid].reply = reply.parsed()
        return [
            RequestOutput(
                request_id=s.request_id,
                prompt=t,
                prompt_token_ids=s.prompt_ids,
                outputs=[outputs[s.request_id]],
                prompt_logprobs=None if s.params.prompt_logprobs is None else [None, *s.prompt_logprobs],
            )
            for t, s in zip(texts_in, seqs, strict=True)
        ]

    def _replies(self, seqs, tools: list[dict]) -> dict[str, ReplyText]:
        """A reply parser per chat request, when the checkpoint's tokenizer has the markers."""
        try:
            fmt = ReplyFormat.from_tokenizer(self.tokenizer.hf)
        except ValueError:
            return {}
        return {
            s.request_id: ReplyText(
                ReplyParser(fmt, detect_thinking_mode(s.prompt_ids, fmt.reasoning), tools)
            )
            for s in seqs
        }
