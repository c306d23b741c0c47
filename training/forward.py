"""A batched, differentiable forward of m3lm's `MiniMaxM3`, for training.

The inference forward loops over sequences and queries to stay exact for any packing; training
wants [B, T] batches and autograd. This forward runs the same modules (projections, norms,
experts, router) and the same layer functions (`rms_norm` through the modules, `rope_cos_sin`,
`apply_rope`, `swiglu_oai`, `route`, `index_block_scores_ref`, `select_blocks_ref`), so the
function it trains is the one `m3lm.load` runs:

- attention is `scaled_dot_product_attention` with a boolean mask [B, H, T, T]: causality
  composed, on sparse layers, with the blocks the indexer selected for each query and KV group
  (m3lm's selection rule, computed without gradient: forced local blocks, dense when a query sees
  at most top-k blocks);
- MoE runs every expert on every token in three matmuls and weights them with the routing
  weights, zero for unchosen experts: the same sum as a dispatch, without host syncs;
- the indexer learns only from the auxiliary loss of DeepSeek-V3.2: the KL divergence from the
  main attention's probability mass per key block (dense attention, q and k detached, summed over
  the KV group's heads) to the softmax of the indexer's max-pooled block scores. Its input is
  detached, so the language-model loss never reaches it and it never reaches the language model.

Dropout (training only) acts on the embeddings and on each residual branch.

Shapes: B sequences, T tokens, C hidden, H query heads, K KV heads (= index heads), G = H/K,
D head dim, Di index head dim, N key blocks, S block size, E experts, A active experts, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from m3lm.kernels.moe import route
from m3lm.kernels.msa import index_block_scores_ref, select_blocks_ref
from m3lm.layers.mlp import swiglu_oai
from m3lm.layers.rotary import apply_rope, rope_cos_sin
from m3lm.models.minimax_m3 import Attention, MiniMaxM3, MoE

_batched_block_scores = torch.vmap(index_block_scores_ref, in_dims=(0, 0, None, None))


@dataclass
class Output:
    logits: torch.Tensor  # [B, T, V] fp32
    lm_loss: torch.Tensor | None  # mean next-token cross-entropy, when targets are given
    indexer_kl: torch.Tensor  # mean over sparse layers (0 without any)
    balance: torch.Tensor  # MoE load-balance term, summed over MoE layers
    expert_counts: list[torch.Tensor] = field(default_factory=list)  # per MoE layer [E] routed tokens


def training_forward(
    model: MiniMaxM3,
    inputs: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    sparse: bool = True,
    dropout: float = 0.0,
    indexer_loss: bool = True,
) -> Output:
    """inputs [B, T] (each row from position 0, never padded) -> logits and the training losses.

    sparse=False attends densely on every layer (the indexer still learns from its loss).
    """
    a = model.args
    b, t = inputs.shape
    pos = torch.arange(t, device=inputs.device)
    cos, sin = rope_cos_sin(pos, a.rotary_dim, a.rope_theta)  # [T, R/2] fp32
    zero = torch.zeros((), device=inputs.device)
    kls, balance, counts = [], zero, []
    h = F.dropout(model.model.embed_tokens(inputs), dropout, model.training)  # [B, T, C]
    for layer in model.model.layers:
        attn, kl = attention(layer.self_attn, layer.input_layernorm(h), pos, cos, sin, sparse, indexer_loss)
        h = h + F.dropout(attn, dropout, model.training)
        if kl is not None:
            kls.append(kl)
        x = layer.post_attention_layernorm(h)
        if hasattr(layer, "block_sparse_moe"):
            y, bal, count = moe(layer.block_sparse_moe, x.view(b * t, -1))
            y, balance = y.view(b, t, -1), balance + bal
            counts.append(count)
        else:
            y = layer.mlp(x)
        h = h + F.dropout(y, dropout, model.training)
    logits = model.lm_head(model.model.norm(h)).float()  # [B, T, V]
    lm = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    kl = torch.stack(kls).mean() if kls else zero
    return Output(logits, lm, kl, balance, counts)


def attention(
    attn: Attention,
    x: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sparse: bool,
    indexer_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [B, T, C] -> (attention output [B, T, C], indexer KL or None), as `Attention.forward` computes it."""
    b, t, _ = x.shape
    n_h, n_kv, d = attn.n_heads, attn.n_kv, attn.head_dim
    q = apply_rope(attn.q_norm(attn.q_proj(x).view(b, t, n_h, d)), cos, sin)  # [B, T, H, D]
    k = apply_rope(attn.k_norm(attn.k_proj(x).view(b, t, n_kv, d)), cos, sin)  # [B, T, K, D]
    v = attn.v_proj(x).view(b, t, n_kv, d)  # [B, T, K, D]
    mask, kl = None, None
    if attn.sparse and (sparse or indexer_loss):
        block, topk, local, init = attn.msa
        scores = index_scores(attn, x.detach(), pos, cos, sin)  # [B, K, T, N] fp32
        if sparse:
            ids = select_blocks_ref(scores.detach(), pos, block, topk, local, init)  # [B, K, T, k]
            mask = selection_mask(ids, pos, block)  # [B, K, T, T]
        if indexer_loss:
            with torch.no_grad():
                target = block_attention_mass(q, k, pos, attn.scale, block)  # [B, K, T, N]
            kl = indexer_kl(scores, target, pos, block, attn.index_q_norm.weight.shape[0])
    qh = q.transpose(1, 2)  # [B, H, T, D]
    kh = k.transpose(1, 2).repeat_interleave(n_h // n_kv, dim=1)  # [B, H, T, D]; head h reads KV group h // G
    vh = v.transpose(1, 2).repeat_interleave(n_h // n_kv, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=attn.scale)
    else:
        mask = mask.repeat_interleave(n_h // n_kv, dim=1)  # [B, H, T, T]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, n_h * d)), kl  # [B, T, C]


def index_scores(
    attn: Attention, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The lightning indexer's max-pooled block scores [B, K, T, N], fp32 as at inference."""
    b, t, _ = x.shape
    iq = attn.index_q_norm(attn.index_q_proj(x).view(b, t, attn.n_kv, -1))
    ik = attn.index_k_norm(attn.index_k_proj(x).view(b, t, 1, -1))
    iq, ik = apply_rope(iq, cos, sin), apply_rope(ik, cos, sin)[:, :, 0]  # [B, T, K, Di], [B, T, Di]
    with torch.autocast(x.device.type, enabled=False):  # the scores are fp32 products at inference
        return _batched_block_scores(iq, ik, pos, attn.msa[0])


def selection_mask(ids: torch.Tensor, pos: torch.Tensor, block: int) -> torch.Tensor:
    """Keys each query may attend [B, K, T, T]: causal and in one of its selected blocks ids [B, K, T, k]."""
    t = pos.shape[0]
    n = -(-t // block)
    chosen = torch.zeros(*ids.shape[:3], n + 1, dtype=torch.bool, device=ids.device)  # [B, K, T, N+1]
    chosen.scatter_(-1, ids.masked_fill(ids < 0, n), True)  # unused slots land in the extra column
    keep = chosen[..., pos // block]  # [B, K, T, T]
    return keep & (pos[None, :] <= pos[:, None])


def block_attention_mass(
    q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, scale: float, block: int
) -> torch.Tensor:
    """Dense causal attention probability per key block, averaged over each KV group's heads [B, K, T, N].

    q [B, T, H, D], k [B, T, K, D]; every row sums to 1 over the visible blocks.
    """
    b, t, n_h, d = q.shape
    n_kv = k.shape[2]
    n = -(-t // block)
    with torch.autocast(q.device.type, enabled=False):
        s = torch.einsum("btkgd,bjkd->bkgtj", q.float().view(b, t, n_kv, n_h // n_kv, d), k.float()) * scale
        s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))  # [B, K, G, T, T]
        p = torch.softmax(s, dim=-1).mean(2)  # [B, K, T, T]
        p = F.pad(p, (0, n * block - t))
        return p.unflatten(-1, (n, block)).sum(-1)  # [B, K, T, N]


def indexer_kl(
    scores: torch.Tensor, target: torch.Tensor, pos: torch.Tensor, block: int, index_dim: int
) -> torch.Tensor:
    """KL(target || softmax of the index block scores), mean over the queries that see more than one block.

    scores and target [B, K, T, N]. The scores, products of index vectors of RMS about 1, are
    scaled by Di^-1/2 like attention logits; a positive scale leaves the selection unchanged.
    """
    visible = torch.isfinite(scores)
    logp = torch.log_softmax(scores * (1 / math.sqrt(index_dim)), dim=-1)
    logp = logp.masked_fill(~visible, 0.0)  # target is 0 there; keeps 0 * -inf out of the sum
    kl = (torch.xlogy(target, target) - target * logp).sum(-1)  # [B, K, T]
    rows = (pos >= block).float()  # queries with a choice to make
    return (kl * rows).sum() / (kl.shape[0] * kl.shape[1] * rows.sum().clamp(min=1))


def moe(m: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, C] -> (output [T, C], load-balance term, routed tokens per expert [E]).

    Every expert runs on every token and unchosen experts get weight 0: for a few small experts
    three matmuls beat a dispatch loop, and the sum equals `routed_scaling_factor * sum_a w_a
    expert_a(x) + shared(x)` of `MoE.forward`.
    """
    with torch.autocast(x.device.type, enabled=False):
        logits = F.linear(x.float(), m.gate.weight)  # [T, E] fp32 router, as released
    weights, ids = route(logits, m.e_score_correction_bias, m.top_k)  # [T, A]
    combine = torch.zeros_like(logits).scatter(1, ids, weights)  # [T, E]
    ex = m.experts
    n_e, inter, c = ex.w1.shape
    gate = x @ ex.w1.reshape(n_e * inter, c).T  # [T, E*I]
    up = x @ ex.w3.reshape(n_e * inter, c).T
    act = swiglu_oai(gate, up, m.alpha, m.limit).view(-1, n_e, inter) * combine[:, :, None]  # [T, E, I]
    routed = act.flatten(1) @ ex.w2.permute(1, 0, 2).reshape(c, n_e * inter).T  # [T, C]
    out = (routed.float() * m.scaling + m.shared_experts(x).float()).to(x.dtype)

    # DeepSeek-V3's balance term: fraction routed to each expert times its mean normalised score.
    count = torch.zeros(n_e, device=x.device).scatter_add_(
        0, ids.flatten(), torch.ones(ids.numel(), device=x.device)
    )
    scores = torch.sigmoid(logits)
    share = (scores / scores.sum(-1, keepdim=True)).mean(0)  # [E]
    balance = (count.detach() * n_e / ids.numel() * share).sum()
    return out, balance, count
