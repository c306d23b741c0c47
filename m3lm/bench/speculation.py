"""`m3lm bench --verify` and `--drafter`: what speculative decoding costs at the release's
dimensions, and what it gives the 60-layer model.

verify: the engine's verification forward (`runner.forward_step` of a step in which every
sequence computes k + 1 positions, its last token and k drafts, each selecting its own MSA
blocks) over a paged cache filled to the context, run eagerly as the engine runs it; with the
step's parts as the decode case has them (`step_parts`), so that the 60-layer verify step can
be projected as the decode step is.

drafter: a randomly initialised EAGLE-3 drafter at the published shapes (`drafter_config`, built
on the device without a checkpoint), timed as the engine drafts: `EagleDrafter.draft` for each of
the B sequences in turn, taking in the k + 1 positions of a step that accepted every draft and
then drafting k tokens; with its parts (the fc over the three captured states, one draft step).

projection: a step with speculation emits L tokens a sequence on average (the mean acceptance
length) for the drafting and one verify step; plain decoding emits one for one decode step.

Each case takes the model it times (the release slice on a GPU, a small one on the CPU) and a
timer `timer(fn, iters) -> ms`, so that the same code runs on a CPU with a tiny model.
"""

from __future__ import annotations

import torch

from m3lm.bench.report import Row, active_params, kv_bytes, parts_line, projection_ms, weights_bytes
from m3lm.bench.slice import RELEASE_DENSE, RELEASE_SPARSE, fill_cache, step_parts
from m3lm.cache import kv_cache
from m3lm.core import SamplingParams
from m3lm.distributed.steps import Step
from m3lm.engine.runner import forward_step, step_inputs
from m3lm.engine.sequence import Sequence
from m3lm.engine.speculation import EagleDrafter
from m3lm.loader import random_weights_
from m3lm.models.minimax_m3 import MiniMaxM3
from m3lm.speculative.eagle import Eagle3, EagleArgs, published_config

RELEASE_LAYERS = RELEASE_DENSE + RELEASE_SPARSE
# The drafter's MLP width is not among its known shapes: 3 x hidden (18432 at 6144) puts it at
# the ~3.3 B parameters given for it.
DRAFTER_MLP_PER_HIDDEN = 3


def verify_inputs(
    model: MiniMaxM3, batch: int, ctx: int, k: int, seed: int = 1
) -> tuple[kv_cache.KVCache, Step]:
    """A paged cache filled with noise and the verification step of `batch` sequences at context
    ctx: each computes positions ctx - 1 .. ctx + k - 1 (its last token and k drafts, random ids),
    every logits row kept. The pages are handed out in a shuffled order, as a server's pool has
    them after a while (so keys are gathered, not read through views)."""
    a, w = model.args, model.lm_head.weight
    pages = -(-(ctx + k) // a.index_block_size)
    cache = kv_cache.KVCache(a, batch * pages + 1, w.device, w.dtype)  # + the spare last page of decode rows
    fill_cache(cache, torch.Generator(device=w.device).manual_seed(seed))
    host = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch * pages, generator=host).tolist()
    tables = [order[i * pages : (i + 1) * pages] for i in range(batch)]
    n = batch * (k + 1)
    tokens = torch.randint(0, a.vocab_size, (n,), generator=host).tolist()
    return cache, Step(tokens, [k + 1] * batch, [ctx - 1] * batch, list(range(n)), tables)


@torch.inference_mode()
def bench_verify(model: MiniMaxM3, batch: int, ctx: int, k: int, iters: int, timer) -> Row:
    """The engine's verification step (`forward_step`, the dense window off as by default) of
    `batch` sequences x k + 1 positions at context ctx, and its parts (`step_parts`)."""
    cache, step = verify_inputs(model, batch, ctx, k)
    ms = timer(lambda: forward_step(model, cache, step, None), iters)
    tokens, fb, _ = step_inputs(model, cache, step, None)
    parts = step_parts(model, tokens, fb, timer, iters)
    n = batch * (k + 1)
    floor = weights_bytes(model, n) + kv_bytes(model, batch, ctx + k)
    return Row(
        f"verify B={batch} x {k + 1} ctx={ctx}", ms, n, floor, 2 * active_params(model) * n, parts=parts
    )


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
    """The engine's drafting of `batch` sequences at context ctx (`EagleDrafter.draft` for each
    in turn: the k + 1 positions ctx - 1 .. ctx + k - 1 taken in from their captured target
    states, then k drafts), with parts: the fc over the captured states of those positions, and
    one draft step at one position (layer, lm_head, argmax)."""
    t, a, w = model.args, head.args, head.fc.weight
    s = t.index_block_size
    pages = -(-(ctx + k + 1) // s)
    drafter = EagleDrafter(head, batch * pages, s, w.device)
    gen = torch.Generator(device=w.device).manual_seed(2)
    drafter.k.normal_(generator=gen)
    drafter.v.normal_(generator=gen)
    host = torch.Generator().manual_seed(2)
    start, cached = ctx - 1, ctx + k
    seqs = [
        Sequence(i, str(i), torch.randint(0, t.vocab_size, (cached + 1,), generator=host).tolist(),
                 SamplingParams(), max_tokens=1 << 20, num_cached=cached)
        for i in range(batch)
    ]  # fmt: skip
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    hidden = torch.randn(k + 1, 3 * a.target_hidden_size, device=w.device, generator=gen).to(w.dtype)

    def draft_all():
        for seq, table in zip(seqs, tables, strict=True):
            drafter.draft(seq, table, hidden, start, k)

    ms = timer(draft_all, iters)
    feat = head.features(hidden)[-1:]
    token = torch.zeros(1, dtype=torch.long, device=w.device)
    pos = torch.tensor([cached], device=w.device)
    past = (kv_cache.rows(drafter.k, tables[0], cached), kv_cache.rows(drafter.v, tables[0], cached))
    parts = {
        "fc": timer(lambda: head.features(hidden), iters),
        "step": timer(lambda: head.logits(head.step(token, feat, pos, past)[1]).argmax(-1), iters),
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
        f"{row.ms / (batch * k):.3f} ms a drafted token (the engine drafts each sequence in turn, "
        f"taking in the k + 1 positions of a step that accepted every draft); fc over the 3 captured "
        f"states of k + 1 positions {p['fc']:.3f} ms; one draft step at one position (layer, "
        f"lm_head, argmax) {p['step']:.3f} ms"
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
        notes += [projection_line(case, b, args.acceptance, decode_ms, verify_ms, w) for w in ways]
        print("\n".join(notes[-1 - len(ways) :]), flush=True)
    return rows, notes
