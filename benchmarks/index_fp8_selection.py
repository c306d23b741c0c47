"""Effect of the FP8 index-key cache on MSA block selection, on real text (CPU).

The embedded story model (MSA block 16, top-8 blocks: sparse past 128 tokens) reads stories
from ../shared/data through the paged caches twice: index keys kept in fp32, then in e4m3 with
one fp32 scale per token (`EngineConfig.index_cache_fp8`). Every selection the sparse layers
make is recorded; reported: the fraction of (layer, index head, query) selections that are
identical as sets (all queries, and only those past the dense prefix), the mean overlap of the
selected blocks, and how often the next-token argmax agrees. It is end to end: a layer's
different selection also changes the inputs of the layers after it.

    python benchmarks/index_fp8_selection.py [--tokens 2048] [--seqs 4] [--out benchmarks/results/index_fp8_selection.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import m3lm
from m3lm.bench import report
from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.core import ForwardBatch
from m3lm.models import minimax_m3

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories-cased.txt"
MOJIBAKE = {"â€™": "'", "â€œ": '"', "â€\x9d": '"', "â€": '"'}


def stories_ids(tokenizer, n_tokens: int, n_seqs: int) -> list[list[int]]:
    """n_seqs windows of n_tokens consecutive tokens of real text (stories joined by blank lines)."""
    text = DATA.read_text(encoding="utf-8")
    for bad, good in MOJIBAKE.items():
        text = text.replace(bad, good)
    ids = tokenizer.encode(text[: 6 * n_tokens * n_seqs], parse_special=False)
    assert len(ids) >= n_tokens * n_seqs, "not enough text"
    return [ids[i * n_tokens : (i + 1) * n_tokens] for i in range(n_seqs)]


def run(model, ids: list[int], index_fp8: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Selections [K, T, k] of every sparse layer (in call order) and the argmax logits [T]."""
    a = model.args
    pages = -(-len(ids) // a.index_block_size)
    cache = KVCache(a, pages, "cpu", torch.float32, index_fp8=index_fp8)
    picks = []
    select = minimax_m3.msa_select_ref

    def recording(*args):
        out = select(*args)
        picks.append(out.sort(-1).values if out is not None else None)
        return out

    minimax_m3.msa_select_ref = recording
    try:
        pos = torch.arange(len(ids))
        batch = ForwardBatch(pos, [len(ids)], kv=PagedKV(cache, [list(range(pages))], [0], [len(ids)]))
        with torch.inference_mode():
            logits = model.forward_batch(torch.tensor(ids), batch)
    finally:
        minimax_m3.msa_select_ref = select
    return picks, logits.argmax(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, tok = m3lm.load(m3lm.DEFAULT_MODEL, device="cpu", dtype="float32")
    a = model.args
    dense_prefix = a.index_topk_blocks * a.index_block_size
    same = total = same_sparse = total_sparse = 0
    overlap, agree = [], []
    for ids in stories_ids(tok, args.tokens, args.seqs):
        ref, ref_next = run(model, ids, False)
        got, got_next = run(model, ids, True)
        for r, g in zip(ref, got, strict=True):
            if r is None:  # every query sees at most top-k blocks: dense in both runs
                continue
            eq = (r == g).all(-1)  # [K, T]
            same, total = same + int(eq.sum()), total + eq.numel()
            same_sparse += int(eq[:, dense_prefix:].sum())
            total_sparse += eq[:, dense_prefix:].numel()
            hits = (r[..., :, None] == g[..., None, :]).any(-1) & (r >= 0)
            overlap.append(float(hits.sum() / (r >= 0).sum()))
        agree.append(float((ref_next == got_next).float().mean()))
    lines = [
        "| measure | value |",
        "|---|---|",
        f"| identical selections, all queries | {same / total:.4f} ({same} of {total}) |",
        f"| identical selections, queries past the dense prefix ({dense_prefix} tokens) | "
        f"{same_sparse / total_sparse:.4f} ({same_sparse} of {total_sparse}) |",
        f"| selected blocks shared (mean over layers and sequences) | {sum(overlap) / len(overlap):.4f} |",
        f"| next-token argmax agreement | {sum(agree) / len(agree):.4f} |",
    ]
    body = "\n".join(lines)
    print(body)
    if args.out:
        details = [
            f"Device: {report.machine()}, torch {torch.__version__}",
            f"Model: embedded story model ({sum(a.sparse_layers)} sparse layers, block {a.index_block_size}, "
            f"top-{a.index_topk_blocks}); text: {args.seqs} windows of {args.tokens} tokens of {DATA.name}; "
            "reference: index keys in fp32.",
        ]
        cmd = "python benchmarks/index_fp8_selection.py " + " ".join(sys.argv[1:])
        report.append_section(
            Path(args.out), "FP8 index-key cache: effect on MSA block selection", cmd, details, body
        )


if __name__ == "__main__":
    main()
