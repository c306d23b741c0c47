"""`m3lm bench`: a real-dimension slice of MiniMax-M3 on one GPU, timed against its memory floor.

The slice has the release's exact text dimensions and N layers (layer 0 dense MLP + full
attention, the rest MoE + MSA), random bf16 weights built directly on the GPU. Decode steps are
timed as captured CUDA graph replays (the engine's decode path); prefill as one packed forward,
back to back for a second after a half-second warm-up (a busy server: the H200 then runs at its
power limit and slows its SM clock), and in a note one step at a time after the GPU idled (a
prompt reaching an idle GPU). Each row reports ms, tok/s, the bytes the step must read at
least, GB/s and the fraction of the floor (bytes at the measured copy bandwidth); a note gives
the GPU's power, temperature and SM clock over each case (`gpu_meter`). With
`--compare-transformers` the transformers implementation runs on a slice of the same dimensions
in the same process.

`--quant bf16,mxfp8` times the same slice with bf16 weights, then with the weights quantised to
MXFP8 (the release's scheme) and kept in 8 bits. For each decode case it also times the parts
(embedding + final norm + lm_head, one dense layer, one MoE + MSA layer) as graphs of their own,
reports the decoder layers alone (step minus embedding and lm_head, which the release keeps in
bf16) and projects the 60-layer model: head + 3 dense + 57 MoE/MSA layers.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import torch

from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.config import parse_config, release_config
from m3lm.core import DecodeBatch, ForwardBatch
from m3lm.engine.cuda_graphs import DecodeGraphs
from m3lm.gpu_meter import GpuMeter, GpuState
from m3lm.layers.linear import weight_bytes
from m3lm.loader import random_weights_
from m3lm.models.minimax_m3 import MiniMaxM3, keep_mxfp8_

RELEASE_DENSE, RELEASE_SPARSE = 3, 57  # the release's dense + full-attention and MoE + MSA layers
COPY_BW = 4.3e12  # bytes/s, device-to-device copy measured on the H200
MATMUL_RATE = 790e12  # bf16 FLOP/s, large matrix product measured on the H200


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
    """The release slice in bf16 with `random_weights_` (what `--load-format dummy` makes)."""
    args = parse_config(release_slice_config(layers))
    with torch.device("meta"):
        model = MiniMaxM3(args, dtype=torch.bfloat16)
    return random_weights_(model.to_empty(device=device), seed).eval().requires_grad_(False)


@dataclass
class Row:
    case: str
    ms: float
    tokens: int
    floor_bytes: float
    flops: float
    ref_ms: float | None = None
    parts: dict | None = None  # decode: ms of the head and of one layer of each kind
    rested_ms: float | None = None  # prefill: one step after the GPU idled (`rested_ms`)
    gpu: GpuState | None = None  # over the case's calls (warm-up and timed), where NVML answers

    @property
    def floor_ms(self) -> float:
        """The larger of the byte floor and the arithmetic floor."""
        return max(self.floor_bytes / COPY_BW, self.flops / MATMUL_RATE) * 1e3

    def cells(self) -> list[str]:
        tps = self.tokens / self.ms * 1e3
        gbs = self.floor_bytes / self.ms / 1e6
        frac = self.floor_ms / self.ms
        tf = self.flops / self.ms / 1e9
        ref = f"{self.ref_ms:.2f}" if self.ref_ms else "-"
        speed = f"{self.ref_ms / self.ms:.1f}x" if self.ref_ms else "-"
        return [
            self.case,
            f"{self.ms:.3f}",
            f"{tps:,.0f}",
            f"{gbs:,.0f}",
            f"{tf:,.1f}",
            f"{frac:.2f}",
            ref,
            speed,
        ]


def _weights_bytes(model: MiniMaxM3, batch: int) -> float:
    """Bytes of weights one decode step of `batch` tokens must read (experts: those expected to be hit)."""
    a = model.args
    total = 0.0
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            b = batch * a.hidden_size * p.element_size()
        elif ".experts." in name:
            hit = a.num_local_experts * (1 - (1 - a.num_experts_per_tok / a.num_local_experts) ** batch)
            b = b * hit / a.num_local_experts
        total += b
    return total


def _active_params(model: MiniMaxM3, with_lm_head: bool = True) -> float:
    a = model.args
    n = 0.0
    for name, p in model.named_parameters():
        skip = name.endswith(("embed_tokens.weight", "_scale")) or (
            name == "lm_head.weight" and not with_lm_head
        )
        if skip:
            continue
        n += p.numel() * (a.num_experts_per_tok / a.num_local_experts if ".experts." in name else 1)
    return n


def _kv_bytes(model: MiniMaxM3, batch: int, ctx: int) -> float:
    a = model.args
    per_tok = 2 * a.num_key_value_heads * a.head_dim * 2
    dense = sum(1 for s in a.sparse_layers if not s) * ctx
    sparse = sum(a.sparse_layers) * min(ctx, a.dense_window)
    index = sum(a.sparse_layers) * ctx * a.index_head_dim * 2
    return batch * ((dense + sparse) * per_tok + index)


def _fill(cache: KVCache, gen: torch.Generator) -> None:
    for t in (*cache.k, *cache.v, *cache.ik.values()):
        t.normal_(0.0, 1.0, generator=gen)


WARMUP_S = 0.5  # each case runs three calls (its kernels compile), then this long before it is timed,
# so that it starts from its own clock and power state, not the one the case before left (a
# prefill drops the SM clock for a while)


def event_ms(fn) -> float:
    """Milliseconds of one call of `fn` on the GPU, between two CUDA events (waits for the end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time(fn, iters: int) -> float:
    """Median ms of `iters` calls of fn, each between CUDA events, after WARMUP_S of calls."""
    return _measure(fn, iters)[0]


def _measure(fn, iters: int, gpu: bool = False, seconds: float = 0.0) -> tuple[float, GpuState | None]:
    """`_time`'s ms, over at least `iters` timed calls and `seconds`, and with `gpu` the GPU's
    state over the warm-up's last WARMUP_S and the timed calls (`gpu_meter`; None where NVML does
    not answer). The first three calls, which may compile kernels while the GPU idles, are not in
    that window nor in the warm-up's time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    meter = GpuMeter.open() if gpu else None
    window = meter.window() if meter else None
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < WARMUP_S:
        fn()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < iters or time.perf_counter() - start < seconds:
        times.append(event_ms(fn))
    return sorted(times)[len(times) // 2], window.close() if window else None


def rested_ms(fn, samples: int = 3, pause: float = 0.5) -> float:
    """Median ms of single calls, each after `pause` seconds with the GPU idle."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        time.sleep(pause)
        times.append(event_ms(fn))
    return sorted(times)[len(times) // 2]


def _graph_ms(fn, iters: int) -> float:
    """Median ms of replaying a CUDA graph of `fn` (captured after two warm-up calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time(graph.replay, iters)


@torch.inference_mode()
def decode_parts(model: MiniMaxM3, cache: KVCache, batch: int, pages: int, ctx: int, iters: int) -> dict:
    """ms of the decode step's parts, each as its own graph: embedding + final norm + lm_head,
    layer 0 (dense MLP + full attention) and layer 1 (MoE + MSA), each with the residual add of
    the previous layer's output (a MoE's, for layer 1, as its followers get) and its input norm."""
    a, dev = model.args, "cuda"
    tokens = torch.randint(0, a.vocab_size, (batch,), device=dev)
    positions = torch.full((batch,), ctx - 1, device=dev)
    tables = torch.arange(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
    dec = DecodeBatch.build(positions, tables, cache, a.index_block_size)
    dec.rope(a.rotary_dim, a.rope_theta)  # the step's RoPE table, made once outside the graphs
    h = model.model.embed_tokens(tokens)  # [B, C]
    layers = model.model.layers

    def head():
        model.lm_head(model.model.norm(model.model.embed_tokens(tokens))).float()

    def layer(i: int, pending):  # the residual add of the previous output with the input norm, then the layer
        return lambda: layers[i](*layers[i].input_layernorm(pending, h), dec)

    out = {"head": _graph_ms(head, iters), "dense": _graph_ms(layer(0, h), iters)}
    if len(layers) > 1:
        moe_out = layer(1, h)()[0]  # what a MoE layer hands on (unsummed on the GPU), as layers 2.. receive
        out["sparse"] = _graph_ms(layer(1, moe_out), iters)
    return out


def parts_line(case: str, step_ms: float, parts: dict, n_layers: int) -> str:
    """The decoder-layers-only time and the 60-layer projection of one decode case."""
    sparse = parts.get("sparse", 0.0)
    proj = parts["head"] + RELEASE_DENSE * parts["dense"] + RELEASE_SPARSE * sparse
    summed = parts["head"] + parts["dense"] + (n_layers - 1) * sparse
    return (
        f"{case}: step {step_ms:.3f} ms; embedding+norm+lm_head {parts['head']:.3f} ms; "
        f"decoder layers {step_ms - parts['head']:.3f} ms (dense layer {parts['dense']:.3f}, "
        f"MoE+MSA layer {sparse:.3f}; parts sum to {summed:.3f}); 60-layer projection "
        f"{parts['head']:.3f} + {RELEASE_DENSE} x {parts['dense']:.3f} + {RELEASE_SPARSE} x {sparse:.3f} = {proj:.2f} ms"
    )


def rested_line(row: Row) -> str:
    return (
        f"{row.case}: {row.rested_ms:.3f} ms ({row.tokens / row.rested_ms * 1e3:,.0f} tok/s) a step "
        f"after 0.5 s with the GPU idle (median of 3); the table's {row.ms:.3f} ms is the step back "
        "to back, at the power limit"
    )


def captured_decode(model: MiniMaxM3, cache: KVCache, batch: int, pages: int, ctx: int):
    """The engine's captured decode step for `batch` sequences of `pages` pages at position ctx - 1,
    run once: (the DecodeGraphs that own it, the CUDA graph to replay)."""
    graphs = DecodeGraphs(model, cache, batch, pages, batch * pages)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    tokens = torch.randint(0, model.args.vocab_size, (batch,)).tolist()
    graphs.run(tokens, [ctx - 1] * batch, tables)
    return graphs, graphs._graphs[graphs.bucket(batch)][0]


def bench_decode(model: MiniMaxM3, batch: int, ctx: int, iters: int) -> Row:
    s = model.args.index_block_size
    pages = math.ceil(ctx / s)
    cache = KVCache(model.args, batch * pages + 1, "cuda", torch.bfloat16)
    _fill(cache, torch.Generator(device="cuda").manual_seed(1))
    graphs, graph = captured_decode(model, cache, batch, pages, ctx)
    ms, gpu = _measure(graph.replay, iters, gpu=True)
    del graphs
    parts = decode_parts(model, cache, batch, pages, ctx, iters)
    del cache
    flops = 2 * _active_params(model) * batch
    row = Row(
        f"decode B={batch} ctx={ctx}",
        ms,
        batch,
        _weights_bytes(model, batch) + _kv_bytes(model, batch, ctx),
        flops,
        parts=parts,
        gpu=gpu,
    )
    return row


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


PREFILL_SECONDS = 1.0  # prefill steps are timed back to back for at least this long: under the
# power limit the SM clock swings from step to step, and the median of a few steps swings with it


def bench_prefill(model: MiniMaxM3, length: int, iters: int) -> Row:
    """The prefill step back to back (the median over PREFILL_SECONDS after the warm-up: a server
    busy with prefills), and one step at a time after the GPU idled (a prompt reaching an idle GPU)."""
    step = prefill_step(model, length)
    ms, gpu = _measure(step, iters, gpu=True, seconds=PREFILL_SECONDS)
    rested = rested_ms(step)
    a = model.args

    def keys(window: int) -> float:  # sum over queries t of the keys attended, min(t + 1, window)
        w = min(window, length)
        return w * (w + 1) / 2 + (length - w) * w

    attn = sum(keys(a.dense_window if sp else length) for sp in a.sparse_layers)
    lm_head = 2 * a.hidden_size * a.vocab_size  # logits of the last position only
    flops = (
        2 * _active_params(model, with_lm_head=False) * length
        + lm_head
        + 4 * attn * a.num_attention_heads * a.head_dim
    )
    case = f"prefill B=1 T={length}"
    return Row(case, ms, length, _weights_bytes(model, length), flops, gpu=gpu, rested_ms=rested)


def _gb(sizes: dict[str, int]) -> str:
    return (
        f"{sum(sizes.values()) / 1e9:.2f} GB ("
        + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sizes.items())
        + ")"
    )


def run(args) -> tuple[list[Row], list[str]]:
    """Rows of every variant in `args.quant` (bf16 first: the mxfp8 variant quantises in place)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    from m3lm.bench_attention import bench_attention

    quants = args.quant
    if quants not in (["bf16"], ["mxfp8"], ["bf16", "mxfp8"]):
        raise ValueError(f"--quant {','.join(quants)}: expected bf16, mxfp8 or bf16,mxfp8")
    t0 = time.time()
    model = build_slice(args.layers)
    print(f"built a {args.layers}-layer slice in {time.time() - t0:.1f} s", flush=True)
    rows, notes, resident, layers_ms = [], [], {}, {}
    resident["bf16"] = weight_bytes(model)
    in_layers = {"bf16": sum(weight_bytes(model.model.layers).values())}  # without embedding and lm_head
    for quant in quants:
        if quant == "mxfp8":
            keep_mxfp8_(model, quantize=True)  # the release's scheme, from the random bf16 weights
            torch.cuda.empty_cache()
            resident["mxfp8"] = weight_bytes(model)
            in_layers["mxfp8"] = sum(weight_bytes(model.model.layers).values())
        tag = f" [{quant}]" if len(quants) > 1 or quant != "bf16" else ""
        notes.append(f"resident weights{tag or ' [bf16]'}: {_gb(resident[quant])}")
        print(notes[-1], flush=True)
        first = len(rows)
        for b, ctx in args.decode:
            rows.append(bench_decode(model, b, ctx, args.iters))
            rows[-1].case += tag
            layers_ms[(quant, b, ctx)] = rows[-1].ms - rows[-1].parts["head"]
            print(" | ".join(rows[-1].cells()), flush=True)
            notes.append(parts_line(rows[-1].case, rows[-1].ms, rows[-1].parts, args.layers))
            print(notes[-1], flush=True)
        for t in args.prefill:
            rows.append(bench_prefill(model, t, max(3, args.iters // 5)))
            rows[-1].case += tag
            print(" | ".join(rows[-1].cells()), flush=True)
            notes.append(rested_line(rows[-1]))
            print(notes[-1], flush=True)
        if quant == quants[0]:
            first_rows = rows[first:]
            for t in args.attention:
                for case, ms, tokens, flops, dense_ms in bench_attention(
                    model, t, max(3, args.iters // 5), _time
                ):
                    row = Row(case, ms, tokens, 0.0, flops, ref_ms=dense_ms)
                    rows.append(row)
                    print(" | ".join(row.cells()), "(reference column: dense flash attention)", flush=True)
    if len(quants) == 2:
        ratio = sum(resident["mxfp8"].values()) / sum(resident["bf16"].values())
        notes.append(
            f"resident weights mxfp8 / bf16: {ratio:.3f} (decoder layers only, without the embedding "
            f"and lm_head that the release keeps in bf16: {in_layers['mxfp8'] / in_layers['bf16']:.3f})"
        )
        for b, ctx in args.decode:
            speed = layers_ms[("bf16", b, ctx)] / layers_ms[("mxfp8", b, ctx)]
            notes.append(f"decode B={b} ctx={ctx}: decoder layers bf16 / mxfp8 = {speed:.2f}x")
        print("\n".join(notes[-1 - len(args.decode) :]), flush=True)
    measured = [r for r in rows if r.gpu]
    if measured:
        notes.append(
            "GPU per case (power: mean over the case's warm-up and timed calls; temperature and SM "
            "clock at their end): " + "; ".join(f"{r.case}: {r.gpu}" for r in measured)
        )
        print(notes[-1], flush=True)
    cfg = release_slice_config(args.layers)
    del model
    torch.cuda.empty_cache()
    if args.compare_transformers:
        _compare(cfg, args, first_rows)
    return rows, notes


def _compare(cfg: dict, args, rows: list[Row]) -> None:
    from m3lm import bench_hf as hf_reference

    hf = hf_reference.build_hf_slice(hf_reference.slice_config(cfg), "cuda")
    specs = [("d", b, c) for b, c in args.decode] + [("p", 1, t) for t in args.prefill]
    for row, spec in zip(rows[: len(specs)], specs, strict=True):
        kind, b, n = spec
        res = (
            hf_reference.time_hf_decode(hf, b, n, 5)
            if kind == "d"
            else hf_reference.time_hf_prefill(hf, b, n, 3)
        )
        row.ref_ms = res.get("median_ms", res.get("ms"))
        print(row.case, "transformers:", json.dumps(res), flush=True)


def markdown(rows: list[Row], command: str, notes: list[str] = ()) -> str:
    head = [
        "case",
        "ms",
        "tok/s",
        "GB/s (floor bytes)",
        "TFLOP/s",
        "fraction of floor",
        "transformers ms",
        "speed-up",
    ]
    meter = GpuMeter.open()
    limit = f" (power limit {meter.power_limit_w():.0f} W)" if meter else ""
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {torch.cuda.get_device_name()}{limit}, torch {torch.__version__}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"
