"""Read the retrieval database's neighbours: the contract between retrieval and training.

    nbrs = NeighbourStore(cfg.retrieval_dir, ChunkStore(cfg.data_dir), chunks_per_seq=L)
    ids = nbrs.neighbour_ids("train", chunk_ids)                 # (b, l, k) int64, -1 = missing
    tokens, mask = nbrs.neighbour_tokens("train", chunk_ids)     # (b, l, k, r) int64 / bool

Plain numpy (no faiss, no ray): training imports this, never `retrieval`. Neighbour ids are
chunk ids of the *training* split (the database), whatever split the query chunk is from.
r = 2 · chunk_len: the neighbour chunk followed by its continuation (the next chunk of the same
document). `mask` is False for a missing neighbour, a missing continuation (document end) and
padding inside a chunk (position >= its length); tokens there are the pad id.
The files are written by launch/build_index.py (see docs/retrieval.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data.readers import DataError
from data.store import ChunkStore

REBUILD = "python launch/build_index.py --config <your config>"


class NeighbourStore:
    def __init__(self, retrieval_dir: str | Path, chunk_store: ChunkStore, chunks_per_seq: int | None = None):
        self.dir = Path(retrieval_dir) / "neighbours"
        self.chunk_store = chunk_store
        path = self.dir / "manifest.json"
        if not path.exists():
            raise DataError(f"no neighbours at {self.dir} (missing {path}); run: {REBUILD}")
        try:
            self.manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: corrupt manifest ({e}); run: {REBUILD}") from None
        built_for = self.manifest.get("chunk_store_fingerprint")
        if built_for != chunk_store.fingerprint:
            raise DataError(f"stale neighbours: {path} was built for chunk store {built_for}, but "
                            f"{chunk_store.root} has fingerprint {chunk_store.fingerprint}; rebuild them: {REBUILD}")
        stored_l = self.manifest.get("chunks_per_seq")
        if chunks_per_seq is not None and stored_l != chunks_per_seq:
            # Another sequence length would let a neighbour come from a document of the same sequence.
            raise DataError(f"{path}: neighbours exclude documents of {stored_l}-chunk training sequences, but "
                            f"{chunks_per_seq} chunks per sequence were asked for (train.seq_len / data.chunk_len); "
                            f"rebuild them: {REBUILD}")
        self.k: int = int(self.manifest["k"])
        self.chunk_len = chunk_store.chunk_len
        self.r = 2 * self.chunk_len
        self._ids: dict[str, np.ndarray] = {}
        self._db = chunk_store.split("train")
        self._continuation = self._db.continuation_ids()  # (N,) next chunk of the same document or -1

    def ids(self, split: str) -> np.ndarray:
        """(num_chunks, k) int64 memory-mapped neighbour ids of every chunk of the split."""
        if split not in self._ids:
            path = self.dir / f"{split}.npy"
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise DataError(f"{path}: unreadable neighbours ({e}); run: {REBUILD}") from None
            expected = (len(self.chunk_store.split(split)), self.k)
            if arr.shape != expected or arr.dtype != np.int64:
                raise DataError(f"{path}: {arr.shape} {arr.dtype}, expected {expected} int64; run: {REBUILD}")
            self._ids[split] = arr
        return self._ids[split]

    def _k(self, k: int | None) -> int:
        k = self.k if k is None or k == 0 else k
        if not 1 <= k <= self.k:
            raise DataError(f"{k} neighbours asked for, but {self.dir} stores {self.k} per chunk (retrieval.k)")
        return k

    def neighbour_ids(self, split: str, chunk_ids: np.ndarray, k: int | None = None) -> np.ndarray:
        """(..., k) int64 training-split chunk ids of the neighbours of chunk_ids (...), -1 = missing."""
        chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        return np.asarray(self.ids(split)[chunk_ids.reshape(-1), :self._k(k)]).reshape(*chunk_ids.shape, -1)

    def neighbour_tokens(self, split: str, chunk_ids: np.ndarray, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Neighbour + continuation tokens of chunk_ids (b, l): (tokens, mask), each (b, l, k, r)."""
        return self.tokens_of(self.neighbour_ids(split, chunk_ids, k))

    def tokens_of(self, nbr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Training chunks nbr (..., k), -1 = none, with their continuations: (tokens, mask), each (..., k, r)."""
        cont = np.where(nbr >= 0, self._continuation[np.maximum(nbr, 0)], -1)  # (..., k)
        halves = [self._chunk_tokens(ids) for ids in (nbr, cont)]          # each ((..., k, m), (..., k, m))
        tokens = np.concatenate([halves[0][0], halves[1][0]], axis=-1)      # (..., k, r)
        mask = np.concatenate([halves[0][1], halves[1][1]], axis=-1)        # (..., k, r)
        return tokens, mask

    def _chunk_tokens(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and validity of training chunks ids (...), -1 = none: each (..., chunk_len)."""
        flat = ids.reshape(-1)
        present = flat >= 0
        safe = np.where(present, flat, 0)
        tokens = self._db.tokens(safe).astype(np.int64)                     # (n, m)
        valid = present[:, None] & (np.arange(self.chunk_len)[None, :] < self._db.lengths[safe][:, None])
        tokens[~valid] = self.chunk_store.pad_id
        shape = (*ids.shape, self.chunk_len)
        return tokens.reshape(shape), valid.reshape(shape)
