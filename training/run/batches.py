"""Training sequences from the chunk store, with their neighbour tokens, in a resumable order.

A sequence is a run of L = seq_len / chunk_len consecutive chunks of one split (see
docs/architecture.md). `SequenceBatches.batch(seq_ids)` gives the model's inputs:

    tokens     (b, n)        int64   the chunks' tokens, padding included (n = L · chunk_len)
    labels     (b, n)        int64   the next token; -100 where the next token is padding
    neighbours (b, l, k, r)  int64   RETRO only: neighbour + continuation tokens, -1 = missing

With `self_neighbours` = p > 0 (train.self_neighbours, training split only), a share p of the
chunks get themselves and their continuation as first neighbour: lessons in copying, which
natural text rarely gives (docs/results.md). Which chunks is a pure function of (seed, chunk id).

The order is a seeded permutation per epoch; micro-batch j of the whole run is a pure function
of (seed, j), so a resumed run reads exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np

from retropipe.data.store import ChunkStore
from retropipe.training.models.lm_head import IGNORE_INDEX


class SequenceBatches:
    def __init__(self, store: ChunkStore, split: str, seq_len: int, neighbours=None, k: int = 0,
                 self_neighbours: float = 0.0, seed: int = 0):
        self.store, self.split_name = store, split
        self.chunks = store.split(split)
        self.chunk_len = store.chunk_len
        if seq_len % self.chunk_len:
            raise ValueError(f"seq_len {seq_len} is not a multiple of chunk_len {self.chunk_len}")
        self.chunks_per_seq = seq_len // self.chunk_len
        self.seq_len = seq_len
        self.neighbours, self.k = neighbours, k  # a data.neighbours.NeighbourStore, or None
        self.self_neighbours, self.seed = self_neighbours, seed

    def __len__(self) -> int:
        return self.chunks.num_sequences(self.chunks_per_seq)

    def batch(self, seq_ids: np.ndarray) -> dict[str, np.ndarray]:
        ids = self.chunks.sequence_chunk_ids(np.asarray(seq_ids), self.chunks_per_seq)  # (b, l)
        b, l = ids.shape
        m = self.chunk_len
        tokens = self.chunks.tokens(ids.reshape(-1)).reshape(b, l * m).astype(np.int64)
        real = (np.arange(m)[None, None, :] < self.chunks.lengths[ids][..., None]).reshape(b, l * m)
        # The label of the last position is the first token of the chunk after the sequence.
        nxt = ids[:, -1] + 1
        has_next = nxt < len(self.chunks)
        first_next = np.where(has_next, self.chunks.tokens(np.minimum(nxt, len(self.chunks) - 1))[:, 0], 0)
        labels = np.concatenate([tokens[:, 1:], first_next[:, None].astype(np.int64)], axis=1)
        label_real = np.concatenate([real[:, 1:], has_next[:, None]], axis=1)
        labels[~label_real] = IGNORE_INDEX
        out = {"tokens": tokens, "labels": labels}
        if self.neighbours is not None:
            nbrs = self.neighbours.neighbour_tokens(self.split_name, ids, k=self.k)  # (b, l, k, r)
            if self.self_neighbours > 0:
                lesson = lesson_chunks(ids, self.self_neighbours, self.seed)         # (b, l)
                nbrs[lesson, 0] = self.neighbours.own_tokens(ids[lesson])
            out["neighbours"] = nbrs
        return out


def lesson_chunks(chunk_ids: np.ndarray, share: float, seed: int) -> np.ndarray:
    """(...) bool: about `share` of chunk_ids, drawn by a hash of (seed, chunk id) so resuming repeats it."""
    x = np.asarray(chunk_ids, dtype=np.int64).astype(np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    # splitmix64's finaliser: neighbouring ids get unrelated draws.
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53 < share


@functools.lru_cache(maxsize=4)
def epoch_order(num_sequences: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_sequences)


def sequence_ids_for(micro_batch: int, micro_batch_size: int, dp_rank: int, dp_world: int,
                     num_sequences: int, seed: int) -> np.ndarray:
    """Sequence ids of the `micro_batch`-th micro-batch of data-parallel rank `dp_rank`.

    Global sample s = (micro_batch · dp_world + dp_rank) · micro_batch_size + i; epochs wrap
    with a fresh permutation, so any position in the run can be recomputed on resume.
    """
    if num_sequences < 1:
        raise ValueError("the split holds no complete training sequence; use a smaller train.seq_len")
    start = (micro_batch * dp_world + dp_rank) * micro_batch_size
    samples = np.arange(start, start + micro_batch_size)
    epochs, offsets = np.divmod(samples, num_sequences)
    return np.array([epoch_order(num_sequences, seed, e)[o] for e, o in zip(epochs.tolist(), offsets.tolist())])


def micro_batches(data: SequenceBatches, start: int, micro_batch_size: int, dp_rank: int, dp_world: int,
                  seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Endless micro-batches for one data-parallel rank, from micro-batch index `start`."""
    j = start
    while True:
        yield data.batch(sequence_ids_for(j, micro_batch_size, dp_rank, dp_world, len(data), seed))
        j += 1

