"""The retrieval database's chunks, read side: one id space over the training split and further corpora.

    db = Database(cfg.retrieval_dir)                # reads <retrieval_dir>/database.json
    db.neighbour_tokens(ids)                        # ids (..., k) → (..., k, r) int64, -1 = missing

A database is a list of parts, each the training split of one chunk store: part 0 is the model's
own training data (`<workdir>/data`), further parts are the corpora of `retrieval.corpora`
(prepared under `<retrieval_dir>/corpora/`). A chunk's **database id** is its part's offset plus
its chunk id within that split, so part 0's ids are exactly the training split's chunk ids.
A neighbour is r = 2 · chunk_len tokens: the chunk, then its continuation (the next chunk of the
same document), -1 where missing (no neighbour, the document ended, or padding).

Plain numpy: training reads neighbours through this module and never imports `retrieval`,
which writes database.json (retrieval/database_parts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from retropipe.data.errors import BUILD_DATABASE, DataError
from retropipe.data.stage import read_json
from retropipe.data.store import ChunkStore, SplitChunks

DATABASE_FILE = "database.json"


@dataclass
class Part:
    name: str
    store: ChunkStore
    offset: int     # database id of the part's chunk 0
    chunks: int

    @property
    def split(self) -> SplitChunks:
        return self.store.split("train")


def resolve_part_path(root: Path, entry: dict, key: str, marker: str = "manifest.json") -> Path:
    """A recorded directory: relative to root if it holds `marker` there (a moved workdir), else the
    absolute path also recorded."""
    relative = (root / entry[key]).resolve()
    if (relative / marker).exists() or not entry.get(f"{key}_absolute"):
        return relative
    return Path(entry[f"{key}_absolute"])


class Database:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        path = self.root / DATABASE_FILE
        self.manifest = read_json(path, rerun=f"build it again: {BUILD_DATABASE}")
        if self.manifest is None:
            raise DataError(f"no retrieval database at {self.root} (missing {path}); build it: {BUILD_DATABASE}")
        self.fingerprint: str = self.manifest["fingerprint"]
        self.parts: list[Part] = []
        for entry in self.manifest["parts"]:
            store = ChunkStore(resolve_part_path(self.root, entry, "data"))
            if store.fingerprint != entry["fingerprint"]:
                raise DataError(f"stale retrieval database {path}: part {entry['name']!r} was built from chunk store "
                                f"{entry['fingerprint']}, but {store.root} is now {store.fingerprint}; rebuild it: {BUILD_DATABASE}")
            self.parts.append(Part(entry["name"], store, int(entry["offset"]), int(entry["chunks"])))
        self.chunk_len: int = self.parts[0].store.chunk_len
        self.tokenizer: str = self.parts[0].store.manifest["tokenizer"]
        self.r = 2 * self.chunk_len
        self.offsets = np.array([p.offset for p in self.parts] + [len(self)], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.manifest["chunks"])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part index, chunk id within the part) of database ids (n,) >= 0."""
        part = np.searchsorted(self.offsets, ids, side="right") - 1
        return part, ids - self.offsets[part]

    def _concat(self, per_part) -> np.ndarray:
        return np.concatenate([per_part(p) for p in self.parts]) if self.parts else np.zeros(0)

    @cached_property
    def text_hashes(self) -> np.ndarray:
        """(N,) uint64: each chunk's document text hash (data.chunking.text_hash)."""
        return self._concat(lambda p: p.store.text_hashes("train")).astype(np.uint64)

    @cached_property
    def document_hashes(self) -> np.ndarray:
        """(documents,) uint64: the text hash of every document of every part."""
        def of(p: Part):
            docs = p.store.documents
            in_train = np.asarray(docs.column("split").to_pylist()) == "train"
            return docs.column("text_hash").to_numpy()[in_train]
        return self._concat(of).astype(np.uint64)

    @cached_property
    def positions(self) -> np.ndarray:
        """(N,) int64: each chunk's index within its document."""
        return self._concat(lambda p: p.split.positions_in_document()).astype(np.int64)

    @cached_property
    def continuation(self) -> np.ndarray:
        """(N,) int64: database id of the next chunk of the same document, or -1."""
        def of(p: Part):
            nxt = p.split.continuation_ids()
            return np.where(nxt >= 0, nxt + p.offset, -1)
        return self._concat(of).astype(np.int64)

    def chunk_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Tokens of database chunks ids (...), -1 = none: (..., chunk_len) int64, -1 at padding or missing."""
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.full((len(flat), self.chunk_len), -1, dtype=np.int64)
        present = np.flatnonzero(flat >= 0)
        if len(present):
            part, local = self.locate(flat[present])
            for p in np.unique(part):
                sel = part == p
                split = self.parts[p].split
                tokens = split.tokens(local[sel]).astype(np.int64)
                real = np.arange(self.chunk_len)[None, :] < split.lengths[local[sel]][:, None]
                out[present[sel]] = np.where(real, tokens, -1)
        return out.reshape(*np.shape(ids), self.chunk_len)

    def next_chunks(self, ids: np.ndarray) -> np.ndarray:
        """The next chunk of the same document of ids (...), -1 = none or at the document's end."""
        ids = np.asarray(ids, dtype=np.int64)
        return np.where(ids >= 0, self.continuation[np.maximum(ids, 0)], -1)

    def previous_chunks(self, ids: np.ndarray) -> np.ndarray:
        """The previous chunk of the same document of ids (...), -1 = none or at the document's start."""
        ids = np.asarray(ids, dtype=np.int64)
        return np.where((ids >= 0) & (self.positions[np.maximum(ids, 0)] > 0), ids - 1, -1)

    def neighbour_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Chunks ids (..., k), -1 = none, each followed by its continuation: (..., k, r) int64, -1 = missing.
        (data/reading.py decides what a chunk reads of them.)"""
        ids = np.asarray(ids, dtype=np.int64)
        return np.concatenate([self.chunk_tokens(ids), self.chunk_tokens(self.next_chunks(ids))], axis=-1)

    def regions(self, ids: np.ndarray) -> np.ndarray:
        """The 4 · chunk_len tokens of each chunk's document around it (the chunk before, the chunk,
        two after): ids (...) → (..., 4 · chunk_len) int64, -1 = none; what alignment slides over."""
        ids = np.asarray(ids, dtype=np.int64)
        nxt = self.next_chunks(ids)
        around = np.stack([self.previous_chunks(ids), ids, nxt, self.next_chunks(nxt)], axis=-1)  # (..., 4)
        return self.chunk_tokens(around).reshape(*ids.shape, 4 * self.chunk_len)
