"""An EAGLE-3 drafter in the engine: its paged key/value pool, and its drafting.

The drafter's keys and values live in a pool of their own that shares the target's block tables
(the drafter's key of position t sits where the target's key of t does). Its input at a position
the target computed is that position's captured target states and the next token, so after
every step the drafter first takes in the positions the step kept, then drafts.

Two ways to draft:
- `draft`, one sequence at a time, after a step that prefilled: the positions the step kept are
  taken into the pool, and the drafts' own keys stay local to the call.
- `draft_rows`, every sequence at once, after a step in which each sequence decoded (its last
  token and its drafts, a row a position): one batched layer step over each sequence's k + 1 rows
  of the step (rows past the accepted drafts are padding), then one batched step a draft
  position. Every row writes its key into the pool at its position and attends through the
  paged decode kernel (`paged_attention`), so every shape is static and on a GPU the whole
  drafting replays as one CUDA graph per batch bucket (`DraftGraphs`).

Drafted positions are past a sequence's valid end: their keys go where the sequence's table
puts them (the spare last page where it has no page yet, as padding rows' do), and the next
take-in overwrites them before any row reads them. Shapes: B sequences, R = k + 1 rows a
sequence, C the drafter's hidden size, Ct the target's, W table width (pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from m3lm.engine.sequence import Sequence


class EagleDrafter:
    """An EAGLE-3 head beside the target, with its paged key/value pool (one layer); the last
    page is the spare one, which padding rows write to."""

    def __init__(self, head, num_pages: int, page_size: int, device: torch.device):
        a = head.args
        self.head, self.page, self.spare = head, page_size, num_pages - 1
        shape = (num_pages, page_size, a.num_key_value_heads, a.head_dim)
        dtype = head.fc.weight.dtype
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.graphs: DraftGraphs | None = None  # on a GPU, set by the engine

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

    def paged_step(
        self,
        tokens: torch.Tensor,
        feats: torch.Tensor,
        pos: torch.Tensor,
        tables: torch.Tensor,
        keep: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over N rows, each a position of some sequence: tokens [N] (each position's
        next token), feats [N, C], positions [N], each row's table [N, W] int32, keep [N] bool
        (whether its key joins the sequence's pages; else, or past the table, the spare page)
        -> (the feature for the next position [N, C], the final-normed states [N, C]). Each row
        attends to its sequence's keys up to its own position, its own among them."""
        if tokens.is_cuda:
            from m3lm.kernels import msa_triton as kernels
        else:
            from m3lm.kernels import msa_paged as kernels

        head, S, W = self.head, self.page, tables.shape[1]
        q, k, v, residual = head.qkv(tokens, feats, pos)
        blk = pos // S
        page = tables.gather(1, blk.clamp(max=W - 1)[:, None])[:, 0].long()
        page = torch.where(keep & (blk < W), page, self.spare)
        self.k[page, pos % S] = k.to(self.k.dtype)
        self.v[page, pos % S] = v.to(self.v.dtype)
        lens = (pos + 1).clamp(max=W * S).to(torch.int32)
        o = kernels.paged_attention(q, self.k, self.v, tables, lens, head.scale)  # [N, H, D]
        return head.finish(o, residual)

    def draft_batch(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        tables: torch.Tensor,
        k: int,
    ) -> torch.Tensor:
        """B sequences' R rows of a step: their captured target states hidden [B, R, 3 Ct], each
        row's next token [B, R] and position [B, R], the index of each sequence's last valid row
        last [B] (later rows are padding) and tables [B, W] -> k drafts [B, k] (target ids) after
        each sequence's last valid row. Reads nothing back to the host."""
        head = self.head
        B, R = tokens.shape
        keep = torch.arange(R, device=tokens.device)[None] <= last[:, None]  # [B, R]
        feat, normed = self.paged_step(
            tokens.flatten(),
            head.features(hidden.flatten(0, 1)),
            positions.flatten(),
            tables.repeat_interleave(R, 0),
            keep.flatten(),
        )  # [B R, C] each
        at = torch.arange(B, device=tokens.device) * R + last  # each sequence's last valid row
        feat, normed = feat[at], normed[at]  # [B, C]
        pos = positions.gather(1, last[:, None])[:, 0]  # [B]
        everyone = torch.ones(B, dtype=torch.bool, device=tokens.device)
        drafts = []
        for j in range(k):
            token = head.target_ids(head.logits(normed).argmax(-1))  # [B]
            drafts.append(token)
            if j + 1 < k:
                feat, normed = self.paged_step(token, feat, pos + j + 1, tables, everyone)
        return torch.stack(drafts, 1)  # [B, k]

    @torch.inference_mode()
    def draft_rows(self, rows: list[DraftRows], hidden: torch.Tensor, k: int) -> list[list[int]]:
        """k drafts for each sequence of `rows`, after taking in its valid rows (their captured
        target states are rows of `hidden` [N, 3 Ct]); one host read. On a GPU a captured graph."""
        if self.graphs is not None and len(rows) <= self.graphs.max_batch:
            drafts = self.graphs.run(rows, hidden)
        else:
            W = max(len(r.table) for r in rows)
            host = torch.from_numpy(draft_inputs(rows, k + 1, W, self.spare)).to(hidden.device)
            tokens, positions, at, last, tables = split_inputs(host, k + 1)
            drafts = self.draft_batch(hidden[at], tokens, positions, last, tables.to(torch.int32), k)
        return drafts.tolist()


@dataclass(slots=True)
class DraftRows:
    """One sequence's rows of the last step for `EagleDrafter.draft_rows`: its table, its first
    position, the next token of each valid row (`tokens`, one a valid row), where its rows start
    in the captured states and how many there are (valid rows lead them)."""

    table: list[int]
    start: int
    tokens: list[int]
    first: int
    n: int


def draft_inputs(rows: list[DraftRows], R: int, width: int, spare: int) -> np.ndarray:
    """The host side of `draft_batch`'s inputs, [B, 3 R + 1 + width] int64: each sequence's R
    rows' next tokens, positions and rows in the captured states, its last valid row, and its
    table padded with the spare page. Padding rows repeat the last valid (or last) one."""
    out = np.full((len(rows), 3 * R + 1 + width), spare, dtype=np.int64)
    for b, r in enumerate(rows):
        valid = len(r.tokens)
        assert 1 <= valid <= r.n <= R and len(r.table) <= width
        i = np.minimum(np.arange(R), valid - 1)
        out[b, :R] = np.asarray(r.tokens)[i]
        out[b, R : 2 * R] = r.start + i
        out[b, 2 * R : 3 * R] = r.first + np.minimum(np.arange(R), r.n - 1)
        out[b, 3 * R] = valid - 1
        out[b, 3 * R + 1 : 3 * R + 1 + len(r.table)] = r.table
    return out


def split_inputs(host: torch.Tensor, R: int) -> tuple[torch.Tensor, ...]:
    """`draft_inputs`' columns: tokens [B, R], positions [B, R], rows [B, R], last [B], tables [B, W]."""
    return host[:, :R], host[:, R : 2 * R], host[:, 2 * R : 3 * R], host[:, 3 * R], host[:, 3 * R + 1 :]


class DraftGraphs:
    """`EagleDrafter.draft_batch` replayed from CUDA graphs, one per batch-size bucket (1, 2, 4,
    ..., max), on static buffers; rows past B are padding that writes only the spare page."""

    def __init__(self, drafter: EagleDrafter, max_batch: int, max_pages: int, k: int):
        a, dev = drafter.head.args, drafter.k.device
        self.drafter, self.k, self.R, self.width = drafter, k, k + 1, max_pages
        self.max_batch = max_batch
        self.buckets = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
        self.inputs = torch.zeros(max_batch, 3 * self.R + 1 + max_pages, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(
            max_batch, self.R, 3 * a.target_hidden_size, dtype=drafter.k.dtype, device=dev
        )
        self._host = torch.empty(max_batch, self.inputs.shape[1], dtype=torch.long, pin_memory=True)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.inputs[:, 3 * self.R + 1 :] = drafter.spare

    def _step(self, b: int) -> torch.Tensor:
        tokens, positions, _, last, tables = split_inputs(self.inputs[:b], self.R)
        return self.drafter.draft_batch(
            self.hidden[:b], tokens, positions, last, tables.to(torch.int32), self.k
        )

    @torch.inference_mode()
    def capture(self, b: int) -> None:
        from m3lm.engine.cuda_graphs import capture_graph

        self._graphs[b] = capture_graph(lambda: self._step(b), self._pool)

    def capture_all(self) -> list[int]:
        """Capture every bucket not captured yet; returns those captured now."""
        new = [b for b in self.buckets if b not in self._graphs]
        for b in new:
            self.capture(b)
        return new

    @torch.inference_mode()
    def run(self, rows: list[DraftRows], hidden: torch.Tensor) -> torch.Tensor:
        """Drafts [B, k] of `EagleDrafter.draft_rows`."""
        n = len(rows)
        b = next(x for x in self.buckets if x >= n)
        if b not in self._graphs:
            self.capture(b)
        host = self._host[:b].numpy()
        host[:n] = draft_inputs(rows, self.R, self.width, self.drafter.spare)
        host[n:] = 0  # padding sequences: position 0 over a table of spare pages
        host[n:, 3 * self.R + 1 :] = self.drafter.spare
        self.inputs[:b].copy_(self._host[:b], non_blocking=True)
        at = self.inputs[:n, 2 * self.R : 3 * self.R]
        self.hidden[:n].copy_(hidden[at])  # [n, R, 3 Ct]
        graph, out = self._graphs[b]
        graph.replay()
        return out[:n]
