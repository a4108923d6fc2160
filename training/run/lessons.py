"""Lessons: training chunks whose first neighbour is replaced by one chosen to teach the chunked
cross-attention when to copy and when not to (RETRO only, training split only, never evaluated).

    copy        train.self_neighbours       the chunk itself and its continuation: a neighbour
                                            that holds the very next tokens (natural text rarely
                                            offers one, docs/results.md)
    diverging   train.diverging_neighbours  the same, but from a random point of the continuation
                                            on another document's text: it lines up, holds the next
                                            tokens for a while, then stops; worth copying only while
                                            it keeps matching what was read
    distractor  train.distractor_neighbours another document's chunk and continuation, as retrieved:
                                            text that does not belong, to be read and ignored

A database returns all three kinds (an edited copy diverges where the edit is; a topical
neighbour does not belong), and a model that only ever saw the first copies the others too.
One uniform draw per chunk decides its lesson (copy below the first share, then diverging, then
distractor), and the cut and the other chunk are drawn the same way: all pure functions of
(seed, chunk id), so a resumed run reads exactly what the uninterrupted one did, and the copy
lessons do not change when the other shares are added.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15


def uniform(chunk_ids: np.ndarray, seed: int, salt: int = 0) -> np.ndarray:
    """(...) float64 in [0, 1): a hash of (seed, salt, chunk id)."""
    x = np.asarray(chunk_ids, dtype=np.int64).astype(np.uint64) + np.uint64((seed * _GOLDEN + salt * 0xD1B54A32D192ED03)
                                                                           % 2**64)
    # splitmix64's finaliser: neighbouring ids get unrelated draws.
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53


@dataclass(frozen=True)
class Lessons:
    copy: float = 0.0
    diverging: float = 0.0
    distractor: float = 0.0

    @property
    def any(self) -> bool:
        return self.copy + self.diverging + self.distractor > 0

    def kinds(self, chunk_ids: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(...) bool masks of the chunks that get a copy, a diverging and a distractor lesson."""
        u = uniform(chunk_ids, seed)
        a, b = self.copy, self.copy + self.diverging
        return u < a, (u >= a) & (u < b), (u >= b) & (u < b + self.distractor)


def other_chunks(chunk_ids: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A training chunk a third to two thirds of the split away from each one: another document."""
    ids = np.asarray(chunk_ids, dtype=np.int64)
    return (ids + n // 3 + (uniform(ids, seed, salt=2) * max(n // 3, 1)).astype(np.int64)) % n


def apply_lessons(nbrs: np.ndarray, chunk_ids: np.ndarray, lessons: Lessons, seed: int, neighbours) -> np.ndarray:
    """nbrs (b, l, k, r) of training chunks chunk_ids (b, l) with their first neighbour replaced by
    each chunk's lesson. neighbours: the data.neighbour_store.NeighbourStore they came from."""
    copy, diverging, distractor = lessons.kinds(chunk_ids, seed)
    if copy.any():
        nbrs[copy, 0] = neighbours.own_tokens(chunk_ids[copy])
    stray = diverging | distractor
    if stray.any():
        database, n = neighbours.database, neighbours.database.parts[0].chunks
        others = database.neighbour_tokens(other_chunks(chunk_ids[stray], n, seed)[:, None])[:, 0]   # (s, r)
        if diverging.any():
            m, r = database.chunk_len, database.r
            own = neighbours.own_tokens(chunk_ids[diverging])                                           # (d, r)
            # From a random token of the continuation on, another document's text.
            cut = m + (uniform(chunk_ids[diverging], seed, salt=1) * m).astype(np.int64)               # (d,)
            later = np.arange(r)[None, :] >= cut[:, None]
            nbrs[diverging, 0] = np.where(later, others[diverging[stray]], own)
        if distractor.any():
            nbrs[distractor, 0] = others[distractor[stray]]
    return nbrs
