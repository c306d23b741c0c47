"""Evaluate an exported story checkpoint through m3lm's inference path: perplexity with MSA and
dense, how well the trained indexer finds the attention mass, and a few sampled stories.

- Perplexity on consecutive `--seq-len`-token windows of the validation stream (longer than the
  top-k x block-size dense window, so most positions are sparse), once with MSA (the default
  forward) and once with every sparse layer attending densely (`msa_dense_window=1e9`), same
  weights. Positions inside the dense window are identical in both; the table also gives the
  perplexity of the positions past it.
- Attention mass: for every sparse layer, query past the dense window and KV group, the fraction
  of the dense attention probability (averaged over the group's heads) that falls in the blocks
  the indexer selects (`msa_select_ref`), in as many randomly chosen visible blocks, and in the
  best possible choice (the top blocks by that mass). All three keep the forced local block;
  "local block" is the mass in that block alone. The inputs of each sparse layer are captured
  with a hook during the MSA forward, so they are the hidden states the sparse model computes.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

import m3lm
from m3lm.kernels.msa import msa_select_ref, select_blocks_ref
from m3lm.layers.batch import ForwardBatch
from m3lm.models.minimax_m3 import Attention, MiniMaxM3

SELECTIONS = ("indexer", "random", "oracle", "local block")


def block_mass(
    attn: Attention, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense attention mass per key block [K, T, N] (mean over each group's heads) and the indexer's
    selection [K, T, k] for one sequence whose layer input is x [T, C]."""
    t = x.shape[0]
    block = attn.msa[0]
    q, k, _, iq, ik = attn.project(x, cos, sin)  # [T, H, D], [T, K, D], -, [T, K, Di], [T, Di]
    qg = q.float().unflatten(1, (attn.n_kv, -1))  # [T, K, G, D]
    s = torch.einsum("tkgd,jkd->kgtj", qg, k.float()) * attn.scale  # [K, G, T, T]
    s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).mean(1)  # [K, T, T]
    n = -(-t // block)
    mass = torch.nn.functional.pad(p, (0, n * block - t)).unflatten(-1, (n, block)).sum(-1)  # [K, T, N]
    return mass, msa_select_ref(iq, ik, pos, *attn.msa)


def selected_mass(mass: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mass [K, T] in the selected blocks ids [K, T, k] (-1 = unused slot)."""
    return (mass.gather(-1, ids.clamp(min=0)) * (ids >= 0)).sum(-1)


class MassProbe:
    """Forward pre-hooks on the sparse attention layers; accumulates the mass fractions per layer."""

    def __init__(self, model: MiniMaxM3, seed: int):
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.handles = [
            layer.self_attn.register_forward_pre_hook(self._hook)
            for layer in model.model.layers
            if layer.self_attn.sparse
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    @torch.no_grad()
    def _hook(self, attn: Attention, inputs: tuple) -> None:
        x, batch, *rope = inputs
        cos, sin = rope if rope and rope[0] is not None else batch.rope(*attn.rotary)
        block, topk, local, init = attn.msa
        start = 0
        for n in batch.q_lens:
            rows = slice(start, start + n)
            start += n
            pos = batch.positions[rows]
            mass, ids = block_mass(attn, x[rows], pos, cos[rows], sin[rows])
            if ids is None:
                continue  # every query within the dense window: nothing is selected
            rand = torch.rand(mass.shape, generator=self.gen).to(mass.device)
            local_only = pos[None, :, None] // block - torch.arange(local, device=pos.device)  # [1, T, local]
            picks = (
                ids,
                select_blocks_ref(rand, pos, block, topk, local, init),
                select_blocks_ref(mass, pos, block, topk, local, init),
                local_only.expand(ids.shape[0], -1, -1),
            )
            sparse = pos >= topk * block  # queries that see more than top-k blocks
            fractions = torch.stack([selected_mass(mass, p)[:, sparse].sum() for p in picks])
            i = attn.layer_idx
            self.sums[i] = self.sums.get(i, 0) + fractions.double().cpu()
            self.counts[i] = self.counts.get(i, 0) + int(sparse.sum()) * mass.shape[0]


def nll(model: MiniMaxM3, windows: torch.Tensor, dense: bool) -> torch.Tensor:
    """Per-position negative log-likelihood [W, T] of windows [W, T+1] through `forward_batch`."""
    w, t = windows.shape[0], windows.shape[1] - 1
    positions = torch.arange(t, device=windows.device).repeat(w)
    # msa_dense_window = 1e9: every sparse layer attends to all earlier tokens (indexer bypassed).
    batch = ForwardBatch(positions, [t] * w, msa_dense_window=1e9 if dense else None)
    logits = model.forward_batch(windows[:, :-1].flatten(), batch)  # [W*T, V] fp32
    logp = torch.log_softmax(logits, dim=-1).gather(-1, windows[:, 1:].flatten()[:, None])
    return -logp.view(w, t)


def evaluate(a: argparse.Namespace) -> str:
    """Run every measurement and return the Markdown report."""
    start = time.perf_counter()
    model, tok = m3lm.load(a.checkpoint, device=a.device, dtype=a.dtype)
    args = model.args
    dense_window = args.dense_window
    val = torch.from_numpy(np.load(a.data / "val.npy").astype(np.int64))
    n = min(a.windows, (val.numel() - 1) // a.seq_len)
    idx = torch.arange(n)[:, None] * a.seq_len + torch.arange(a.seq_len + 1)
    windows = val[idx].to(a.device)  # [W, T+1]

    probe = MassProbe(model, a.seed)
    sparse_nll, dense_nll = [], []
    with torch.inference_mode():
        for s in range(0, n, a.batch):
            sparse_nll.append(nll(model, windows[s : s + a.batch], dense=False).cpu())
        probe.remove()
        for s in range(0, n, a.batch):
            dense_nll.append(nll(model, windows[s : s + a.batch], dense=True).cpu())
    sparse_nll, dense_nll = torch.cat(sparse_nll), torch.cat(dense_nll)

    lines = [
        f"# Story model evaluation: {a.checkpoint.name}",
        "",
        f"- command: `python3 {' '.join(shlex.quote(x) for x in sys.argv)}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- device: {_device_name(a.device)}, dtype {a.dtype}, torch {torch.__version__}",
        f"- {n} validation windows of {a.seq_len} tokens; MSA blocks of {args.index_block_size}, "
        f"top-{args.index_topk_blocks}, {args.index_local_blocks} local (dense window {dense_window} tokens)",
        "",
        "| attention | perplexity | perplexity, positions >= dense window |",
        "|---|---|---|",
    ]
    for name, v in (("MSA (trained indexer)", sparse_nll), ("dense (indexer bypassed)", dense_nll)):
        lines.append(f"| {name} | {v.mean().exp():.3f} | {v[:, dense_window:].mean().exp():.3f} |")
    lines += [
        "",
        "Fraction of the dense attention probability (per query past the dense window and KV group, "
        "averaged) inside the selected blocks; every selection keeps the forced local block.",
        "",
        "| layer | " + " | ".join(SELECTIONS) + " |",
        "|---|" + "---|" * len(SELECTIONS),
    ]
    total = 0
    for i in sorted(probe.sums):
        f = probe.sums[i] / probe.counts[i]
        total = total + f
        lines.append(f"| {i} | " + " | ".join(f"{v:.3f}" for v in f.tolist()) + " |")
    if probe.sums:
        mean = total / len(probe.sums)
        lines.append("| mean | " + " | ".join(f"**{v:.3f}**" for v in mean.tolist()) + " |")
    if tok is not None and a.samples:
        lines += [
            "",
            f"Samples from the BOS (generation_config defaults, {a.max_tokens} tokens at most):",
            "",
        ]
        for i in range(a.samples):
            r = m3lm.generate(model, tok, [tok.bos_token_id], max_tokens=a.max_tokens, seed=a.seed + i)
            text = r.text.strip().replace("\n", "\n> ")
            lines += [f"> {text}", f"> *({r.generation_tokens} tokens, {r.finish_reason})*", ""]
    lines.append(f"Evaluated in {time.perf_counter() - start:.1f} s.")
    return "\n".join(lines) + "\n"


def _device_name(device: str) -> str:
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return f"CPU ({torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--data", type=Path, required=True, help="prepare_data.py's output directory (val.npy)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--windows", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="windows per forward pass")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    a = p.parse_args(argv)
    report = evaluate(a)
    print(report)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(report)
    return report


if __name__ == "__main__":
    main()
