"""Prompt lookup drafting: guess that the text goes on as it did after an earlier occurrence of
its last few tokens (no weights; it pays where outputs repeat their context: code edits, agents
quoting tool results, extraction)."""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of n_max down to n_min tokens; [] when no such suffix occurs earlier."""
    ids = np.asarray(tokens, dtype=np.int64)
    L = len(ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[: L - 1], n)  # starts 0 .. L-1-n
        hits = np.flatnonzero((windows == ids[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence; at least one token follows it
            return ids[start : start + k].tolist()
    return []
