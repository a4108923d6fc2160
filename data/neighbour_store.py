"""Read the neighbours of a chunk store's chunks: the contract between retrieval and training.

    nbrs = NeighbourStore.of(cfg.retrieval_dir, ChunkStore(cfg.data_dir), chunks_per_seq=L,
                             reading=Reading.for_training(cfg.retrieval))
    nbrs.neighbour_ids("train", chunk_ids)        # (b, l, k) int64 database ids, -1 = missing
    nbrs.neighbour_tokens("train", chunk_ids)     # (b, l, k, r) int64 token ids, -1 = missing
    nbrs.read_as(reading.but(shuffled=True))      # the same neighbours, read another way

One representation from disk to the model: token ids with -1 where a token is missing (no
neighbour, no continuation at a document's end, padding inside a chunk), exactly what
`Retro.forward` takes. r = 2 · chunk_len: the neighbour chunk followed by its continuation,
as the store's `Reading` gives them (data/reading.py: lined up with the chunk, filtered, shuffled).
Neighbour ids are database ids (data/database_reader.py): part 0 is the training split, so without
further corpora they are training-split chunk ids.

A neighbours directory holds `<split>.npy` ((chunks of the split, k) int64) and manifest.json,
which names the query chunk store (fingerprint), the database (path and fingerprint), k, and
the training sequence length the exclusion rules used. `<retrieval_dir>/neighbours/` covers the
training chunk store; `launch/evaluate.py --corpus/--database` writes others beside its report.
Plain numpy (no faiss, no ray): training imports this, never `retrieval`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from retropipe.data.database_reader import DATABASE_FILE, Database, resolve_part_path
from retropipe.data.errors import BUILD_DATABASE, DataError
from retropipe.data.reading import Reading, shuffled_order
from retropipe.data.stage import read_json
from retropipe.data.store import ChunkStore


def check_neighbour_count(k: int | None, stored: int, where, asked: str = "neighbours per chunk") -> int:
    """The one rule for how many neighbours a caller may ask for: 1 <= k <= what is stored (0/None = all).

    `asked` names the setting the k came from (e.g. "--neighbours", "eval.more_neighbours").
    """
    k = stored if not k else k
    if not 1 <= k <= stored:
        raise DataError(f"{asked} {k}: {where} holds {stored} per chunk (retrieval.k); rebuild it with a larger "
                        f"retrieval.k for more")
    return k


class NeighbourStore:
    def __init__(self, neighbours_dir: str | Path, chunk_store: ChunkStore, chunks_per_seq: int | None = None,
                 reading: Reading = Reading()):
        self.dir = Path(neighbours_dir)
        self.reading = reading
        self.chunk_store = chunk_store
        path = self.dir / "manifest.json"
        self.manifest = read_json(path, rerun=f"run: {BUILD_DATABASE}")
        if self.manifest is None:
            raise DataError(f"no neighbours at {self.dir} (missing {path}); run: {BUILD_DATABASE}")
        built_for = self.manifest.get("chunk_store_fingerprint")
        if built_for != chunk_store.fingerprint:
            raise DataError(f"stale neighbours: {path} was built for chunk store {built_for}, but "
                            f"{chunk_store.root} has fingerprint {chunk_store.fingerprint}; rebuild them: {BUILD_DATABASE}")
        stored_l = self.manifest.get("chunks_per_seq")
        if chunks_per_seq is not None and stored_l != chunks_per_seq:
            # Another sequence length would let a neighbour come from a document of the same sequence.
            raise DataError(f"{path}: neighbours exclude documents of {stored_l}-chunk training sequences, but "
                            f"{chunks_per_seq} chunks per sequence were asked for (train.seq_len / data.chunk_len); "
                            f"rebuild them: {BUILD_DATABASE}")
        self.database = Database(resolve_part_path(self.dir, self.manifest, "database", DATABASE_FILE))
        if self.database.fingerprint != self.manifest.get("database_fingerprint"):
            raise DataError(f"stale neighbours: {path} was searched in database {self.manifest.get('database_fingerprint')}, "
                            f"but {self.database.root} is now {self.database.fingerprint}; rebuild them: {BUILD_DATABASE}")
        self.k: int = int(self.manifest["k"])
        self.r = self.database.r
        self._ids: dict[str, np.ndarray] = {}
        self._orders: dict[str, np.ndarray] = {}

    @classmethod
    def of(cls, retrieval_dir: str | Path, chunk_store: ChunkStore, chunks_per_seq: int | None = None,
           reading: Reading = Reading()) -> "NeighbourStore":
        """The neighbours of the training chunk store, built by launch/build_index.py."""
        return cls(Path(retrieval_dir) / "neighbours", chunk_store, chunks_per_seq, reading)

    def read_as(self, reading: Reading) -> "NeighbourStore":
        """The same neighbours, read by another rule (the arrays are shared, not reloaded)."""
        other = copy.copy(self)
        other.reading = reading
        return other

    def ids(self, split: str) -> np.ndarray:
        """(num_chunks, k) int64 memory-mapped neighbour ids of every chunk of the split."""
        if split not in self._ids:
            path = self.dir / f"{split}.npy"
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise DataError(f"{path}: unreadable neighbours ({e}); run: {BUILD_DATABASE}") from None
            expected = (len(self.chunk_store.split(split)), self.k)
            if arr.shape != expected or arr.dtype != np.int64:
                raise DataError(f"{path}: {arr.shape} {arr.dtype}, expected {expected} int64; run: {BUILD_DATABASE}")
            self._ids[split] = arr
        return self._ids[split]

    def neighbour_ids(self, split: str, chunk_ids: np.ndarray, k: int | None = None) -> np.ndarray:
        """(..., k) int64 database ids of the neighbours of chunk_ids (...), -1 = missing."""
        k = check_neighbour_count(k, self.k, self.dir)
        chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        return np.asarray(self.ids(split)[chunk_ids.reshape(-1), :k]).reshape(*chunk_ids.shape, k)

    def _shuffled_order(self, split: str) -> np.ndarray:
        if split not in self._orders:
            self._orders[split] = shuffled_order(self.chunk_store.split(split).doc_index)
        return self._orders[split]

    def own_tokens(self, chunk_ids: np.ndarray) -> np.ndarray:
        """Training chunks chunk_ids (...) as their own neighbour, with continuation: (..., r) int64.

        Part 0 of the database is this chunk store's training split, so a training chunk's id is
        its database id. Used only for training's lessons (training/run/lessons.py), never at evaluation.
        """
        if self.database.parts[0].store.fingerprint != self.chunk_store.fingerprint:
            raise DataError(f"{self.database.root}: part 0 is not the training split of {self.chunk_store.root}; "
                            f"rebuild it: {BUILD_DATABASE}")
        ids = np.asarray(chunk_ids, dtype=np.int64)
        return self.database.neighbour_tokens(ids[..., None])[..., 0, :]

    def neighbour_tokens(self, split: str, chunk_ids: np.ndarray, k: int | None = None) -> np.ndarray:
        """What chunks chunk_ids (...) of the split read, by the store's Reading: (..., k, r) int64, -1 = missing."""
        chunks = self.chunk_store.split(split)
        source = self.reading.source_chunks(chunk_ids, self._shuffled_order(split) if self.reading.shuffled else None)
        ids = self.neighbour_ids(split, source, k)                                       # (..., k)
        if not self.reading.align or self.reading.shuffled:
            return self.reading.tokens(self.database, ids)
        flat = source.reshape(-1)
        real = np.arange(chunks.chunk_len)[None, :] < chunks.lengths[flat][:, None]
        query = np.where(real, chunks.tokens(flat).astype(np.int64), -1)                 # (.., m), -1 at padding
        return self.reading.tokens(self.database, ids, query.reshape(*source.shape, -1))
