"""The bench slice: the release's exact text dimensions with N layers (layer 0 dense MLP + full
attention, the rest MoE + MSA), random bf16 weights made on the GPU, and the steps the benchmarks
time on it (a prefill into a fresh paged cache, the engine's captured decode step, a decode
step's parts as graphs of their own)."""

from __future__ import annotations

import math

import torch

from m3lm.bench.timing import graph_ms
from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.config import parse_config, release_config
from m3lm.engine.cuda_graphs import DecodeGraphs
from m3lm.layers.batch import DecodeBatch, ForwardBatch
from m3lm.loader import random_weights_
from m3lm.models.minimax_m3 import MiniMaxM3

RELEASE_DENSE, RELEASE_SPARSE = 3, 57  # the release's dense + full-attention and MoE + MSA layers


def release_slice_config(layers: int) -> dict:
    """The release's text config with `layers` layers (layer 0 dense + full attention)."""
    return release_config(
        vocab_size=200064, hidden_size=6144, num_hidden_layers=layers, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, rotary_dim=64, rope_theta=5000000,
        max_position_embeddings=1048576, dense_layers=1, dense_intermediate_size=12288,
        intermediate_size=3072, shared_intermediate_size=3072, num_local_experts=128,
        num_experts_per_tok=4, index_head_dim=128, block_size=128, topk_blocks=16, local_blocks=1,
    )["text_config"]  # fmt: skip


def build_slice(layers: int, device: str = "cuda", seed: int = 0) -> MiniMaxM3:
    """The release slice in bf16 with `random_weights_` (what `--load-format dummy` makes),
    prepared; a caller that quantises it prepares it again (`MiniMaxM3.prepare_`)."""
    args = parse_config(release_slice_config(layers))
    with torch.device("meta"):
        model = MiniMaxM3(args, dtype=torch.bfloat16)
    return random_weights_(model.to_empty(device=device), seed).eval().requires_grad_(False).prepare_()


def fill_cache(cache: KVCache, gen: torch.Generator) -> None:
    for t in (*cache.k, *cache.v, *cache.ik.values()):
        t.normal_(0.0, 1.0, generator=gen)


def prefill_step(model: MiniMaxM3, length: int):
    """A function that prefills `length` random tokens into a fresh paged cache and returns the
    last position's logits, as one step of the bench; the same cache is overwritten each call."""
    pages = math.ceil(length / model.args.index_block_size)
    cache = KVCache(model.args, pages, "cuda", torch.bfloat16)
    ids = torch.randint(0, model.args.vocab_size, (length,), device="cuda")
    pos = torch.arange(length, device="cuda")
    last = torch.tensor([length - 1], device="cuda")

    def step():
        with torch.inference_mode():
            batch = ForwardBatch(pos, [length], kv=PagedKV(cache, [list(range(pages))], [0], [length]))
            return model.forward_batch(ids, batch, last)

    return step


def captured_decode(model: MiniMaxM3, cache: KVCache, batch: int, pages: int, ctx: int):
    """The engine's captured decode step for `batch` sequences of `pages` pages at position ctx - 1,
    run once: (the DecodeGraphs that own it, the CUDA graph to replay)."""
    graphs = DecodeGraphs(model, cache, batch, pages, batch * pages)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    tokens = torch.randint(0, model.args.vocab_size, (batch,)).tolist()
    graphs.run(tokens, [ctx - 1] * batch, tables)
    return graphs, graphs._graphs[graphs.bucket(batch)][0]


@torch.inference_mode()
def decode_parts(model: MiniMaxM3, cache: KVCache, batch: int, pages: int, ctx: int, iters: int) -> dict:
    """`step_parts` of the decode step for `batch` sequences at position ctx - 1, each part
    as a CUDA graph of its own."""
    a, dev = model.args, "cuda"
    tokens = torch.randint(0, a.vocab_size, (batch,), device=dev)
    positions = torch.full((batch,), ctx - 1, device=dev)
    tables = torch.arange(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
    dec = DecodeBatch.build(positions, tables, cache, a.index_block_size)
    dec.rope(a.rotary_dim, a.rope_theta)  # the step's RoPE table, made once outside the graphs
    return step_parts(model, tokens, dec, graph_ms, iters)


@torch.inference_mode()
def step_parts(model: MiniMaxM3, tokens: torch.Tensor, batch, timer, iters: int) -> dict:
    """ms (`timer(fn, iters)`) of a step's parts over `batch` (a DecodeBatch or ForwardBatch of
    `tokens`): embedding + final norm + lm_head of every token, layer 0 (dense MLP + full
    attention) and layer 1 (MoE + MSA), each with the residual add of the previous layer's
    output (a MoE's, for layer 1, as its followers get) and its input norm."""
    h = model.model.embed_tokens(tokens)  # [T, C]
    layers = model.model.layers

    def head():
        model.lm_head(model.model.norm(model.model.embed_tokens(tokens))).float()

    def layer(i: int, pending):  # the residual add of the previous output with the input norm, then the layer
        return lambda: layers[i](*layers[i].input_layernorm(pending, h), batch)

    out = {"head": timer(head, iters), "dense": timer(layer(0, h), iters)}
    if len(layers) > 1:
        moe_out = layer(1, h)()[0]  # what a MoE layer hands on (unsummed on the GPU), as layers 2.. receive
        out["sparse"] = timer(layer(1, moe_out), iters)
    return out
