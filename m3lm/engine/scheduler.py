"""Continuous batching: which sequences run in the next step, and how many tokens each.

Pure Python over `BlockManager`, so every policy is testable on the CPU:
- running sequences go first, oldest first: a decode needs one token (and one per draft it
  verifies, while the budget and the pages allow: drafts give way before any preemption), an
  unfinished prefill the next chunk; then waiting sequences are admitted in arrival order while the step's token
  budget (`max_num_batched_tokens`) and `max_num_seqs` allow, so long prompts are prefilled in
  chunks and never stall running decodes;
- a sequence whose grammar is still compiling (structured output) stays queued;
- when pages run out, the newest running sequence is preempted: its pages are freed and it
  goes back to the front of the queue to be recomputed later, instead of failing;
- a sequence admitted from the queue starts on the cached pages of its longest prefix
  (`BlockManager.match`), so only the rest of its prompt is computed; one whose next page a
  running prefill is computing (`BlockManager.awaits`) stays queued until that page is cached,
  while the sequences behind it are admitted.
"""

from __future__ import annotations

import time
from collections import deque

from m3lm.cache.block_manager import BlockManager
from m3lm.engine.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prompt_tokens = 0  # prompt positions of admitted requests, since start
        self.prefix_cached_tokens = 0  # of those, positions found in the prefix cache

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Sequences to run this step with their token counts (cache pages already allocated)."""
        plan: list[tuple[Sequence, int]] = []
        budget = self._continue_running(plan, self.budget)
        self._admit_waiting(plan, budget)
        return plan

    def _continue_running(self, plan: list[tuple[Sequence, int]], budget: int) -> int:
        """Plan the running sequences' next tokens, oldest first, preempting the newest when pages
        run out; returns the token budget left."""
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            del seq.draft_ids[max(budget - 1, 0) :]  # drafts fit in the budget beside their token
            n = min(seq.num_tokens - seq.num_cached + len(seq.draft_ids), budget)
            while not self.blocks.ensure(seq.seq_id, seq.num_cached + n):
                if seq.draft_ids:  # drafts give way before any sequence is preempted
                    n -= len(seq.draft_ids)
                    seq.draft_ids.clear()
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                plan.append((seq, n))
                budget -= n
        return budget

    def _admit_waiting(self, plan: list[tuple[Sequence, int]], budget: int) -> None:
        """Admit waiting sequences in arrival order, each on its cached prefix, while the budget,
        `max_num_seqs` and the pages allow."""
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.constraint is not None and not seq.constraint.ready:
                continue  # its grammar is compiling
            # new or preempted (a waiting sequence holds no pages): start on its cached prefix
            reuse = not seq.scores_prompt
            seq.num_cached = self.blocks.match(seq.seq_id, seq.token_ids, seq.params.cache_salt, reuse)
            if reuse and self.blocks.awaits(seq.seq_id, seq.token_ids):
                self.blocks.free(seq.seq_id)  # a running prefill is computing its next page
                seq.num_cached = 0
                continue
            n = min(seq.num_tokens - seq.num_cached, budget)
            if not self.blocks.ensure(seq.seq_id, seq.num_cached + n):
                self.blocks.free(seq.seq_id)  # its prefix pages wait in the cache meanwhile
                seq.num_cached = 0
                break
            self.blocks.promise(seq.seq_id, seq.token_ids)
            if seq.first_scheduled_time is None:  # first admission
                seq.num_prefix_cached = seq.num_cached
                self.prompt_tokens += len(seq.prompt_ids)
                self.prefix_cached_tokens += seq.num_cached
            self.waiting.remove(seq)
            seq.first_scheduled_time = seq.first_scheduled_time or time.perf_counter()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it is recomputed (prompt + output so far) later."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_cached = 0
        seq.draft_ids.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is (running, waiting) and free its pages at once (an
        error's pages are not kept for later prefixes)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id, keep=reason != "error")
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
