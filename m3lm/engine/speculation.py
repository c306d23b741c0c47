"""Speculative decoding in the engine: draft tokens for running sequences, verify them.

A running sequence holding drafts d_1..d_k (`Sequence.draft_ids`) is scheduled for k + 1
positions: its last token and the drafts, in one target forward over the paged caches, where
each position selects its own MSA blocks exactly as plain decoding would (a chunk of queries,
as in chunked prefill). The k + 1 rows of logits go through the request's own sampling
pipeline (`Sampler.process`: the row of draft i sees the drafts before it as output, for
penalties) and the accept/reject rule (`speculative.rejection.verify`); the cache positions of
rejected drafts are rolled back (`rollback`): their keys stay in the pages, past the sequence's
valid positions, to be overwritten, and pages that only they reached go back to the pool.

Drafters: prompt lookup (`speculative.ngram`), or an EAGLE-3 head (`EagleDrafter`) that reads
the residual stream the target's forward captured at three layers (`ModelRunner.capture`) for
every position a step computed and kept (prefill chunks, accepted drafts), writes its own keys
for them into a pool that shares the target's block tables, and then drafts k tokens greedily.

Requests whose logits a grammar or a thinking budget masks (`Constraint`) are not speculated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from m3lm.cache.block_manager import BlockManager
from m3lm.core import TokenLogprob
from m3lm.engine.sequence import SeqStatus, Sequence
from m3lm.sampler import Sampler, logprobs
from m3lm.speculative import ngram
from m3lm.speculative.config import SpeculativeConfig
from m3lm.speculative.rejection import draws, verify


@dataclass
class SpecStats:
    """Counters since start, as vLLM names them: verification steps of a sequence with drafts,
    drafted tokens, accepted ones, and accepted ones by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification step emits on average (the accepted drafts and one more)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class Verified:
    """One sequence's verification: the tokens it emits (accepted drafts, then one more) and
    their logprobs when asked, and whether its logits were finite."""

    tokens: list[int]
    accepted: int
    logprobs: list[TokenLogprob | None]
    finite: bool


class EagleDrafter:
    """An EAGLE-3 head beside the target, with its paged key/value pool (one layer)."""

    def __init__(self, head, num_pages: int, page_size: int, device: torch.device):
        a = head.args
        self.head, self.page = head, page_size
        shape = (num_pages, page_size, a.num_key_value_heads, a.head_dim)
        dtype = head.fc.weight.dtype
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @staticmethod
    def bytes_per_page(head, page_size: int) -> int:
        """Bytes of one page of the drafter's pool (its keys and values)."""
        a = head.args
        return 2 * page_size * a.num_key_value_heads * a.head_dim * head.fc.weight.element_size()

    @torch.inference_mode()
    def draft(
        self, seq: Sequence, table: list[int], hidden: torch.Tensor, start: int, room: int
    ) -> list[int]:
        """Take the sequence's positions start .. num_cached - 1 (their captured target states
        `hidden` [n, 3 Ct]) into the pool; then draft up to `room` tokens after its last one."""
        from m3lm.cache.kv_cache import rows

        head, dev, end = self.head, hidden.device, seq.num_cached
        tokens = torch.tensor(seq.tokens(start + 1, end + 1), device=dev)  # each position's next token
        keys, values = rows(self.k, table, start), rows(self.v, table, start)
        pos = torch.arange(start, end, device=dev)
        feat, normed, k, v = head.step(tokens, head.features(hidden), pos, (keys, values))
        pages = torch.tensor(table, device=dev)[pos // self.page]
        self.k[pages, pos % self.page], self.v[pages, pos % self.page] = k, v
        if not room:
            return []
        # drafted positions: their keys stay local to this call
        keys, values = torch.cat([keys, k]), torch.cat([values, v])
        token, feat, drafts = head.target_ids(head.logits(normed[-1:]).argmax(-1)), feat[-1:], []
        for i in range(room):
            drafts.append(token)
            if i + 1 == room:
                break
            feat, normed, k, v = head.step(token, feat, pos[-1:] + i + 1, (keys, values))
            keys, values = torch.cat([keys, k]), torch.cat([values, v])
            token = head.target_ids(head.logits(normed).argmax(-1))
        return torch.cat(drafts).tolist()


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: EagleDrafter | None = None):
        self.config, self.drafter = config, drafter
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        return seq.constraint is None and seq.status is SeqStatus.RUNNING

    def room(self, seq: Sequence) -> int:
        """Drafts the sequence can take: k, fewer near max_tokens (a step emits drafts + 1)."""
        return max(0, min(self.k, seq.max_tokens - len(seq.output_ids) - 1))

    def propose(self, seqs: list[Sequence], blocks: BlockManager, runner) -> None:
        """After a step: set the drafts of each of its sequences that now decodes (its last token
        not yet computed); an EAGLE-3 drafter first takes in every position the step kept."""
        c = self.config
        for seq in seqs:
            seq.draft_ids = []
            if seq.finished:
                continue
            decodes = self.eligible(seq) and seq.num_cached == seq.num_tokens - 1
            room = self.room(seq) if decodes else 0
            if self.drafter is not None:
                offset, start = runner.spans[seq.seq_id]
                hidden = runner.hidden[offset : offset + seq.num_cached - start]
                seq.draft_ids = self.drafter.draft(seq, blocks.table(seq.seq_id), hidden, start, room)
            elif room:
                seq.draft_ids = ngram.propose(seq.token_ids, room, c.prompt_lookup_min, c.prompt_lookup_max)

    def verify(self, sampler: Sampler, seqs: list[Sequence], logits: torch.Tensor) -> list[Verified]:
        """Accept a prefix of each sequence's drafts: `logits` [sum(k_i + 1), V] holds each
        sequence's rows in order. Reads the results back to the host once."""
        B, dev = len(seqs), logits.device
        K = max(len(s.draft_ids) for s in seqs)
        rows, params, prompts, outputs = [], [], [], []
        at = 0
        for s in seqs:
            k = len(s.draft_ids)
            for i in range(K + 1):  # padding rows repeat the sequence's last one
                rows.append(at + min(i, k))
                params.append(s.params)
                prompts.append(s.prompt_ids)
                outputs.append(s.output_ids + s.draft_ids[: min(i, k)])
            at += k + 1
        raw = logits[torch.tensor(rows, device=dev)]  # [B * (K+1), V]
        x = sampler.process(raw, params, prompts, outputs).view(B, K + 1, -1)
        drafts = torch.tensor([s.draft_ids + [0] * (K - len(s.draft_ids)) for s in seqs], device=dev)
        num = torch.tensor([len(s.draft_ids) for s in seqs], device=dev)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
        uniforms, noise = draws([s.generator for s in seqs], K, x.shape[-1], dev)
        accepted, nxt = verify(x, drafts.view(B, K), num, greedy, uniforms, noise)
        finite = torch.isfinite(raw).all(-1).view(B, K + 1).all(-1)
        # the emitted tokens' candidates: each row's draft, and at row `accepted` the chosen token
        cand = torch.cat([drafts.view(B, K), drafts.new_zeros(B, 1)], 1).scatter(
            1, accepted[:, None], nxt[:, None]
        )
        asked = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        lp = logprobs(raw, cand.flatten(), max(asked)) if asked else None
        host = torch.cat([accepted, finite.long(), cand.flatten()]).tolist()
        acc, ok, cand = host[:B], host[B : 2 * B], host[2 * B :]
        if lp is not None:
            chosen, top_ids, top_lp = (t.tolist() for t in lp)
        results = []
        for b, s in enumerate(seqs):
            n = acc[b]
            tokens = cand[b * (K + 1) : b * (K + 1) + n + 1]
            lps: list[TokenLogprob | None] = [None] * len(tokens)
            if lp is not None and s.params.logprobs is not None:
                kk = s.params.logprobs
                lps = [
                    TokenLogprob(t, chosen[r], list(zip(top_ids[r][:kk], top_lp[r][:kk], strict=True)))
                    for t, r in zip(tokens, range(b * (K + 1), b * (K + 1) + n + 1), strict=True)
                ]
            results.append(Verified(tokens, n, lps, bool(ok[b])))
            self._count(len(s.draft_ids), n)
        return results

    def _count(self, drafted: int, accepted: int) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += drafted
        st.num_accepted_tokens += accepted
        for i in range(accepted):
            st.accepted_per_pos[i] += 1


def rollback(blocks: BlockManager, seq: Sequence, v: Verified) -> None:
    """After a verification: the sequence's valid cache positions end after its last accepted
    draft; pages past the next step's need go back; pages the accepted drafts filled get names."""
    seq.num_cached -= len(seq.draft_ids) - v.accepted
    seq.num_drafts += 1
    seq.num_accepted += v.accepted
    known = seq.token_ids + v.tokens[: v.accepted]  # positions 0 .. num_cached - 1
    seq.draft_ids = []
    blocks.seal(seq.seq_id, seq.num_cached, lambda start, end: known[start:end])
    blocks.trim(seq.seq_id, seq.num_cached + 1)
