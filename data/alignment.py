"""Neighbour alignment: slide each neighbour window along its document to line up with its query chunk.

RETRO feeds chunk u's neighbours [N, F] (neighbour chunk, continuation) to the tokens that follow
chunk u, so a neighbour helps most when F continues the text exactly where chunk u stops. A
near-duplicate in the database (another edition of a page, a quoted paragraph, a twin document with
a sentence dropped) is found by its embedding, but its chunk boundaries fall at another phase of the
shared text: N holds the query's tokens shifted by s, and F is s tokens off too. A model as small as
ours learns to copy a neighbour at a fixed offset quickly, and a content-addressed copy at an
arbitrary offset slowly (docs/results.md), so we move the window instead of asking the model to.

For each neighbour we take the 4 · chunk_len tokens of its document around it (the chunk before,
the chunk, and two after) and pick the shift s in (-chunk_len, chunk_len) at which the most tokens
of the query chunk equal the window's tokens at the same position; the neighbour becomes the
2 · chunk_len tokens starting s after its chunk's start. Shifts matching fewer than `min_match`
tokens leave the neighbour as retrieved (s = 0), so unrelated neighbours stay the paper's [N, F].
Ties go to the smallest |s|. `retrieval.align_neighbours` switches it (default on);
`retrieval.aligned_only` drops the neighbours that do not line up (fewer than `min_match`).
"""

from __future__ import annotations

import numpy as np

MIN_MATCH_FRACTION = 0.25    # of chunk_len: 16 of 64 tokens; unrelated text matches ~3 by chance


def best_shifts(query: np.ndarray, region: np.ndarray, min_match: int) -> tuple[np.ndarray, np.ndarray]:
    """query (n, m) tokens (-1 = none), region (n, 4m) tokens (-1 = none) whose [m, 2m) is the retrieved
    chunk: (n,) int64 shift s in (-m, m) maximising #{t : query[t] == region[m + s + t] >= 0}, 0 below
    min_match; and (n,) bool: whether that best shift reached min_match (the neighbour lines up)."""
    n, m = query.shape
    shifts = np.arange(-(m - 1), m)                               # (S,)
    index = m + shifts[:, None] + np.arange(m)[None, :]           # (S, m) positions in region
    matches = np.zeros((n, len(shifts)), dtype=np.int64)
    for start in range(0, n, 256):                                # bounds the (rows, S, m) temporary
        q = query[start:start + 256, None, :]                     # (rows, 1, m)
        window = region[start:start + 256][:, index]              # (rows, S, m)
        matches[start:start + 256] = ((window == q) & (q >= 0)).sum(-1)
    score = matches * (2 * m) - np.abs(shifts)[None, :]           # most matches, then smallest |s|
    best = np.argmax(score, axis=1)
    lined_up = matches[np.arange(n), best] >= min_match
    return np.where(lined_up, shifts[best], 0), lined_up


def aligned_windows(region: np.ndarray, shifts: np.ndarray, r: int) -> np.ndarray:
    """region (n, 4m), shifts (n,) -> (n, r) tokens region[m + s : m + s + r]."""
    m = region.shape[1] // 4
    index = m + shifts[:, None] + np.arange(r)[None, :]
    return np.take_along_axis(region, index, axis=1)
