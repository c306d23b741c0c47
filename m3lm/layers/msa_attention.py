"""Attention of a layer's normed, rotated heads over the KV caches: dense causal on full-attention
layers, MSA (lightning-indexer block selection, then block-sparse attention) on sparse ones.

It owns the cache side: each sequence's keys (and index keys) joining its cache, the selection,
the opt-in dense window and the paged decode kernels. Shapes as in `models/minimax_m3.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from m3lm.config import MSAConfig
from m3lm.kernels.msa import msa_attention, msa_select
from m3lm.layers.batch import DecodeBatch, ForwardBatch


class MSAAttention(nn.Module):
    """No parameters: the projections, norms and RoPE are the model's (`Attention`)."""

    def __init__(self, layer_idx: int, scale: float, msa: MSAConfig | None):
        super().__init__()
        self.layer_idx, self.scale, self.msa = layer_idx, scale, msa  # msa None: a full-attention layer

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        iq: torch.Tensor | None,
        ik: torch.Tensor | None,
        batch: ForwardBatch | DecodeBatch,
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, K, D], index queries iq [T, K, Di] and keys ik [T, Di] (None on
        full-attention layers) -> [T, H, D]. On a decode step k, v and ik are None when they are
        already in the caches (`decode_heads`)."""
        if isinstance(batch, DecodeBatch):
            if k is not None:
                self._write_paged(k, v, ik, batch)
            return self._paged(q, iq, batch)  # [B, H, D]
        outs, start, dec = [], 0, batch.decode
        if dec is not None:  # the leading single-token sequences (a row each), batched
            start = b = dec.positions.shape[0]
            self._write_paged(k[:b], v[:b], None if ik is None else ik[:b], dec)
            outs.append(self._paged(q[:b], None if iq is None else iq[:b], dec))
        for seq, n in enumerate(batch.q_lens[start:], start):
            rows = slice(start, start + n)
            start += n
            pos = batch.positions[rows]
            first = batch.first_position(seq)  # host copy of pos[0]: no device read
            ks, vs = k[rows], v[rows]
            if batch.kv is not None:
                ks, vs = batch.kv.update(self.layer_idx, seq, ks, vs)  # [Tk, K, D]
            if self.msa is None:
                outs.append(msa_attention(q[rows], ks, vs, pos, self.scale, first=first))
                continue
            iks = ik[rows]
            if batch.kv is not None:
                # Index keys join the cache before scoring, so a query sees its own key.
                iks = batch.kv.update_index(self.layer_idx, seq, iks)  # [Tk, Di]
            outs.append(self._sparse(q[rows], ks, vs, pos, first, iq[rows], iks, batch.msa_dense_window))
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H, D]

    def _sparse(self, q, k, v, pos, first: int, iq, ik, dense_window: float | None) -> torch.Tensor:
        """MSA for one sequence's queries at consecutive positions from `first`.

        With the opt-in `dense_window` F, queries at t < F * topk * S attend densely.
        """
        block_size, topk = self.msa.block_size, self.msa.topk_blocks
        limit = int(dense_window * topk * block_size) if dense_window else 0
        n_dense = min(max(limit - first, 0), q.shape[0])  # a prefix of the queries
        if n_dense == q.shape[0]:
            return msa_attention(q, k, v, pos, self.scale, first=first)
        if n_dense:
            head = msa_attention(q[:n_dense], k, v, pos[:n_dense], self.scale, first=first)
            tail = self._sparse(q[n_dense:], k, v, pos[n_dense:], limit, iq[n_dense:], ik, None)
            return torch.cat([head, tail])
        block_ids = msa_select(iq, ik, pos, *self.msa, first=first)  # [K, n, k], or None when exactly dense
        return msa_attention(q, k, v, pos, self.scale, block_ids, block_size, first=first)

    def decode_heads(
        self, y: torch.Tensor, shape: tuple[int, int, int, int], norms: tuple, eps: float,
        cos: torch.Tensor, sin: torch.Tensor, dec: DecodeBatch,
    ) -> tuple | None:  # fmt: skip
        """A decode step's heads from the packed projections y [B, W] (GPU) in one launch: every
        head normed and rotated, k, v and the index key written into the caches -> (q [B, H, D],
        None, None, iq [B, K, Di] or None, None), as `forward` takes them. None where the caches
        do not take it (not on the GPU, another cache dtype, an FP8 index cache): the caller
        then makes the heads itself.
        `shape`: (H, K, D, Di or 0 on full-attention layers); `norms`: the q, k (iq, ik) norm weights."""
        cache, layer = dec.cache, self.layer_idx
        if not y.is_cuda or cache.k[layer].dtype != y.dtype or layer in cache.ik_scale:
            return None
        from m3lm.kernels import fused

        q, iq = fused.decode_heads(
            y, shape, norms, eps, cos, sin,
            cache.k[layer], cache.v[layer], cache.ik.get(layer), dec.pages, dec.slots,
        )  # fmt: skip
        return q, None, None, iq, None

    def _write_paged(
        self, k: torch.Tensor, v: torch.Tensor, ik: torch.Tensor | None, dec: DecodeBatch
    ) -> None:
        """k, v [B, K, D] and the index keys [B, Di] of B new tokens into the caches at dec's slots."""
        cache, layer = dec.cache, self.layer_idx
        cache.k[layer][dec.pages, dec.slots] = k.to(cache.k[layer].dtype)
        cache.v[layer][dec.pages, dec.slots] = v.to(cache.v[layer].dtype)
        if self.msa is not None:
            cache.write_index(layer, (dec.pages, dec.slots), ik)

    def _paged(self, q: torch.Tensor, iq: torch.Tensor | None, dec: DecodeBatch) -> torch.Tensor:
        """Attention of B new tokens q [B, H, D] (index queries iq [B, K, Di]) over the paged
        caches, their own keys already there (Triton kernels on the GPU, batched PyTorch ops on
        the CPU) -> [B, H, D]."""
        if q.is_cuda:
            from m3lm.kernels import msa_triton as kernels
        else:
            from m3lm.kernels import msa_paged as kernels

        cache, layer = dec.cache, self.layer_idx
        block_ids = None
        if self.msa is not None:
            scale = cache.ik_scale.get(layer)  # per-position scales of fp8 index keys, else None
            scores = kernels.index_block_scores(
                iq, cache.ik[layer], dec.tables, dec.lens, scale
            )  # [B, K, MAXP]
            block_ids = kernels.select_blocks(scores, dec.lens, *self.msa)  # [B, K, k]
        return kernels.paged_attention(
            q, cache.k[layer], cache.v[layer], dec.tables, dec.lens, self.scale, block_ids
        )
