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

`--verify 1x4096,16x2048 --num-spec-tokens 3` times the engine's speculative verification
step (B sequences x k + 1 positions) with its parts, and projects the 60-layer model's tokens/s
with speculation at the mean acceptance lengths of `--acceptance` against plain decoding at the
same B and context (a decode case is added where `--decode` has none); `--drafter` also times
drafting with a random EAGLE-3 drafter at the published shapes (`bench.speculation`).

`--quant bf16,mxfp8` times the same slice with bf16 weights, then with the weights quantised to
MXFP8 (the release's scheme) and kept in 8 bits; `bf16,nvfp4`, `bf16,mxfp4` and `bf16,affine4`
quantise them as those 4-bit exports hold them (`layers.quantized.Q4_LAYOUTS`) and keep 4 bits. For each decode case it also times the parts
(embedding + final norm + lm_head, one dense layer, one MoE + MSA layer) as graphs of their own,
reports the decoder layers alone (step minus embedding and lm_head, which the release keeps in
bf16) and projects the 60-layer model: head + 3 dense + 57 MoE/MSA layers.
"""

from __future__ import annotations

import json
import math
import time

import torch

from m3lm.bench import hf_reference, speculation
from m3lm.bench.attention import bench_attention
from m3lm.bench.report import (
    Row,
    active_params,
    gb_text,
    kv_bytes,
    parts_line,
    rested_line,
    weights_bytes,
)
from m3lm.bench.slice import (
    build_slice,
    captured_decode,
    decode_parts,
    fill_cache,
    prefill_step,
    release_slice_config,
)
from m3lm.bench.timing import PREFILL_SECONDS, measure, rested_ms, time_ms
from m3lm.cache.kv_cache import KVCache
from m3lm.layers.linear import weight_bytes
from m3lm.layers.quantized import Q4_LAYOUTS, quantize_q4_
from m3lm.models.minimax_m3 import MiniMaxM3, keep_mxfp8_


def bench_decode(model: MiniMaxM3, batch: int, ctx: int, iters: int) -> Row:
    s = model.args.index_block_size
    pages = math.ceil(ctx / s)
    cache = KVCache(model.args, batch * pages + 1, "cuda", torch.bfloat16)
    fill_cache(cache, torch.Generator(device="cuda").manual_seed(1))
    graphs, graph = captured_decode(model, cache, batch, pages, ctx)
    ms, gpu = measure(graph.replay, iters, gpu=True)
    del graphs
    parts = decode_parts(model, cache, batch, pages, ctx, iters)
    del cache
    flops = 2 * active_params(model) * batch
    row = Row(
        f"decode B={batch} ctx={ctx}",
        ms,
        batch,
        weights_bytes(model, batch) + kv_bytes(model, batch, ctx),
        flops,
        parts=parts,
        gpu=gpu,
    )
    return row


def bench_prefill(model: MiniMaxM3, length: int, iters: int) -> Row:
    """The prefill step back to back (the median over PREFILL_SECONDS after the warm-up: a server
    busy with prefills), and one step at a time after the GPU idled (a prompt reaching an idle GPU)."""
    step = prefill_step(model, length)
    ms, gpu = measure(step, iters, gpu=True, seconds=PREFILL_SECONDS)
    rested = rested_ms(step)
    a = model.args

    def keys(window: int) -> float:  # sum over queries t of the keys attended, min(t + 1, window)
        w = min(window, length)
        return w * (w + 1) / 2 + (length - w) * w

    attn = sum(keys(a.dense_window if sp else length) for sp in a.sparse_layers)
    lm_head = 2 * a.hidden_size * a.vocab_size  # logits of the last position only
    flops = (
        2 * active_params(model, with_lm_head=False) * length
        + lm_head
        + 4 * attn * a.num_attention_heads * a.head_dim
    )
    case = f"prefill B=1 T={length}"
    return Row(case, ms, length, weights_bytes(model, length), flops, gpu=gpu, rested_ms=rested)


QUANTS = ("mxfp8", *Q4_LAYOUTS)


def run(args) -> tuple[list[Row], list[str]]:
    """Rows of every variant in `args.quant` (bf16 first: the mxfp8 variant quantises in place)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    quants = args.quant
    _check_quants(quants)
    t0 = time.time()
    model = build_slice(args.layers)
    print(f"built a {args.layers}-layer slice in {time.time() - t0:.1f} s", flush=True)
    bench = _Bench(args)
    if args.drafter:
        draft_rows, draft_notes, bench.drafts = speculation.draft_cases(model, args, time_ms)
        bench.rows += draft_rows
        bench.notes += draft_notes
    bench.weigh(model, "bf16")
    for quant in quants:
        if quant != "bf16":  # the release's scheme or an export's, from the random bf16 weights
            keep_mxfp8_(model, quantize=True) if quant == "mxfp8" else quantize_q4_(model, quant)
            model.prepare_()  # the packed projections of the new weights
            torch.cuda.empty_cache()
            bench.weigh(model, quant)
        bench.variant(model, quant)
    if len(quants) == 2:
        bench.quant_notes(quants[1])
    bench.gpu_note()
    cfg = release_slice_config(args.layers)
    del model
    torch.cuda.empty_cache()
    if args.compare_transformers:
        compare_transformers(cfg, args, bench.compared)
    return bench.rows, bench.notes


def _check_quants(quants: list[str]) -> None:
    """ValueError unless `--quant` is bf16, one of QUANTS, or bf16 and one of them."""
    if not (
        quants in (["bf16"], *([q] for q in QUANTS))
        or (quants[0] == "bf16" and quants[1:] in ([q] for q in QUANTS))
    ):
        raise ValueError(
            f"--quant {','.join(quants)}: expected bf16, one of {', '.join(QUANTS)}, or bf16 and one of them"
        )


class _Bench:
    """One run's results as they come (rows and notes, each printed at once) and what its closing
    notes and the transformers comparison need. It holds no model, so that `run` can free it."""

    def __init__(self, args) -> None:
        self.args = args
        self.decodes = args.decode + [c for c in args.verify if c not in args.decode]
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.resident: dict[str, dict[str, int]] = {}  # by variant: the weights' bytes by dtype
        self.in_layers: dict[str, int] = {}  # by variant: the decoder layers' bytes
        self.layers_ms: dict[tuple[str, int, int], float] = {}  # (variant, B, ctx): step minus head
        self.parts: dict[tuple[int, int], dict] = {}  # (B, ctx): the latest variant's decode parts
        self.drafts: dict = {}  # the drafter's cases, for the verification cases
        self.compared: list[Row] = []  # the first variant's decode and prefill rows, for transformers

    def row(self, row: Row, *extra: str) -> None:
        """Keep a row and print it (with `extra` words after its cells)."""
        self.rows.append(row)
        print(" | ".join(row.cells()), *extra, flush=True)

    def note(self, text: str) -> None:
        """Keep a note and print it."""
        self.notes.append(text)
        print(text, flush=True)

    def weigh(self, model: MiniMaxM3, quant: str) -> None:
        """Record the resident weights of variant `quant`, all of them and the decoder layers'."""
        self.resident[quant] = weight_bytes(model)
        self.in_layers[quant] = sum(weight_bytes(model.model.layers).values())

    def variant(self, model: MiniMaxM3, quant: str) -> None:
        """Every case on the model as variant `quant` holds it: decode, verification, prefill, and
        with the first variant the attention kernels."""
        args, first = self.args, quant == self.args.quant[0]
        tag = f" [{quant}]" if len(args.quant) > 1 or quant != "bf16" else ""
        self.note(f"resident weights{tag or ' [bf16]'}: {gb_text(self.resident[quant])}")
        for b, ctx in self.decodes:
            self.decode(model, quant, b, ctx, tag)
        spec_rows, spec_notes = speculation.verify_cases(model, args, self.parts, self.drafts, tag, time_ms)
        self.rows += spec_rows
        self.notes += spec_notes
        for t in args.prefill:
            row = bench_prefill(model, t, max(3, args.iters // 5))
            row.case += tag
            self.row(row)
            self.note(rested_line(row))
            if first:
                self.compared.append(row)
        if first:
            self.attention(model)

    def decode(self, model: MiniMaxM3, quant: str, b: int, ctx: int, tag: str) -> None:
        """One decode case, with its parts and the decoder layers' time."""
        row = bench_decode(model, b, ctx, self.args.iters)
        row.case += tag
        self.layers_ms[(quant, b, ctx)] = row.ms - row.parts["head"]
        self.parts[(b, ctx)] = row.parts
        if quant == self.args.quant[0] and (b, ctx) in self.args.decode:
            self.compared.append(row)
        self.row(row)
        self.note(parts_line(row.case, row.ms, row.parts, self.args.layers))

    def attention(self, model: MiniMaxM3) -> None:
        """The attention kernels' cases, against dense flash attention."""
        iters = max(3, self.args.iters // 5)
        for t in self.args.attention:
            for case, ms, tokens, flops, dense_ms in bench_attention(model, t, iters, time_ms):
                row = Row(case, ms, tokens, 0.0, flops, ref_ms=dense_ms)
                self.row(row, "(reference column: dense flash attention)")

    def quant_notes(self, q: str) -> None:
        """Variant `q` against bf16: resident weights, and each decode case's decoder layers."""
        ratio = sum(self.resident[q].values()) / sum(self.resident["bf16"].values())
        notes = [
            f"resident weights {q} / bf16: {ratio:.3f} (decoder layers only, without the embedding "
            f"and lm_head that the release keeps in bf16: {self.in_layers[q] / self.in_layers['bf16']:.3f})"
        ]
        for b, ctx in self.args.decode:
            speed = self.layers_ms[("bf16", b, ctx)] / self.layers_ms[(q, b, ctx)]
            notes.append(f"decode B={b} ctx={ctx}: decoder layers bf16 / {q} = {speed:.2f}x")
        self.notes += notes
        print("\n".join(notes), flush=True)

    def gpu_note(self) -> None:
        """The GPU's power, temperature and SM clock over each case that measured them."""
        measured = [r for r in self.rows if r.gpu]
        if measured:
            self.note(
                "GPU per case (power: mean over the case's warm-up and timed calls; temperature and SM "
                "clock at their end): " + "; ".join(f"{r.case}: {r.gpu}" for r in measured)
            )


def compare_transformers(cfg: dict, args, rows: list[Row]) -> None:
    """transformers' ms on a slice of the same dimensions into each row of `args.decode` and
    `args.prefill`, in that order."""
    hf = hf_reference.build_hf_slice(hf_reference.slice_config(cfg), "cuda")
    specs = [("d", b, c) for b, c in args.decode] + [("p", 1, t) for t in args.prefill]
    for row, spec in zip(rows, specs, strict=True):
        kind, b, n = spec
        res = (
            hf_reference.time_hf_decode(hf, b, n, 5)
            if kind == "d"
            else hf_reference.time_hf_prefill(hf, b, n, 3)
        )
        row.ref_ms = res.get("median_ms", res.get("ms"))
        print(row.case, "transformers:", json.dumps(res), flush=True)
