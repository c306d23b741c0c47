"""Compile every Triton kernel variant and capture every decode graph before serving.

A kernel compiles once per specialisation (`kernels.compiles`). Every argument that changes
with the batch is either a runtime argument (`do_not_specialize`: token counts, lengths,
positions, strides of per-step buffers) or a constexpr taken from a small finite set, and every
launch choice on the step's size is a threshold at a power of two. So the variants a serving
step can need are named by a few keys, and one step of each key compiles them all:

- tokens of the step, T (norms, projections, MoE, FP8 products): `token_key` (T's and T x A's
  power-of-two buckets; A experts per token), one single-sequence prefill per key up to
  `max_num_batched_tokens`, and one decode step per key up to `max_num_seqs` (decode batches
  above the largest graph, or with graphs off, run eagerly);
- key blocks of a sequence on MSA's sparse path, N (block selection, tile unions): `pad(N)`,
  one two-token step at the end of a sequence of each bucket up to `max_model_len`, its earlier
  positions taken as cached (their keys are whatever the pool holds: only shapes matter here);
- a chunk after a cached prefix (the Triton prefill kernel without a selection);
- every CUDA-graph batch bucket (`DecodeGraphs.capture_all`), and an EAGLE-3 drafter's
  (`DraftGraphs.capture_all`); with speculation a decode step has a row a verified position;
- structured output's mask (xgrammar's Triton kernel): one row, two rows and sixteen, the classes
  Triton specialises its row count on.

The sequences are throwaway: their pages come from the block manager and go back unnamed, so
nothing of the warm-up counts as a cached prefix. Triton's on-disk cache (~/.triton/cache) keeps
the compiled binaries, so a restart loads instead of compiling.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from m3lm.core import SamplingParams
from m3lm.engine.sequence import Sequence
from m3lm.kernels.compiles import compiled_variants

log = logging.getLogger("m3lm.engine")


@dataclass(frozen=True)
class StepShape:
    """One warm-up step: `batch` sequences, each computing `new` positions after `cached` ones."""

    kind: str  # "prefill" | "extend" | "long" | "decode"
    batch: int
    new: int
    cached: int = 0

    @property
    def positions(self) -> int:
        return self.cached + self.new


@dataclass
class WarmupReport:
    seconds: float = 0.0
    steps: int = 0
    variants: int = 0  # kernel variants compiled (or loaded from the disk cache) during the warm-up
    graphs: int = 0  # decode graphs captured
    skipped: int = 0  # planned steps the pool had no room for


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def token_key(t: int, top_k: int) -> tuple:
    """What the launches of a step of t tokens depend on: the power-of-two bucket of t and of its
    t x top_k token-expert pairs, and whether each is a power of two itself. Every size threshold
    of the kernels' wrappers is a power of two (t <= 16 GEMV rows, t < 1024 dequantised products,
    pairs <= 8 or <= 256, tile tables at 16, 64, 128, 1024 ...), and on either side of one the keys
    differ, so two counts with one key launch the same variants."""
    return tuple((_pow2(n), _pow2(n) == n) for n in (t, t * top_k))


def representatives(limit: int, key) -> list[int]:
    """The smallest n in 1..limit of each distinct key(n), ascending."""
    seen: dict[object, int] = {}
    for n in range(1, limit + 1):
        seen.setdefault(key(n), n)
    return sorted(seen.values())


def block_buckets(max_model_len: int, page_size: int, topk_blocks: int) -> list[int]:
    """Sequence lengths, one per power-of-two bucket of key blocks N = ceil(len / S) that MSA's
    sparse path sees (N > topk: fewer blocks than k are taken whole, with no selection); the
    shortest length of each bucket, within max_model_len."""
    n_max = -(-max_model_len // page_size)
    firsts: dict[int, int] = {}
    for n in range(topk_blocks + 1, n_max + 1):
        firsts.setdefault(_pow2(max(n, 16)), n)
    return [min(n * page_size, max_model_len) for n in sorted(firsts.values())]


def warmup_plan(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    topk_blocks: int,
    top_k: int,
) -> list[StepShape]:
    """The steps that reach every bucket a serving step can hit under these limits (pure)."""
    plan = []
    longest = min(max_num_batched_tokens, max_model_len - 1)  # a prompt leaves room for a token
    for t in representatives(longest, lambda n: token_key(n, top_k)):
        plan.append(StepShape("prefill", 1, t))
    if page_size + 2 <= max_model_len:
        plan.append(StepShape("extend", 1, 2, page_size))  # a chunk after cached keys
    for length in block_buckets(max_model_len, page_size, topk_blocks):
        plan.append(StepShape("long", 1, 2, length - 2))
    if max_model_len >= 2:
        for b in representatives(max_num_seqs, lambda n: token_key(n, top_k)):
            plan.append(StepShape("decode", b, 1, 1))
    return plan


def _throwaway(seq_id: int, shape: StepShape, vocab: int) -> Sequence:
    ids = [(7 + 31 * i) % vocab for i in range(shape.positions)]
    seq = Sequence(seq_id, f"warmup-{-seq_id}", ids, SamplingParams(max_tokens=1), output_limit=1)
    seq.num_cached = shape.cached
    return seq


def _run_shape(engine, shape: StepShape, next_id: int) -> bool:
    """Run one step of `shape` on throwaway sequences; False when the pool has no room for it."""
    blocks = engine.blocks
    seqs = [_throwaway(next_id - i, shape, engine.model.args.vocab_size) for i in range(shape.batch)]
    try:
        if not all(blocks.ensure(s.seq_id, s.num_tokens) for s in seqs):
            return False
        engine.runner.run([(s, shape.new) for s in seqs], [blocks.table(s.seq_id) for s in seqs])
        return True
    finally:
        for s in seqs:
            blocks.free(s.seq_id, keep=False)  # unnamed: back to the free pages, never a cached prefix


def _warm_mask(engine) -> None:
    import xgrammar as xgr

    vocab = engine.model.args.vocab_size
    logits = torch.zeros(16, vocab, device=engine.device)  # the step's logits are fp32
    bitmask = xgr.allocate_token_bitmask(16, vocab).to(engine.device)
    for rows in (1, 2, 16):
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(rows)))


def warm_up(engine, progress: bool = True) -> WarmupReport:
    """Run `engine`'s runner over every step shape of `warmup_plan` and capture every decode graph,
    before any request (the warm-up takes pages from the block manager and gives them back). On
    the CPU: the compiled decode step's graphs (`EngineConfig.cpu_compile`), else nothing."""
    if engine.device.type != "cuda":
        return _warm_cpu(engine)
    cfg, args = engine.config, engine.model.args
    spec = cfg.speculative_config
    plan = warmup_plan(
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)),  # a decode row a position
        engine.max_model_len,
        engine.blocks.page_size,
        args.index_topk_blocks,
        args.num_experts_per_tok,
    )
    graphs = engine.runner.graphs
    drafter = engine.speculator.drafter if engine.speculator is not None else None
    drafts = drafter.graphs if drafter is not None else None
    n_graphs = len(graphs.buckets) if graphs is not None else 0
    report = WarmupReport()
    start, before = time.perf_counter(), compiled_variants()
    with tqdm(total=n_graphs + len(plan), desc="warm-up", file=sys.stderr, disable=not progress) as bar:
        if graphs is not None:
            report.graphs = len(graphs.capture_all(lambda b: bar.update()))
            bar.update(n_graphs - report.graphs)  # buckets captured before
        if drafts is not None:
            report.graphs += len(drafts.capture_all())
        next_id = -1  # below every engine sequence id
        for shape in plan:
            bar.set_postfix_str(f"{shape.kind} {shape.batch}x{shape.new}+{shape.cached}")
            if _run_shape(engine, shape, next_id):
                report.steps += 1
            else:
                report.skipped += 1
                log.warning("warm-up: no room in the KV pool for %s", shape)
            next_id -= shape.batch
            bar.update()
    if engine.grammars is not None:
        _warm_mask(engine)
    torch.cuda.synchronize(engine.device)
    report.seconds = time.perf_counter() - start
    report.variants = compiled_variants() - before
    log.info(
        "warm-up: %.1f s, %d steps, %d kernel variants compiled or loaded, %d decode graphs captured",
        report.seconds,
        report.steps,
        report.variants,
        report.graphs,
    )
    return report


def _warm_cpu(engine) -> WarmupReport:
    report, graphs = WarmupReport(), engine.runner.graphs
    if graphs is None:
        return report
    start = time.perf_counter()
    report.graphs = len(graphs.capture_all())
    report.seconds = time.perf_counter() - start
    log.info("warm-up: %.1f s, %d compiled decode graphs", report.seconds, report.graphs)
    return report
