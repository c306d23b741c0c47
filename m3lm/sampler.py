"""Token sampling: small pure tensor functions over B rows (one per sequence) plus `Sampler`.

Shapes: B sequences, V vocab, k top alternatives. The pure functions take per-row parameters as
[B] tensors, never read values back to the host, and mark dropped tokens with -inf. `Sampler`
applies them in vLLM's order: logit bias -> penalties -> temperature -> top_k -> top_p -> min_p -> sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from m3lm.core import SamplingParams

NEG_INF = float("-inf")
_NEUTRAL = SamplingParams()  # temperature 1, every filter off


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty on tokens seen in the prompt or output; presence/frequency on the output.

    logits [B, V] fp32, prompt_mask [B, V] bool, output_counts [B, V] int, penalties [B].
    Repetition 1 and presence/frequency 0 leave a row unchanged.
    """
    counts = output_counts.to(logits.dtype)  # [B, V]
    seen = prompt_mask | (output_counts > 0)  # [B, V]
    rep = repetition[:, None]  # [B, 1]
    # Dividing positive and multiplying negative logits both push a seen token down.
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0).to(logits.dtype)  # [B, V]


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Sequence[tuple[int, float]]]) -> torch.Tensor:
    """logits [B, V] plus each row's (token id, bias) pairs."""
    rows = [b for b, pairs in enumerate(biases) for _ in pairs]
    if not rows:
        return logits
    cols = [t for pairs in biases for t, _ in pairs]
    values = [v for pairs in biases for _, v in pairs]
    dev = logits.device
    bias = torch.zeros_like(logits)
    bias.index_put_(
        (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
        torch.tensor(values, dtype=logits.dtype, device=dev),
        accumulate=True,
    )
    return logits + bias


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature [B]; rows with temperature 0 (greedy) stay as they are."""
    t = temperature[:, None]  # [B, 1]
    return logits / torch.where(t > 0, t, torch.ones_like(t))


def top_k_mask(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k [B] largest logits (k <= 0 keeps all).

    Tokens tied with the k-th largest value are all kept, so the result never depends on how a
    sort orders equal values; a row may therefore keep more than k tokens.
    """
    V = logits.shape[-1]
    k = torch.where(k > 0, k, V).clamp(max=V).to(torch.long)  # [B]
    desc = logits.sort(dim=-1, descending=True).values  # [B, V]
    kth = desc.gather(-1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_mask(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p [B] (p = 1 keeps all).

    Probabilities are the softmax of the given logits. The top token is always kept, and tokens
    tied with the least likely kept token are kept too (as in `top_k_mask`).
    """
    desc = logits.sort(dim=-1, descending=True).values  # [B, V]
    probs = desc.softmax(dim=-1)  # [B, V]
    before = probs.cumsum(dim=-1) - probs  # [B, V] mass of strictly more likely tokens
    keep = (before < p[:, None]) | (p[:, None] >= 1.0)  # [B, V], a prefix; p = 1 guards rounding
    n_keep = keep.sum(dim=-1).clamp(min=1)  # [B]
    last = desc.gather(-1, (n_keep - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < last, NEG_INF)


def min_p_mask(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below p [B] times the row's top probability (p = 0 keeps all)."""
    # prob < p * max_prob  <=>  logit - max_logit < log p, which avoids underflow; log 0 = -inf.
    gap = logits - logits.amax(dim=-1, keepdim=True)  # [B, V]
    return logits.masked_fill(gap < p[:, None].log(), NEG_INF)


def sample_rows(
    logits: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token id per row from softmax(logits [B, V]); -inf entries are never drawn.

    Exponential race: argmax(logits - log E) with E ~ Exp(1) samples softmax(logits). Each row's
    noise comes from its own generator, so a seeded row draws the same token whatever else is in
    the batch; rows whose generator is None use the global RNG. Rows flagged in `greedy` [B] bool
    take the argmax instead, ties going to the lowest id. Returns ids [B] int64.
    """
    noise = torch.empty_like(logits, dtype=torch.float32)  # [B, V]
    if all(g is None for g in generators):
        noise.exponential_()
    else:
        for row, g in zip(noise, generators, strict=True):
            row.exponential_(generator=g)
    # E = 0 would give log E = -inf and turn a -inf logit into NaN.
    noise = noise.clamp_min_(torch.finfo(torch.float32).tiny).log_()
    ids = (logits - noise).argmax(dim=-1)  # [B]
    if greedy is not None:
        ids = torch.where(greedy, logits.argmax(dim=-1), ids)
    return ids


def logprobs(raw_logits: torch.Tensor, chosen: torch.Tensor, k: int, ranks: bool = False) -> tuple:
    """Log-probabilities under the raw model logits [B, V] (before penalties and temperature).

    Returns the chosen tokens' [B], and the k most likely ids [B, k] with theirs [B, k], fp32;
    with `ranks` also each chosen token's rank [B] (1 = the most likely).
    """
    lp = torch.log_softmax(raw_logits.float(), dim=-1)  # [B, V]
    chosen_lp = lp.gather(-1, chosen[:, None].long()).squeeze(-1)  # [B]
    top_lp, top_ids = lp.topk(k, dim=-1)  # [B, k]
    if not ranks:
        return chosen_lp, top_ids, top_lp
    return chosen_lp, top_ids, top_lp, (lp > chosen_lp[:, None]).sum(dim=-1) + 1


def make_generator(seed: int | None, device: torch.device | str | None = None) -> torch.Generator | None:
    """A generator seeded with `seed` on `device`, or None (use the global RNG) without a seed."""
    if seed is None:
        return None
    g = torch.Generator(device=device if device is not None else "cpu")
    g.manual_seed(seed)
    return g


@dataclass
class SampleOutput:
    """Sampled ids [B], plus log-probabilities when any row asked for them (k = most asked for)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None  # [B] of the chosen tokens
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]


def reads_history(p: SamplingParams) -> bool:
    """Whether a row's processing reads its prompt and output ids (a penalty is set)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _token_tensors(
    rows: Sequence[Sequence[int]], V: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row id lists -> presence mask [B, V] bool and occurrence counts [B, V] int32."""
    counts = torch.zeros(len(rows), V, dtype=torch.int32, device=device)
    row_idx = [b for b, ids in enumerate(rows) for _ in ids]
    col_idx = [t for ids in rows for t in ids]
    if col_idx:
        index = (torch.tensor(row_idx, device=device), torch.tensor(col_idx, device=device))
        counts.index_put_(index, torch.ones(len(col_idx), dtype=torch.int32, device=device), accumulate=True)
    return counts > 0, counts


class Sampler:
    """Turns the last-position logits of B sequences into next tokens, one `SamplingParams` per row.

    Order: logit bias -> penalties -> temperature -> top_k -> top_p -> min_p -> sample (greedy rows:
    argmax). Steps that no row needs are skipped. Per-row tensors are built from the host-side lists and
    uploaded; nothing is read back, so the caller does the one transfer of `token_ids`.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
    ) -> SampleOutput:
        assert len(generators) == logits.shape[0]
        raw = logits.float()  # [B, V]
        x = self.process(raw, params, prompt_ids, output_ids)
        greedy = [p.greedy for p in params]
        if all(greedy):
            ids = x.argmax(dim=-1)  # [B]
        else:
            ids = sample_rows(x, generators, torch.tensor(greedy, dtype=torch.bool, device=x.device))
        out = SampleOutput(token_ids=ids)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if asked:
            out.logprobs, out.top_ids, out.top_logprobs = logprobs(raw, ids, max(asked))
        return out

    def process(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The logits [B, V] each row samples from (fp32): logit bias and penalties, then for
        sampled rows temperature, top_k, top_p and min_p (-inf marks a dropped token); a greedy
        row takes the argmax of its row."""
        B, V = logits.shape
        assert len(params) == len(prompt_ids) == len(output_ids) == B
        dev = logits.device

        def per_row(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)  # [B]

        x = apply_logit_bias(logits.float(), [p.logit_bias for p in params])
        if any(map(reads_history, params)):
            prompt_mask, _ = _token_tensors(prompt_ids, V, dev)
            _, counts = _token_tensors(output_ids, V, dev)
            x = apply_penalties(
                x,
                prompt_mask,
                counts,
                per_row([p.repetition_penalty for p in params]),
                per_row([p.presence_penalty for p in params]),
                per_row([p.frequency_penalty for p in params]),
            )
        if all(p.greedy for p in params):
            return x
        # Greedy rows get neutral filters: argmax would ignore them anyway.
        rows = [_NEUTRAL if p.greedy else p for p in params]
        if any(p.temperature != 1.0 for p in rows):
            x = apply_temperature(x, per_row([p.temperature for p in rows]))
        if any(p.top_k > 0 for p in rows):
            x = top_k_mask(x, per_row([p.top_k for p in rows], torch.long))
        if any(p.top_p < 1.0 for p in rows):
            x = top_p_mask(x, per_row([p.top_p for p in rows]))
        if any(p.min_p > 0.0 for p in rows):
            x = min_p_mask(x, per_row([p.min_p for p in rows]))
        return x
