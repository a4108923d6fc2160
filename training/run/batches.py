"""Training sequences from the chunk store, with their neighbour tokens, in a resumable order.

A sequence is a run of L = seq_len / chunk_len consecutive chunks of one split (see
docs/architecture.md). `SequenceBatches.batch(seq_ids)` gives the model's inputs:

    tokens     (b, n)        int64   the chunks' tokens, padding included (n = L · chunk_len)
    labels     (b, n)        int64   the next token; -100 where the next token is padding
    neighbours (b, l, k, r)  int64   RETRO only: neighbour + continuation tokens, -1 = missing

With `in_context` k > 0 (model.in_context: the in-context-trained GPT-2), each sequence is read
instead as the in-context rival reads a chunk: its last chunk u is the only target, and the input
is [the k neighbours of chunk u − 1][the chunks before u that fit, and u] (data/reading.py
in_context_tokens), right-padded to seq_len with the pad token; no neighbours key.

With `lessons` (training split only), a share of the chunks get a first neighbour chosen to
teach the CCA when to copy: themselves and their continuation, the same diverging into another
document's text, or another document's chunk (training/run/lessons.py).

The order is a seeded permutation per epoch; micro-batch j of the whole run is a pure function
of (seed, j), so a resumed run reads exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np

from retropipe.data.reading import in_context_text_chunks, in_context_tokens
from retropipe.data.store import ChunkStore
from retropipe.training.models.lm_head import IGNORE_INDEX
from retropipe.training.run.lessons import Lessons, apply_lessons


class SequenceBatches:
    def __init__(self, store: ChunkStore, split: str, seq_len: int, neighbours=None, k: int = 0,
                 lessons: Lessons = Lessons(), seed: int = 0, in_context: int = 0):
        self.store, self.split_name = store, split
        self.chunks = store.split(split)
        self.chunk_len = store.chunk_len
        if seq_len % self.chunk_len:
            raise ValueError(f"seq_len {seq_len} is not a multiple of chunk_len {self.chunk_len}")
        self.chunks_per_seq = seq_len // self.chunk_len
        self.seq_len = seq_len
        self.neighbours, self.k = neighbours, k  # a data.neighbour_store.NeighbourStore, or None
        self.lessons, self.seed = lessons, seed
        self.in_context = in_context
        if in_context:
            self.text_chunks = in_context_text_chunks(seq_len, self.chunk_len, in_context, "model.in_context")

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
            nbrs = self.neighbours.neighbour_tokens(self.split_name, ids, k=self.in_context or self.k)  # (b, l, k, r)
            if self.lessons.any:
                nbrs = apply_lessons(nbrs, ids, self.lessons, self.seed, self.neighbours)
            if self.in_context:
                return self.in_context_batch(tokens, labels, nbrs[:, -2])
            out["neighbours"] = nbrs
        return out

    def in_context_batch(self, tokens: np.ndarray, labels: np.ndarray, read: np.ndarray) -> dict[str, np.ndarray]:
        """tokens, labels (b, n) of whole sequences and read (b, k, r), the neighbours of each one's
        chunk before last: the in-context rows (see the module docstring)."""
        b, n = tokens.shape
        text = n - self.text_chunks * self.chunk_len                      # where the text that fits begins
        rows = np.full((b, self.seq_len), self.store.pad_id, dtype=np.int64)
        row_labels = np.full((b, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        for i in range(b):
            row = in_context_tokens(read[i], tokens[i, text:])
            rows[i, :len(row)] = row
            # The last chunk's targets, predicted from the position before each (labels[j] is the
            # token after j): their labels keep IGNORE_INDEX where the sequence's did (padding).
            last = len(row) - self.chunk_len
            row_labels[i, last - 1:len(row) - 1] = labels[i, n - self.chunk_len - 1:n - 1]
        return {"tokens": rows, "labels": row_labels}


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

