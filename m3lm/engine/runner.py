"""Turns a scheduled step into one packed forward pass over the paged caches.

Under tensor parallelism rank 0's runner first sends the step's inputs to the followers
(`m3lm.distributed.steps`), which run the same `forward_step` on their shards.
"""

from __future__ import annotations

import numpy as np
import torch

from m3lm.cache.kv_cache import KVCache, PagedKV
from m3lm.distributed import steps
from m3lm.engine.sequence import Sequence
from m3lm.layers.batch import DecodeBatch, ForwardBatch
from m3lm.models.minimax_m3 import MiniMaxM3


class ModelRunner:
    def __init__(
        self,
        model: MiniMaxM3,
        cache: KVCache,
        msa_dense_window: float | None = None,
        graphs=None,
        table_width: int = 0,
    ):
        """`table_width`: pages per row of the decode rows' block table (the decode graphs' width,
        pages of max_model_len), so that eager decode launches are the graphs' variants."""
        self.model, self.cache, self.msa_dense_window = model, cache, msa_dense_window
        self.graphs = graphs  # DecodeGraphs on a GPU
        self.table_width = table_width
        self.device = model.lm_head.weight.device
        # a sequence's drafts verified as rows of one position (the decode graphs' batch), not as
        # one chunk of queries: where graphs replay them, on a GPU
        self.verify_rows = graphs is not None and self.device.type == "cuda"
        self.capture: tuple[int, ...] = ()  # layers whose inputs a drafter reads (`forward_batch`)
        self.hidden: torch.Tensor | None = None  # the last run's captured states [T, len(capture) * C]
        # seq_id -> (its first row in them, its first position, its rows): of the last run
        self.spans: dict[int, tuple[int, int, int]] = {}
        self.rows: set[int] = set()  # the sequences of the last run that decoded, a row a position

    @torch.inference_mode()
    def run(
        self, plan: list[tuple[Sequence, int]], tables: list[list[int]]
    ) -> tuple[list[Sequence], torch.Tensor, list[tuple[Sequence, range]]]:
        """Compute `n` new positions of each planned sequence (its drafts, past its known tokens,
        among them); returns the sequences that reached their last known token (they sample
        next), the fp32 logits [R + P, V] of their last known position and draft positions
        (1 + len(draft_ids) rows each) and then of the P prompt positions that score a prompt
        token, and which sequence and positions those P rows are (`Sequence.prompt_rows`).

        A sequence that decodes is one row (its last known token), and with `verify_rows` one
        row a position with its drafts; such rows lead, so that the forward attends to them as
        one batch (`DecodeBatch`), and a step of nothing else replays a captured graph
        (`DecodeGraphs`). Without `verify_rows` a sequence's drafts are a chunk of queries after
        its last token, as in chunked prefill (faster on the CPU's eager ops)."""
        decoding = [_decodes(s, n) and (n == 1 or self.verify_rows) for s, n in plan]
        order = sorted(range(len(plan)), key=lambda i: not decoding[i])
        plan, tables, decoding = ([x[i] for i in order] for x in (plan, tables, decoding))
        tokens, q_lens, starts, rows, ready, scored, scored_rows, row_tables = [], [], [], [], [], [], [], []
        offset, self.spans, self.rows = 0, {}, set()
        for (seq, n), table, as_rows in zip(plan, tables, decoding, strict=True):
            start = seq.num_cached
            self.spans[seq.seq_id] = (offset, start, n)
            known = min(n, seq.num_tokens - start)  # the rest are drafts to verify
            tokens.extend(seq.tokens(start, start + known))
            tokens.extend(seq.draft_ids[: n - known])
            if as_rows:
                self.rows.add(seq.seq_id)
                q_lens.extend([1] * n)
                starts.extend(range(start, start + n))
                row_tables.extend([table] * n)
            else:
                q_lens.append(n)
                starts.append(start)
                row_tables.append(table)
                if at := seq.prompt_rows(start, n):
                    scored.append((seq, at))
                    scored_rows.extend(offset + p - start for p in at)
            if start + known == seq.num_tokens:  # the last known token and each draft
                rows.extend(range(offset + known - 1, offset + n))
                ready.append(seq)
            offset += n
        g = self.graphs
        if g is not None and all(decoding) and len(tokens) <= g.max_batch and g.layers == self.capture:
            logits, self.hidden = g.run(tokens, starts, row_tables)
        else:
            step = steps.Step(tokens, q_lens, starts, rows + scored_rows, row_tables)
            steps.send(self.model.parallel, step)
            capture = dict.fromkeys(self.capture) if self.capture else None
            logits = forward_step(
                self.model, self.cache, step, self.msa_dense_window, self.table_width, capture=capture
            )
            self.hidden = torch.cat([capture[i] for i in self.capture], -1) if capture else None
        for seq, n in plan:
            seq.num_cached += n
        return ready, logits, scored


def _decodes(seq: Sequence, n: int) -> bool:
    """Whether the sequence's n positions this step are its last known token and drafts."""
    return seq.num_cached == seq.num_tokens - 1 and n == 1 + len(seq.draft_ids)


def forward_step(
    model: MiniMaxM3,
    cache: KVCache,
    step: steps.Step,
    msa_dense_window: float | None,
    table_width: int = 0,
    batch_decodes: bool | None = None,
    capture: dict[int, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """One packed forward of a step's tokens over the paged caches -> fp32 logits [R, V]
    (`step_inputs` makes the forward's inputs)."""
    return model.forward_batch(
        *step_inputs(model, cache, step, msa_dense_window, table_width, batch_decodes, capture)
    )


def step_inputs(
    model: MiniMaxM3,
    cache: KVCache,
    step: steps.Step,
    msa_dense_window: float | None,
    table_width: int = 0,
    batch_decodes: bool | None = None,
    capture: dict[int, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ForwardBatch, torch.Tensor]:
    """The step's (tokens [T], ForwardBatch, logits rows [R]) on the model's device.

    The step's leading single-token sequences attend as one batch (`decode_rows`: the Triton
    kernels on a GPU, batched PyTorch ops on the CPU) without the dense window, unless
    `batch_decodes` says otherwise. On the CPU their block tables are as wide as the longest:
    `table_width` (the decode graphs' width) only names the GPU kernels' variants.
    """
    dev = model.lm_head.weight.device
    if batch_decodes is None:
        batch_decodes = msa_dense_window is None
    if dev.type != "cuda":
        table_width = 0
    positions = [
        p for start, n in zip(step.starts, step.q_lens, strict=True) for p in range(start, start + n)
    ]
    positions = torch.tensor(positions, dtype=torch.long, device=dev)
    batch = ForwardBatch(
        positions=positions,
        q_lens=step.q_lens,
        kv=PagedKV(cache, step.tables, step.starts, step.q_lens),
        msa_dense_window=msa_dense_window,
        decode=decode_rows(step, positions, cache, table_width) if batch_decodes else None,
        capture=capture,
    )
    ids = torch.tensor(step.tokens, dtype=torch.long, device=dev)
    return ids, batch, torch.tensor(step.rows, dtype=torch.long, device=dev)


def decode_rows(
    step: steps.Step, positions: torch.Tensor, cache: KVCache, width: int = 0
) -> DecodeBatch | None:
    """The `DecodeBatch` of the step's leading single-token sequences (None when there are none):
    block tables `width` pages wide (at least the longest table), padded with the spare last page."""
    b = next((i for i, n in enumerate(step.q_lens) if n != 1), len(step.q_lens))
    if b == 0:
        return None
    tables = step.tables[:b]
    width = max(width, *map(len, tables))
    host = np.full((b, width), cache.num_pages - 1, dtype=np.int32)
    for i, table in enumerate(tables):
        host[i, : len(table)] = table
    pinned = positions.is_cuda
    tab = torch.from_numpy(host)
    tab = (tab.pin_memory() if pinned else tab).to(positions.device, non_blocking=pinned)
    return DecodeBatch.build(positions[:b], tab, cache, cache.page_size)
