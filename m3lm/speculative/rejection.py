"""Verifying drafted tokens against the target model: the accept/reject rule, as pure tensor functions.

Shapes: B sequences, K drafted tokens at most per sequence, V vocab. A sequence's K + 1 target
rows are its processed logits (`Sampler.process`: logit bias, penalties, temperature, top-k,
top-p, min-p) at the position before each draft and after the last one.

Greedy rows accept a draft while it is the target's argmax, then take the argmax: exactly the
tokens plain greedy decoding gives. Sampled rows use speculative sampling: draft d_i (drawn
from q_i, or chosen deterministically: then q_i is one-hot at d_i) is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token comes from the residual
norm(max(p_i - q_i, 0)), and when every draft is accepted from p_K. Each emitted token is
then distributed exactly as the target would sample it (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TINY = torch.finfo(torch.float32).tiny


def acceptance(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) for each draft: p [..., V] target probabilities, q [..., V] draft
    probabilities (None: one-hot at the draft), drafts [...] long -> [...] fp32."""
    pd = p.gather(-1, drafts[..., None]).squeeze(-1)
    if q is None:
        return pd.clamp(max=1.0)
    qd = q.gather(-1, drafts[..., None]).squeeze(-1)
    return torch.where(qd > 0, (pd / qd.clamp_min(TINY)).clamp(max=1.0), torch.ones_like(pd))


def residual(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) [..., V], the distribution after a rejected draft (q None: one-hot at
    the draft). Where nothing is left (p <= q everywhere, which rounding alone can cause), p."""
    r = p.scatter(-1, drafts[..., None], 0.0) if q is None else (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(TINY), p)


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each sequence's drafts and choose the token after it.

    logits [B, K+1, V] processed target logits (-inf: dropped by a filter); drafts [B, K] long
    (entries past num_drafts [B] are ignored); greedy [B] bool; uniforms [B, K] in [0, 1) and
    noise [B, V] ~ Exp(1), the row's random draws; draft_probs [B, K, V] or None (one-hot drafts).
    Returns (accepted [B]: drafts kept, next [B]: the token after them), both long, on the device.
    """
    B, K1, V = logits.shape
    K = K1 - 1
    p = logits.softmax(-1)  # [B, K+1, V]
    q = draft_probs
    valid = torch.arange(K, device=logits.device)[None, :] < num_drafts[:, None]  # [B, K]
    sampled_ok = uniforms < acceptance(p[:, :K], q, drafts)  # [B, K]
    greedy_ok = drafts == logits[:, :K].argmax(-1)  # ties go to the lowest id, as in plain decoding
    ok = torch.where(greedy[:, None], greedy_ok, sampled_ok) & valid
    accepted = ok.long().cumprod(-1).sum(-1)  # [B]
    at = accepted[:, None, None].expand(B, 1, V)
    row_logits, row_p = logits.gather(1, at)[:, 0], p.gather(1, at)[:, 0]  # [B, V] of row `accepted`
    j = accepted.clamp(max=max(K - 1, 0))[:, None]  # the rejected draft's index (clamped when none)
    rejected = accepted < num_drafts  # [B]
    if K:
        d = drafts.gather(1, j)[:, 0]  # [B]
        qj = None if q is None else q.gather(1, j[:, :, None].expand(B, 1, V))[:, 0]
        dist = torch.where(rejected[:, None], residual(row_p, qj, d), row_p)  # [B, V]
    else:
        dist = row_p
    race = dist.log() - noise.clamp_min(TINY).log()  # exponential race: argmax samples dist
    nxt = torch.where(greedy, row_logits.argmax(-1), race.argmax(-1))
    return accepted, nxt


def verify_greedy(
    logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` when every row is greedy, without its draws: logits [B, K+1, V], drafts [B, K],
    num_drafts [B] -> (accepted [B], the tokens each row emits [B, K+1]: its argmax, which
    up to row `accepted` are the accepted drafts and then the token after them)."""
    K = drafts.shape[1]
    top = logits.argmax(-1)  # [B, K+1], ties to the lowest id
    valid = torch.arange(K, device=logits.device)[None, :] < num_drafts[:, None]
    accepted = ((drafts == top[:, :K]) & valid).long().cumprod(-1).sum(-1)  # [B]
    return accepted, top


def draws(
    generators: Sequence[torch.Generator | None], k: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's random draws for `verify`: uniforms [B, k] and exponential noise [B, V], from the
    row's generator (a seeded request's, so its tokens do not depend on the batch) or the global RNG."""
    B = len(generators)
    uniforms = torch.empty(B, k, device=device)
    noise = torch.empty(B, vocab, device=device)
    if all(g is None for g in generators):
        uniforms.uniform_()
        noise.exponential_()
    else:
        for b, g in enumerate(generators):
            uniforms[b].uniform_(generator=g)
            noise[b].exponential_(generator=g)
    return uniforms, noise
