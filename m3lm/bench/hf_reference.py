"""The transformers reference for the GPU benchmarks: build a random MiniMax-M3 slice and time it.

`build_hf_slice` builds transformers' `MiniMaxM3VLForCausalLM` straight on the target device
(no CPU copy first), in `dtype`, with SDPA attention and the "grouped_mm" experts implementation
when transformers has it, and fills every parameter with small random values (never zeros).
`time_hf_prefill` times one full forward over `batch x length` random tokens without a cache,
with `logits_to_keep=1` so that only the last position goes through the lm_head.
`time_hf_decode` prefills `context` random tokens into a cache, then times single-token steps
against that cache, cropped back by one token after each step (untimed): every timed step sees
exactly `context` cached tokens and decodes position `context`.

Each timed call is preceded by a device synchronisation and measured with CUDA events on CUDA
(`time.perf_counter` elsewhere): the figures are per-call latencies, launch overhead and the
host syncs inside transformers included. Warm-up calls come first; the median of `iters` is
reported. Out-of-memory on CUDA returns `{"error": "out of memory"}`.
"""

from __future__ import annotations

import statistics
import time

import torch


def _experts_implementations() -> set[str]:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # transformers without switchable experts
        return set()
    return set(ALL_EXPERTS_FUNCTIONS.keys())


def build_hf_slice(
    text_config: dict, device, dtype=torch.bfloat16, seed: int = 0, experts: str | None = None
):
    """transformers' MiniMax-M3 text model with random weights, built directly on `device`, eval mode.

    `text_config` uses the names of transformers' normalised text config. Attention is SDPA; the
    MoE experts run `experts` if given, else "grouped_mm" when available, else the default.
    Matrices get N(0, 0.02), vectors (norm weights, router bias) N(0, 0.1).
    """
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    config = MiniMaxM3VLTextConfig(**{k: v for k, v in text_config.items() if k != "model_type"})
    kwargs = {"dtype": dtype, "attn_implementation": "sdpa"}
    experts = experts or ("grouped_mm" if "grouped_mm" in _experts_implementations() else None)
    if experts is not None:
        kwargs["experts_implementation"] = experts
    device = torch.device(device)
    with torch.device(device):
        model = MiniMaxM3VLForCausalLM._from_config(config, **kwargs)
    model.eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        tensors = [t for _, t in model.named_parameters()]
        tensors += [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for t in tensors:
            t.normal_(0.0, 0.1 if t.dim() == 1 else 0.02, generator=gen)
    return model


def settings(model) -> dict:
    """The attention and experts implementations the model really runs, its dtype, the timer."""
    return {
        "attention": getattr(model.config, "_attn_implementation", None),
        "experts": getattr(model.config, "_experts_implementation", None),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "timer": "CUDA events" if model.device.type == "cuda" else "perf_counter",
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int, warmup: int, after=None) -> list[float]:
    """Milliseconds of each of `iters` calls of `fn` after `warmup` calls; `after` runs untimed."""
    times = []
    for i in range(warmup + iters):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if after is not None:
            after()
        if i >= warmup:
            times.append(ms)
    return times


def _ids(model, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), device=model.device, generator=gen)


def _oom() -> dict:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"error": "out of memory"}


def time_hf_prefill(model, batch: int, length: int, iters: int, warmup: int = 2, seed: int = 0) -> dict:
    """Median ms of `model(ids, use_cache=False, logits_to_keep=1)` over `batch x length` random ids."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    try:
        with torch.inference_mode():
            ids = _ids(model, batch, length, gen)
            fn = lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
            times = _time(fn, model.device, iters, warmup)
    except torch.cuda.OutOfMemoryError:
        return _oom()
    ms = statistics.median(times)
    return {
        "measured": "full forward, no cache, logits of the last position only",
        "batch": batch,
        "length": length,
        "iters": iters,
        "median_ms": ms,
        "min_ms": min(times),
        "tokens_per_s": batch * length / ms * 1e3,
        **settings(model),
    }


def time_hf_decode(
    model,
    batch: int,
    context: int,
    iters: int,
    warmup: int = 3,
    seed: int = 0,
    step_experts: str | None = None,
    keep_logits: bool = False,
) -> dict:
    """Median ms of one decode step of `batch` tokens against a cache holding `context` tokens.

    The cache is whatever `model(..., use_cache=True)` returns (a `DynamicCache`); it is cropped
    by one token after every step (untimed), so each step runs at the same context. Every step
    feeds the same random token per sequence. `step_experts` (e.g. "batched_mm", which
    transformers' `generate` switches to for decoding on GPUs) runs the timed steps with that
    experts implementation; the prefill keeps the model's own. `prefill_ms` is the wall time of
    the single prefill of the context (not warmed up). With `keep_logits`, the result also holds
    the CPU tensors `context_ids`, `step_ids` and `step_logits` (the last timed step's logits).
    """
    gen = torch.Generator(device=model.device).manual_seed(seed)
    out = {}
    try:
        with torch.inference_mode():
            ids = _ids(model, batch, context, gen)
            step_ids = _ids(model, batch, 1, gen)
            _sync(model.device)
            t0 = time.perf_counter()
            cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
            _sync(model.device)
            prefill_ms = (time.perf_counter() - t0) * 1e3

            def step():
                out["logits"] = model(input_ids=step_ids, past_key_values=cache, use_cache=True).logits

            own = settings(model)["experts"]
            if step_experts is not None:
                model.set_experts_implementation(step_experts)
            try:
                times = _time(step, model.device, iters, warmup, after=lambda: cache.crop(-1))
                step_settings = settings(model)
            finally:
                if step_experts is not None:
                    model.set_experts_implementation(own)
            length = cache.get_seq_length()
    except torch.cuda.OutOfMemoryError:
        out.clear()
        return _oom()
    if length != context:
        raise RuntimeError(f"the cache holds {length} tokens after the timed steps, expected {context}")
    ms = statistics.median(times)
    result = {
        "measured": "one decode step at a fixed context (cache cropped back after each step)",
        "batch": batch,
        "context": context,
        "iters": iters,
        "median_ms": ms,
        "min_ms": min(times),
        "tokens_per_s": batch / ms * 1e3,
        "prefill_ms": prefill_ms,
        **step_settings,
    }
    if keep_logits:
        result["context_ids"], result["step_ids"] = ids.cpu(), step_ids.cpu()
        result["step_logits"] = out["logits"][:, -1].float().cpu()
    return result


def slice_config(cfg: dict) -> dict:
    """transformers' MiniMaxM3 text config for the slice whose release-style text config is `cfg`."""
    sp = cfg["sparse_attention_config"]
    return {
        "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rotary_dim": 64,
        "rope_parameters": {"rope_theta": 5000000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
        "intermediate_size": 3072, "dense_intermediate_size": 12288, "shared_intermediate_size": 3072,
        "num_local_experts": 128, "num_experts_per_tok": 4, "routed_scaling_factor": 2.0,
        "layer_types": ["minimax_m3_sparse" if f else "full_attention" for f in sp["sparse_attention_freq"]],
        "mlp_layer_types": ["sparse" if f else "dense" for f in cfg["moe_layer_freq"]],
        "index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16,
        "index_local_blocks": 1, "max_position_embeddings": 1048576, "bos_token_id": None, "eos_token_id": None,
    }  # fmt: skip
