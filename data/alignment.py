"""Neighbour alignment: slide each neighbour window along its document to line up with its query chunk.

RETRO feeds chunk u's neighbours [N, F] (neighbour chunk, continuation) to the tokens that follow
chunk u, so a neighbour helps most when F continues the text exactly where chunk u stops. A
near-duplicate in the database (another edition of a page, a quoted paragraph, a twin document with
a sentence dropped) is found by its embedding, but its chunk boundaries fall at another phase of the
shared text: N holds the query's tokens shifted by s, and F is s tokens off too. A model as small as
ours learns to copy a neighbour at a fixed offset quickly, and a content-addressed copy at an
arbitrary offset slowly (docs/results.md), so we move the window instead of asking the model to.

For each neighbour we take the 4 · chunk_len tokens of its document around it (the chunk before,
the chunk, and two after) and count, for every shift s in (-chunk_len, chunk_len), the tokens of
the query chunk that equal the window's tokens at the same position. A neighbour whose best shift
matches fewer than `min_match` tokens does not line up and stays as retrieved (s = 0), so unrelated
neighbours stay the paper's [N, F]. Otherwise it becomes the 2 · chunk_len tokens starting s after
its chunk's start, where s lines up the *end* of the query chunk: the most matches among its last
chunk_len / 8 tokens (when some shift matches at least 3/8 of those), then the most matches
overall, then the smallest |s|. The end decides because F is read right after it: where the two
texts differ by an inserted or dropped phrase, the shift with the most matches overall can line up
the query's first half and leave F off by the phrase's length (on techdocs' dictionaries, 34% of
the tokens of high-overlap chunks lined up with their neighbour that way, 54% this way;
docs/results.md). `retrieval.align_neighbours` switches alignment (default on);
`retrieval.aligned_only` drops the neighbours that do not line up.
"""

from __future__ import annotations

import numpy as np

MIN_MATCH_FRACTION = 0.25    # of chunk_len: 16 of 64 tokens; unrelated text matches ~3 by chance
TAIL_FRACTION = 1 / 8        # of chunk_len: the query's last 8 of 64 tokens decide the shift ...
TAIL_MIN_FRACTION = 3 / 8    # ... when some shift matches 3 of those 8 (a single token matches by chance)
# Names the rule where it decides what is computed: evaluation reports' fingerprints and training
# runs' rules.json (another rule, another report, another run). Change it with any constant above.
ALIGNMENT_RULE = "end-first/8"


def best_shifts(query: np.ndarray, region: np.ndarray, min_match: int) -> tuple[np.ndarray, np.ndarray]:
    """query (n, m) tokens (-1 = none), region (n, 4m) tokens (-1 = none) whose [m, 2m) is the retrieved
    chunk: (n,) int64 shift s in (-m, m) by the rule above (matches at s: #{t : query[t] ==
    region[m + s + t] >= 0}), 0 where no shift has min_match matches; and (n,) bool: whether one has
    (the neighbour lines up)."""
    n, m = query.shape
    tail = max(1, round(TAIL_FRACTION * m))
    shifts = np.arange(-(m - 1), m)                               # (S,)
    index = m + shifts[:, None] + np.arange(m)[None, :]           # (S, m) positions in region
    matches = np.zeros((n, len(shifts)), dtype=np.int64)
    tail_matches = np.zeros((n, len(shifts)), dtype=np.int64)
    for start in range(0, n, 256):                                # bounds the (rows, S, m) temporary
        q = query[start:start + 256, None, :]                     # (rows, 1, m)
        window = region[start:start + 256][:, index]              # (rows, S, m)
        equal = (window == q) & (q >= 0)
        matches[start:start + 256] = equal.sum(-1)
        tail_matches[start:start + 256] = equal[..., -tail:].sum(-1)
    # Where no shift lines up the end well enough, the tail counts nothing and matches decide alone.
    end_lines_up = tail_matches.max(axis=1, keepdims=True) >= max(1, round(TAIL_MIN_FRACTION * tail))
    tail_matches = np.where(end_lines_up, tail_matches, 0)
    # Lexicographic (tail matches, matches, -|s|): each term's range is below the weight of the one before.
    score = (tail_matches * (m + 1) + matches) * (2 * m) - np.abs(shifts)[None, :]
    best = np.argmax(score, axis=1)
    lined_up = matches.max(axis=1) >= min_match
    return np.where(lined_up, shifts[best], 0), lined_up


def aligned_windows(region: np.ndarray, shifts: np.ndarray, r: int) -> np.ndarray:
    """region (n, 4m), shifts (n,) -> (n, r) tokens region[m + s : m + s + r]."""
    m = region.shape[1] // 4
    index = m + shifts[:, None] + np.arange(r)[None, :]
    return np.take_along_axis(region, index, axis=1)
