"""Speculative decoding in the engine: draft tokens for running sequences, verify them.

A running sequence holding drafts d_1..d_k (`Sequence.draft_ids`) is scheduled for k + 1
positions: its last token and the drafts, in one target forward over the paged caches, a row
a position as in a decode step (on a GPU a captured graph of the step's rows), where each
position selects its own MSA blocks exactly as plain decoding would. The k + 1 rows of logits go through the request's own sampling
pipeline (`Sampler.process`: the row of draft i sees the drafts before it as output, for
penalties) and the accept/reject rule (`speculative.rejection.verify`); the cache positions of
rejected drafts are rolled back (`rollback`): their keys stay in the pages, past the sequence's
valid positions, to be overwritten, and pages that only they reached go back to the pool.

Drafters: prompt lookup (`speculative.ngram`), or an EAGLE-3 head (`engine.drafter`) that reads
the residual stream the target's forward captured at three layers (`ModelRunner.capture`) for
every position a step computed and kept (prefill chunks, accepted drafts), writes its own keys
for them into a pool that shares the target's block tables, and then drafts k tokens greedily,
every sequence at once after a step of decodes.

Requests whose logits a grammar or a thinking budget masks (`Constraint`) are not speculated.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from m3lm.cache.block_manager import BlockManager
from m3lm.core import TokenLogprob
from m3lm.device import to_device
from m3lm.engine.drafter import DraftRows, EagleDrafter
from m3lm.engine.sequence import SeqStatus, Sequence
from m3lm.sampler import Sampler, logprobs, reads_history
from m3lm.speculative import ngram
from m3lm.speculative.config import SpeculativeConfig
from m3lm.speculative.rejection import draws, verify, verify_greedy


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


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: EagleDrafter | None = None):
        self.config, self.drafter = config, drafter
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        return seq.constraint is None and seq.status is SeqStatus.RUNNING

    def room(self, seq: Sequence) -> int:
        """Drafts the sequence can take: k, fewer near its output limit (a step emits drafts + 1)."""
        return max(0, min(self.k, seq.output_limit - len(seq.output_ids) - 1))

    def propose(self, seqs: list[Sequence], blocks: BlockManager, runner) -> None:
        """After a step: set the drafts of each of its sequences that now decodes (its last token
        not yet computed), by prompt lookup or with the EAGLE-3 drafter."""
        for seq in seqs:
            seq.draft_ids = []
        rooms = [self.room(s) if self.eligible(s) and s.num_cached == s.num_tokens - 1 else 0 for s in seqs]
        if self.drafter is None:
            self._propose_lookup(seqs, rooms)
        else:
            self._propose_eagle(seqs, rooms, blocks, runner)

    def _propose_lookup(self, seqs: list[Sequence], rooms: list[int]) -> None:
        """Draft by prompt lookup: each sequence with room, from its own n-gram index."""
        c = self.config
        for seq, room in zip(seqs, rooms, strict=True):
            if room:
                seq.lookup = seq.lookup or ngram.Lookup()
                seq.draft_ids = seq.lookup.propose(seq, room, c.prompt_lookup_min, c.prompt_lookup_max)

    def _propose_eagle(self, seqs: list[Sequence], rooms: list[int], blocks: BlockManager, runner) -> None:
        """Draft with EAGLE-3: the drafter first takes in every position the step kept, then
        drafts every sequence at once (`EagleDrafter.draft_rows`): a sequence that decoded is
        taken in there too (k + 1 rows at most), a prompt's chunk first, alone (`EagleDrafter.draft`
        drafting nothing), and then its last position again among the rows."""
        live, rows = [], []
        for seq, room in zip(seqs, rooms, strict=True):
            offset, start, n = runner.spans[seq.seq_id]
            end, table = seq.num_cached, blocks.table(seq.seq_id)  # positions start .. end - 1 kept
            if seq.seq_id in runner.rows:
                # a sequence that drafts nothing now never drafts again (it ends, or a grammar holds it)
                if room:
                    live.append((seq, room))
                    rows.append(DraftRows(table, start, seq.tokens(start + 1, end + 1), offset, n))
            elif not seq.finished:
                self.drafter.draft(seq, table, runner.hidden[offset : offset + end - start], start, 0)
                if room:  # its last position, taken in again as a sequence's one row
                    live.append((seq, room))
                    rows.append(
                        DraftRows(table, end - 1, seq.tokens(end, end + 1), offset + end - 1 - start, 1)
                    )
        if live:
            drafts = self.drafter.draft_rows(rows, runner.hidden, self.k)
            for (seq, room), d in zip(live, drafts, strict=True):
                seq.draft_ids = d[:room]

    def verify(self, sampler: Sampler, seqs: list[Sequence], logits: torch.Tensor) -> list[Verified]:
        """Accept a prefix of each sequence's drafts: `logits` [sum(k_i + 1), V] holds each
        sequence's rows in order. Reads the results back to the host once."""
        B, dev = len(seqs), logits.device
        counts = [len(s.draft_ids) for s in seqs]
        K = max(counts)
        if all(n == K for n in counts):
            raw = logits  # [B * (K+1), V], already a sequence's K + 1 rows after another
        else:  # padding rows repeat the sequence's last one
            at = [0, *itertools.accumulate(n + 1 for n in counts)]
            rows = [at[b] + min(i, n) for b, n in enumerate(counts) for i in range(K + 1)]
            raw = logits[to_device(rows, dev)]  # [B * (K+1), V]
        params = [s.params for s in seqs for _ in range(K + 1)]
        prompts = outputs = [()] * len(params)
        if any(map(reads_history, params)):  # row i sees drafts 1..i as output
            prompts = [s.prompt_ids for s in seqs for _ in range(K + 1)]
            outputs = [
                s.output_ids + s.draft_ids[: min(i, len(s.draft_ids))] for s in seqs for i in range(K + 1)
            ]
        x = sampler.process(raw, params, prompts, outputs).view(B, K + 1, -1)
        padded = [s.draft_ids + [0] * (K - len(s.draft_ids)) + [len(s.draft_ids)] for s in seqs]
        both = to_device(padded, dev)  # one copy: drafts [B, K] and their counts
        drafts, num = both[:, :K], both[:, K]
        if all(s.params.greedy for s in seqs):
            accepted, cand = verify_greedy(x, drafts, num)  # [B], [B, K+1]
        else:
            greedy = to_device([s.params.greedy for s in seqs], dev, torch.bool)
            uniforms, noise = draws([s.generator for s in seqs], K, x.shape[-1], dev)
            accepted, nxt = verify(x, drafts, num, greedy, uniforms, noise)
            # the emitted tokens' candidates: each row's draft, and at row `accepted` the chosen token
            cand = torch.cat([drafts, drafts.new_zeros(B, 1)], 1).scatter(1, accepted[:, None], nxt[:, None])
        finite = torch.isfinite(raw).all(-1).view(B, K + 1).all(-1)
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
