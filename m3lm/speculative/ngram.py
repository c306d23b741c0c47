"""Prompt lookup drafting: guess that the text goes on as it did after an earlier occurrence of
its last few tokens (no weights; it pays where outputs repeat their context: code edits, agents
quoting tool results, extraction)."""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of n_max down to n_min tokens; [] when no such suffix occurs earlier.

    Every earlier occurrence of the last token is a candidate end; one vectorised pass keeps
    those preceded by the second-to-last token too, which are extended backwards one at a time,
    the latest first."""
    ids = np.asarray(tokens)
    L = len(ids)
    n_max = min(n_max, L - 1)
    if n_max < max(n_min, 1):
        return []
    ends = np.flatnonzero(ids[: L - 1] == ids[L - 1])  # where an earlier match would end
    if not ends.size:
        return []
    best, end = 1, int(ends[-1])
    if n_max > 1:
        ends = ends[ends >= 1]
        ends = ends[ids[ends - 1] == ids[L - 2]]  # matches of two tokens at least
        tail = ids[L - n_max :].tolist()[::-1]  # tail[i] = ids[L - 1 - i]
        for e in reversed(ends.tolist()):
            m = 2
            while m < n_max and e >= m and ids[e - m] == tail[m]:
                m += 1
            if m > best:
                best, end = m, e
                if m == n_max:
                    break
    if best < n_min:
        return []
    return ids[end + 1 : end + 1 + k].tolist()


class Lookup:
    """A sequence's tokens as a growing array, for `propose` without copying them every step."""

    __slots__ = ("ids", "n")

    def __init__(self) -> None:
        self.ids = np.empty(256, dtype=np.int64)
        self.n = 0

    def propose(self, seq, k: int, n_min: int, n_max: int) -> list[int]:
        """`propose` over the sequence's tokens (`Sequence`: only ever appended to)."""
        new = seq.tokens(self.n, seq.num_tokens)
        if self.n + len(new) > len(self.ids):
            self.ids = np.resize(self.ids, max(2 * len(self.ids), self.n + len(new)))
        self.ids[self.n : self.n + len(new)] = new
        self.n += len(new)
        return propose(self.ids[: self.n], k, n_min, n_max)
