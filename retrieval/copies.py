"""Exact copies among the chunks of a database, found before embedding so each text is embedded once.

    copies = find_copies([store_a, store_b])        # every part of a database, in its order
    copies.in_range(1, "train", 0, 1024)            # ids of part 1's chunks 0 … 1023 that copy an earlier one
    copies.sources_of(1, "train", ids)              # (part, split index, id) of the chunk each copies

A chunk copies another when their tokens are the same (the same length, the same ids; what lies
past the length is padding and not compared): they decode to the same text, so the embedder
would compute the same vector twice. Each chunk's source is the first chunk with its tokens in
the order parts → splits (SPLITS) → ids; a source copies nothing. The order is the database's own
(the training data first, then each further corpus as configured), so which chunk is embedded
and which is copied depends on the data alone, never on who embeds it or on a resume.

Candidates are found by a 64-bit hash of each chunk's tokens, and every pair it matches is then
compared token for token: a hash collision can only leave a copy unfound, never copy a wrong vector.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from retropipe.data.chunking import SPLITS
from retropipe.data.errors import BUILD_DATABASE
from retropipe.data.stage import load_npy, save_npy
from retropipe.data.store import ChunkStore

# Chunks hashed at a time: (rows, chunk_len) uint64 stays tens of MB at any database size.
HASH_BLOCK = 65536


def masked_tokens(split, ids: np.ndarray, width: int) -> np.ndarray:
    """(len(ids), width) int64: each chunk's tokens + 1, 0 past its length (padding compares equal)."""
    tokens, lengths = split.tokens(ids).astype(np.int64) + 1, split.lengths[ids]
    out = np.zeros((len(ids), width), np.int64)
    out[:, :tokens.shape[1]] = np.where(np.arange(tokens.shape[1]) < lengths[:, None], tokens, 0)
    return out


def chunk_keys(split, width: int) -> np.ndarray:
    """(chunks,) uint64: a hash of each chunk's tokens (padding excluded), equal for equal chunks."""
    weights = np.random.default_rng(0).integers(1, 2**63, size=width, dtype=np.uint64) | np.uint64(1)
    keys = np.empty(len(split), np.uint64)
    for start in range(0, len(split), HASH_BLOCK):
        ids = np.arange(start, min(start + HASH_BLOCK, len(split)))
        # uint64 products and sums wrap around: a hash modulo 2^64, as intended.
        keys[start:start + len(ids)] = (masked_tokens(split, ids, width).astype(np.uint64) * weights).sum(1)
    return keys


@dataclass
class ChunkCopies:
    """The copies of a database's parts: per (part, split), the ids that copy an earlier chunk and,
    aligned with them, (part, split index in SPLITS, id) of the chunk each copies."""

    ids: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)       # sorted (m,) int64
    sources: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)   # (m, 3) int64

    def __len__(self) -> int:
        return sum(len(v) for v in self.ids.values())

    def in_range(self, part: int, split: str, start: int, stop: int) -> np.ndarray:
        """Ids in [start, stop) of (part, split) that copy an earlier chunk."""
        ids = self.ids.get((part, split), np.zeros(0, np.int64))
        return ids[np.searchsorted(ids, start):np.searchsorted(ids, stop)]

    def sources_of(self, part: int, split: str, ids: np.ndarray) -> np.ndarray:
        """(len(ids), 3) (part, split index, id) of the chunk each of `ids` (copies, from in_range) copies."""
        if not len(ids):
            return np.zeros((0, 3), np.int64)
        return self.sources[(part, split)][np.searchsorted(self.ids[(part, split)], ids)]


def find_copies(stores: list[ChunkStore]) -> ChunkCopies:
    """Every chunk of `stores` (a database's parts, in its order) that copies an earlier one."""
    width = max(store.chunk_len for store in stores)
    groups = [(p, split) for p in range(len(stores)) for split in SPLITS]
    splits = {(p, split): stores[p].split(split) for p, split in groups}
    keys = np.concatenate([chunk_keys(splits[g], width) for g in groups])
    offsets = np.cumsum([0] + [len(splits[g]) for g in groups])
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)  # first: first occurrences
    source = first[inverse.reshape(-1)]
    copy = np.nonzero(source != np.arange(len(keys)))[0]

    def locate(flat: np.ndarray) -> np.ndarray:   # global indices → (group, id)
        group = np.searchsorted(offsets, flat, side="right") - 1
        return np.stack([group, flat - offsets[group]], 1)

    def rows(located: np.ndarray) -> np.ndarray:  # masked tokens of (group, id) pairs
        out = np.zeros((len(located), width), np.int64)
        for g in np.unique(located[:, 0]):
            sel = located[:, 0] == g
            out[sel] = masked_tokens(splits[groups[g]], located[sel, 1], width)
        return out

    copies, sources = locate(copy), locate(source[copy])
    # A hash collision is no copy; compared a block at a time, so memory stays bounded.
    confirmed = np.concatenate([np.ones(0, bool)] + [
        (rows(copies[i:i + HASH_BLOCK]) == rows(sources[i:i + HASH_BLOCK])).all(1)
        for i in range(0, len(copies), HASH_BLOCK)])
    copies, sources = copies[confirmed], sources[confirmed]
    result = ChunkCopies()
    for g in np.unique(copies[:, 0]):
        sel = copies[:, 0] == g
        part, split = groups[g]
        src_group = sources[sel, 0]
        result.ids[(part, split)] = copies[sel, 1]            # ascending: copy indices were sorted
        result.sources[(part, split)] = np.stack(
            [src_group // len(SPLITS), src_group % len(SPLITS), sources[sel, 1]], 1)
    return result


class ShardAssembly:
    """The driver's side of an embedding pass: each job's vectors gathered into its chunk-store
    shard, written (`save_npy`, atomic) once all the shard's jobs are in and every copy in it has
    its source's vector, from this pass or from a shard already on disk.

    pending: {(part, split, shard): jobs}, the shards this pass writes; path_of(part, split, shard):
    a shard's file. A source precedes its copies in the database's order and copies nothing, so
    every source is embedded by some job: a shard waits only for jobs still to come."""

    def __init__(self, stores: list[ChunkStore], path_of, pending: dict, copies: ChunkCopies, jobs: list):
        self.path_of, self.pending, self.copies = path_of, pending, copies
        self.pieces: dict[tuple[int, str, int], list] = {key: [] for key in pending}
        self.complete: list[tuple[int, str, int]] = []    # every job in, a source still to come
        self.dim: int | None = None
        # Copies still to write per source: a source's vector is kept from its job until its last copy is written.
        self.uses: Counter = Counter(tuple(source) for job in jobs for source in
                                     copies.sources_of(job.part, job.split, np.asarray(job.skip, np.int64)).tolist())
        need: dict[tuple[int, str], set] = {}
        for part, split, chunk in self.uses:
            need.setdefault((part, SPLITS[split]), set()).add(chunk)
        self.need = {key: np.array(sorted(ids), np.int64) for key, ids in need.items()}
        self.known: dict[tuple[int, int, int], np.ndarray] = {}  # sources embedded in this pass
        # First chunk id of each chunk-store shard, per (part, split index): where a source's shard lies.
        self.offsets = {(p, i): np.cumsum([0] + store.manifest["shard_chunks"][split])
                        for p, store in enumerate(stores) for i, split in enumerate(SPLITS)}
        self._maps: dict = {}
        # A complete shard that waits for a source: its pieces in order, its copies' ids and sources, and
        # the sources' vectors found so far. It resumes where it stopped, so each copy is listed and
        # looked up once, not again on every job that arrives.
        self._waiting: dict[tuple[int, str, int], tuple] = {}

    @property
    def unwritten(self) -> list[tuple[int, str, int]]:
        return sorted(self.pieces)

    def add(self, job, vectors: np.ndarray) -> None:
        """A job's (stop - start, d) vectors, zero rows where it skipped a copy."""
        self.dim = vectors.shape[1]
        need = self.need.get((job.part, job.split), np.zeros(0, np.int64))
        for chunk in need[(need >= job.start) & (need < job.stop)].tolist():   # a copy, not a view of the job
            self.known[(job.part, SPLITS.index(job.split), chunk)] = vectors[chunk - job.start].copy()
        key = (job.part, job.split, job.shard)
        self.pieces[key].append((job.start, vectors, job.skip))
        if len(self.pieces[key]) == self.pending[key]:
            self.complete.append(key)
        self.complete = [key for key in self.complete if not self._write(key)]

    def _write(self, key: tuple[int, str, int]) -> bool:
        """Write a complete shard with its copies filled in; False while a source is still to come."""
        if key not in self._waiting:
            part, split, _ = key
            pieces = sorted(self.pieces[key], key=lambda piece: piece[0])
            skip = np.array([chunk for _, _, skipped in pieces for chunk in skipped], np.int64)
            sources = [tuple(source) for source in self.copies.sources_of(part, split, skip).tolist()]
            self._waiting[key] = (pieces, skip, sources, [])
        pieces, skip, sources, vectors = self._waiting[key]
        for source in sources[len(vectors):]:
            vector = self._source(*source)
            if vector is None:
                return False
            vectors.append(vector)
        del self._waiting[key]
        rows = np.concatenate([v for _, v, _ in pieces])
        if len(skip):
            rows[skip - pieces[0][0]] = np.stack(vectors)
        save_npy(self.path_of(*key), rows)
        del self.pieces[key]
        for source in sources:
            self.uses[source] -= 1
            if not self.uses[source]:
                self.known.pop(source, None)
        return True

    def _source(self, part: int, split_index: int, chunk: int) -> np.ndarray | None:
        """A source's vector: embedded in this pass, or read from its shard on disk; None while its job is to come."""
        if (part, split_index, chunk) in self.known:
            return self.known[(part, split_index, chunk)]
        split, offsets = SPLITS[split_index], self.offsets[(part, split_index)]
        shard = int(np.searchsorted(offsets, chunk, side="right") - 1)
        if (part, split, shard) in self.pending:   # written by this pass: its vectors are known once embedded
            return None
        path = self.path_of(part, split, shard)
        if path not in self._maps:
            self._maps[path] = load_npy(path, rerun=f"run {BUILD_DATABASE}")
        return np.asarray(self._maps[path][chunk - offsets[shard]])
