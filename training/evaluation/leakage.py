"""Leakage analysis (RETRO §2.6, §4.4): how much of an evaluated chunk its neighbours already hold.

The tokens of chunk u are predicted with the neighbours of chunk u − 1 (the chunked
cross-attention's causal shift, training/models/cca.py), so

    α(u) = longest common token substring of chunk u and the neighbours of chunk u − 1
           (each neighbour with its continuation) ÷ chunk_len.

α = 1 means the neighbours contain the whole chunk; the first chunk of a split has no
neighbours before it (α = 0). Bits per byte is then reported per α bucket.
"""

from __future__ import annotations

import numpy as np

# Cumulative buckets "α ≤ x" (α ≤ 12.5% = at most 8 shared tokens of 64), and the high-overlap one.
ALPHA_AT_MOST = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)
ALPHA_HIGH = 0.5
# Upper edges of the disjoint slices between α = 0 and α ≥ ALPHA_HIGH.
ALPHA_SLICE_EDGES = (0.125, 0.25)


def longest_common_substring(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest run of tokens that a and b share (dynamic programming, O(|a|·|b|))."""
    if len(a) == 0 or len(b) == 0:
        return 0
    eq = a[:, None] == b[None, :]
    prev = np.zeros(len(b) + 1, dtype=np.int64)
    best = 0
    for i in range(len(a)):
        cur = np.zeros(len(b) + 1, dtype=np.int64)
        cur[1:] = np.where(eq[i], prev[:-1] + 1, 0)
        best = max(best, int(cur.max()))
        prev = cur
    return best


def overlap_ratios(chunks: np.ndarray, lengths: np.ndarray, neighbours: np.ndarray, chunk_len: int) -> np.ndarray:
    """α per chunk: (c,) from chunk tokens (c, m) and the neighbours each is predicted with (c, k, r),
    -1 = missing. neighbours[u] must already be those of chunk u − 1 (see predicting_neighbours)."""
    alpha = np.zeros(len(chunks))
    for u in range(len(chunks)):
        own = chunks[u][: lengths[u]]
        best = 0
        for row in neighbours[u]:
            best = max(best, longest_common_substring(own, row[row >= 0]))
        alpha[u] = best / chunk_len
    return alpha


def predicting_neighbours(neighbours, split: str, chunk_ids: np.ndarray, k: int) -> np.ndarray:
    """(c, k, r) the neighbours chunk u is predicted with: those of chunk u − 1 (none for chunk 0).

    neighbours: anything with neighbour_tokens(split, ids, k) -> (..., k, r) (data.neighbour_store.NeighbourStore).
    """
    tokens = neighbours.neighbour_tokens(split, np.maximum(chunk_ids - 1, 0), k=k)
    tokens[chunk_ids == 0] = -1
    return tokens


def leakage(chunks, neighbours, k: int, count: int) -> np.ndarray:
    """α of the first `count` chunks of a split (chunks: data.store.SplitChunks)."""
    ids = np.arange(count)
    return overlap_ratios(chunks.tokens(ids), chunks.lengths, predicting_neighbours(neighbours, chunks.split, ids, k),
                          chunks.chunk_len)


def alpha_buckets(alpha: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(label, selection) per α bucket: cumulative from 0 (α ≤ 0, ≤ 12.5%, …, all), then α ≥ 50%."""
    out = [(f"α ≤ {hi:.1%}", alpha <= hi + 1e-9) for hi in ALPHA_AT_MOST]
    out.append((f"α ≥ {ALPHA_HIGH:.0%}", alpha >= ALPHA_HIGH - 1e-9))
    return out


def alpha_slices(alpha: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(label, selection) per disjoint α slice: α = 0, then (0, 12.5%], (12.5%, 25%], (25%, 50%),
    [50%, 100%]. Every chunk lies in exactly one: a slice shows harm that a cumulative bucket
    averages away."""
    eps = 1e-9
    edges = [(0.0, ALPHA_SLICE_EDGES[0]), *zip(ALPHA_SLICE_EDGES, ALPHA_SLICE_EDGES[1:])]
    out = [("α = 0", alpha <= eps)]
    out += [(f"{lo:.1%} < α ≤ {hi:.1%}", (alpha > lo + eps) & (alpha <= hi + eps)) for lo, hi in edges]
    out.append((f"{ALPHA_SLICE_EDGES[-1]:.1%} < α < {ALPHA_HIGH:.0%}", (alpha > ALPHA_SLICE_EDGES[-1] + eps)
                & (alpha < ALPHA_HIGH - eps)))
    out.append((f"α ≥ {ALPHA_HIGH:.0%}", alpha >= ALPHA_HIGH - eps))
    return out
