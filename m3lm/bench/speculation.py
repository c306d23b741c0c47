"""`m3lm bench --verify` and `--drafter`: what speculative decoding costs at the release's
dimensions, and what it gives the 60-layer model.

verify: the engine's verification step, in which every sequence computes k + 1 positions (its
last token and k drafts) as rows of one position over its table, each row selecting its own MSA
blocks: on a GPU the replay of its captured decode graph; with the step's parts as the decode
case has them (`step_parts`), so that the 60-layer verify step can be projected as the decode
step is, and the routed experts a MoE layer reads for its rows.

drafter: a randomly initialised EAGLE-3 drafter at the published shapes (`drafter_config`, built
on the device without a checkpoint), timed as the engine drafts after a step of decodes
(`EagleDrafter.draft_rows`: every sequence at once, the k + 1 positions of a step that accepted
every draft taken in, then k drafts; on a GPU one graph replay); with its parts (the fc over the
captured states, one draft step).

projection: a step with speculation emits L tokens a sequence on average (the mean acceptance
length) for the drafting and one verify step; plain decoding emits one for one decode step.

Each case takes the model it times (the release slice on a GPU, a small one on the CPU) and a
timer `timer(fn, iters) -> ms`, so that the same code runs on a CPU with a tiny model.
"""

from __future__ import annotations

import torch

from m3lm.bench.report import Row, active_params, kv_bytes, parts_line, projection_ms, weights_bytes
from m3lm.bench.slice import RELEASE_DENSE, RELEASE_SPARSE, fill_cache, step_parts
from m3lm.bench.timing import graph_ms
from m3lm.cache import kv_cache
from m3lm.distributed.steps import Step
from m3lm.engine.cuda_graphs import DecodeGraphs
from m3lm.engine.drafter import DraftGraphs, DraftRows, EagleDrafter
from m3lm.engine.runner import forward_step, step_inputs
from m3lm.loader import random_weights_
from m3lm.models.eagle3 import Eagle3, EagleArgs, published_config
from m3lm.models.minimax_m3 import MiniMaxM3

RELEASE_LAYERS = RELEASE_DENSE + RELEASE_SPARSE
# The drafter's MLP width is not among its known shapes: 3 x hidden (18432 at 6144) puts it at
# the ~3.3 B parameters given for it.
DRAFTER_MLP_PER_HIDDEN = 3


def verify_inputs(
    model: MiniMaxM3, batch: int, ctx: int, k: int, seed: int = 1
) -> tuple[kv_cache.KVCache, Step]:
    """A paged cache filled with noise and the verification step of `batch` sequences at context
    ctx as the engine runs it: each sequence's positions ctx - 1 .. ctx + k - 1 (its last token
    and k drafts, random ids) are rows of one position over its table, every logits row kept.
    The pages are handed out in a shuffled order, as a server's pool has them after a while (so
    keys are gathered, not read through views); the last page is the spare one."""
    a, w = model.args, model.lm_head.weight
    pages = -(-(ctx + k) // a.index_block_size)
    cache = kv_cache.KVCache(a, batch * pages + 1, w.device, w.dtype)  # + the spare last page of decode rows
    fill_cache(cache, torch.Generator(device=w.device).manual_seed(seed))
    host = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch * pages, generator=host).tolist()
    tables = [order[i * pages : (i + 1) * pages] for i in range(batch)]
    n = batch * (k + 1)
    tokens = torch.randint(0, a.vocab_size, (n,), generator=host).tolist()
    starts = [ctx - 1 + i for _ in range(batch) for i in range(k + 1)]
    rows = [t for t in tables for _ in range(k + 1)]
    return cache, Step(tokens, [1] * n, starts, list(range(n)), rows)


@torch.inference_mode()
def bench_verify(model: MiniMaxM3, batch: int, ctx: int, k: int, iters: int, timer) -> Row:
    """The engine's verification step of `batch` sequences x k + 1 positions at context ctx (on a
    GPU the replay of its captured graph, `DecodeGraphs`; else `forward_step`), and its parts
    (`step_parts`, on a GPU each part a graph of its own, as the decode case's)."""
    cache, step = verify_inputs(model, batch, ctx, k)
    n = batch * (k + 1)
    tokens, fb, _ = step_inputs(model, cache, step, None)
    if tokens.is_cuda:
        graphs = DecodeGraphs(model, cache, n, len(step.tables[0]), cache.num_pages - 1)
        graphs.run(step.tokens, step.starts, step.tables)
        ms = timer(graphs._graphs[graphs.bucket(n)][0].replay, iters)
        del graphs
        fb.decode.rope(model.args.rotary_dim, model.args.rope_theta)  # made once outside the graphs
        parts = step_parts(model, tokens, fb.decode, graph_ms, iters)
    else:
        ms = timer(lambda: forward_step(model, cache, step, None), iters)
        parts = step_parts(model, tokens, fb, timer, iters)
    floor = weights_bytes(model, n) + kv_bytes(model, batch, ctx + k)
    return Row(
        f"verify B={batch} x {k + 1} ctx={ctx}", ms, n, floor, 2 * active_params(model) * n, parts=parts
    )


def experts_read(model: MiniMaxM3, tokens: int) -> float:
    """Routed experts a MoE layer is expected to read for `tokens` tokens routed at random (what
    `weights_bytes` counts)."""
    a = model.args
    return a.num_local_experts * (1 - (1 - a.num_experts_per_tok / a.num_local_experts) ** tokens)


def drafter_config(target, kv_heads: int) -> dict:
    """The published drafter's config.json for a target of ModelArgs `target`: one layer at its
    hidden size, heads and head dim, its full vocabulary (own embedding and lm_head), RMS norms of
    the captured states (`fc_norm`) and the final norm fed back (`norm_output`)."""
    c = published_config(
        hidden_size=target.hidden_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=target.head_dim,
        intermediate_size=DRAFTER_MLP_PER_HIDDEN * target.hidden_size,
        vocab_size=target.vocab_size,
        layer_ids=[2, 30, 57],  # of the release's 60 layers
    )
    c["eagle_config"] |= {"fc_norm": True, "norm_output": True}
    return c


def build_drafter(model: MiniMaxM3, kv_heads: int, seed: int = 0) -> Eagle3:
    """A drafter of `drafter_config` with random weights (`random_weights_`), made on the model's
    device in its lm_head's dtype, beside it."""
    w = model.lm_head.weight
    a = EagleArgs.from_dict(drafter_config(model.args, kv_heads), RELEASE_LAYERS, "drafter_config")
    with torch.device("meta"):
        head = Eagle3(a, w.dtype)
    head = random_weights_(head.to_empty(device=w.device), seed)
    head.d2t.zero_()  # its own full vocabulary: no id mapping
    head.bind(model)
    return head.eval().requires_grad_(False)


def drafter_sizes(head: Eagle3) -> tuple[int, int, int]:
    """Parameters of (fc and its norms, the layer and final norm, lm_head): what one drafting
    call reads once, at every draft step, at every drafted token."""
    fc = sum(p.numel() for n, p in head.named_parameters() if n.startswith("fc"))
    layer = sum(p.numel() for n, p in head.named_parameters() if n.startswith(("midlayer", "norm")))
    return fc, layer, head.lm_head.weight.numel()


@torch.inference_mode()
def bench_draft(model: MiniMaxM3, head: Eagle3, batch: int, ctx: int, k: int, iters: int, timer) -> Row:
    """The engine's drafting of `batch` sequences at context ctx after a step that accepted every
    draft (`EagleDrafter.draft_rows`: the k + 1 positions ctx - 1 .. ctx + k - 1 taken in from
    their captured target states, then k drafts, every sequence at once; on a GPU the replay of
    its captured graph, `DraftGraphs`), with parts: the fc over the captured states of those
    positions, and one draft step at one position of each sequence (layer, lm_head, argmax)."""
    t, a, w = model.args, head.args, head.fc.weight
    s = t.index_block_size
    pages = -(-(ctx + 2 * k) // s)
    drafter = EagleDrafter(head, batch * pages + 1, s, w.device)
    gen = torch.Generator(device=w.device).manual_seed(2)
    drafter.k.normal_(generator=gen)
    drafter.v.normal_(generator=gen)
    host = torch.Generator().manual_seed(2)
    start = ctx - 1
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    hidden = torch.randn(batch * (k + 1), 3 * a.target_hidden_size, device=w.device, generator=gen).to(
        w.dtype
    )
    rows = [
        DraftRows(
            table,
            start,
            torch.randint(0, t.vocab_size, (k + 1,), generator=host).tolist(),
            b * (k + 1),
            k + 1,
        )
        for b, table in enumerate(tables)
    ]
    if w.is_cuda:
        drafter.graphs = DraftGraphs(drafter, batch, pages, k)
        drafter.graphs.capture(batch)
    ms = timer(lambda: drafter.draft_rows(rows, hidden, k), iters)
    feat = head.features(hidden)[: batch * (k + 1) : k + 1]  # [B, C]
    token = torch.zeros(batch, dtype=torch.long, device=w.device)
    pos = torch.full((batch,), ctx + k, device=w.device)
    tabs = torch.tensor(tables, dtype=torch.int32, device=w.device)
    keep = torch.ones(batch, dtype=torch.bool, device=w.device)
    part_timer = graph_ms if w.is_cuda else timer
    parts = {
        "fc": part_timer(lambda: head.features(hidden), iters),
        "step": part_timer(
            lambda: head.logits(drafter.paged_step(token, feat, pos, tabs, keep)[1]).argmax(-1), iters
        ),
    }
    fc, layer, lm_head = drafter_sizes(head)
    elem = w.element_size()
    kv_read = batch * k * ctx * 2 * a.num_key_value_heads * a.head_dim * elem  # each draft step's keys
    floor = (fc + k * (layer + lm_head)) * elem + kv_read  # weights once a draft step, for all B
    flops = 2 * batch * ((k + 1) * fc + 2 * k * layer + k * lm_head)
    case = f"draft B={batch} k={k} ctx={ctx} ({a.num_key_value_heads} KV heads)"
    return Row(case, ms, batch * k, floor, flops, parts=parts)


def draft_line(row: Row, batch: int, k: int) -> str:
    p = row.parts
    return (
        f"{row.case}: {row.ms:.3f} ms for the {batch} sequences, {row.ms / batch:.3f} ms a sequence, "
        f"{row.ms / (batch * k):.3f} ms a drafted token, {row.ms / k:.3f} ms a draft position (every "
        f"sequence at once: the k + 1 positions of a step that accepted every draft taken in, then "
        f"k drafts); fc over the 3 captured states of k + 1 positions a sequence {p['fc']:.3f} ms; "
        f"one draft step at one position a sequence (layer, lm_head, argmax) {p['step']:.3f} ms"
    )


def speedup(batch: int, accept: float, decode_ms: float, verify_ms: float, draft_ms: float):
    """(tok/s with speculation, tok/s of plain decoding, their ratio): with speculation a step
    emits `accept` tokens a sequence for the drafting of all `batch` sequences (`draft_ms`) and one
    verify step; plain decoding one token a sequence for one decode step."""
    spec = batch * accept / (draft_ms + verify_ms) * 1e3
    plain = batch / decode_ms * 1e3
    return spec, plain, spec / plain


def projection_line(case: str, batch: int, accepts, decode_ms: float, verify_ms: float, drafting) -> str:
    """One line of the 60-layer projection: `drafting` is (what drafts, its measured ms)."""
    who, draft_ms = drafting
    _, plain, _ = speedup(batch, 1.0, decode_ms, verify_ms, draft_ms)
    at = []
    for acc in accepts:
        spec, _, ratio = speedup(batch, acc, decode_ms, verify_ms, draft_ms)
        at.append(
            f"L = {acc:g}: {batch} x {acc:g} tokens / ({draft_ms:.2f} + {verify_ms:.2f}) ms = "
            f"{spec:,.0f} tok/s, {ratio:.2f}x"
        )
    return (
        f"{case}, speculation with {who}: 60-layer projection; plain decode step {decode_ms:.2f} ms "
        f"= {plain:,.0f} tok/s and verify step {verify_ms:.2f} ms (both projected from this slice's "
        f"parts), drafting {draft_ms:.2f} ms (measured at full size); at mean acceptance length "
        + "; ".join(at)
    )


def draft_cases(model: MiniMaxM3, args, timer) -> tuple[list[Row], list[str], dict]:
    """The drafter case for each KV head count in `args.drafter` and each (B, ctx) of
    `args.verify`: rows, notes, and {(kv heads, B, ctx): ms} for the projection."""
    rows, notes, drafts = [], [], {}
    k = args.num_spec_tokens
    for kv in args.drafter:
        head = build_drafter(model, kv)
        for b, ctx in args.verify:
            rows.append(bench_draft(model, head, b, ctx, k, args.iters, timer))
            drafts[(kv, b, ctx)] = rows[-1].ms
            print(" | ".join(rows[-1].cells()), flush=True)
            notes.append(draft_line(rows[-1], b, k))
            print(notes[-1], flush=True)
        del head
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows, notes, drafts


def verify_cases(model: MiniMaxM3, args, decode_parts: dict, drafts: dict, tag: str, timer):
    """The verify case for each (B, ctx) of `args.verify` and its 60-layer projection against the
    decode case's (`decode_parts` {(B, ctx): parts}), with no drafting time (an upper bound;
    prompt lookup's drafting is host work) and with each drafter of `drafts`."""
    rows, notes = [], []
    k = args.num_spec_tokens
    for b, ctx in args.verify:
        row = bench_verify(model, b, ctx, k, args.iters, timer)
        row.case += tag
        rows.append(row)
        print(" | ".join(row.cells()), flush=True)
        notes.append(parts_line(row.case, row.ms, row.parts, len(model.model.layers)))
        decode_ms, verify_ms = projection_ms(decode_parts[(b, ctx)]), projection_ms(row.parts)
        ways = [("no drafting time (an upper bound)", 0.0)]
        ways += [
            (f"the {kv}-KV-head drafter", ms) for (kv, db, dc), ms in drafts.items() if (db, dc) == (b, ctx)
        ]
        case = f"B={b} ctx={ctx} k={k}{tag}"
        notes.append(
            f"{row.case}: a MoE layer reads {experts_read(model, b * (k + 1)):.1f} routed experts for the "
            f"{b * (k + 1)} rows (a decode step of B={b}: {experts_read(model, b):.1f}), and the shared one"
        )
        notes += [projection_line(case, b, args.acceptance, decode_ms, verify_ms, w) for w in ways]
        print("\n".join(notes[-2 - len(ways) :]), flush=True)
    return rows, notes
