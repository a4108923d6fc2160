"""Read a prepared chunk store: memory-mapped chunk shards, documents and training sequences.

    store = ChunkStore(workdir / "data")
    train = store.split("train")
    train.tokens(np.array([0, 1, 5]))            # (3, chunk_len) int32, padded with pad_id
    train.sequence_chunk_ids(7, chunks_per_seq)  # chunk ids of training sequence 7

Chunk ids are per split (row numbers across that split's shards, in order). A training
sequence i is the run of chunks [i·L, (i+1)·L), L = seq_len / chunk_len, so the chunks a
model trains on are exactly the chunks the retrieval database holds.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa

from retropipe.data.chunking import SPLITS
from retropipe.data.errors import DataError


def _open_ipc(path: Path) -> pa.Table:
    try:
        return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except (OSError, pa.ArrowInvalid) as e:
        raise DataError(f"{path}: unreadable chunk-store file ({e}); prepare the data again") from None


class SplitChunks:
    """The chunks of one split; token arrays stay memory-mapped, per-chunk metadata in RAM."""

    def __init__(self, root: Path, split: str, shards: list[str], chunk_len: int):
        self.split, self.chunk_len = split, chunk_len
        tables = [_open_ipc(root / split / name) for name in shards]
        # Zero-copy views of each shard's token buffer: (c_shard, chunk_len) int32.
        self._shard_tokens = [t.column("tokens").combine_chunks().values.to_numpy(zero_copy_only=True)
                              .reshape(-1, chunk_len) if t.num_rows else np.zeros((0, chunk_len), np.int32)
                              for t in tables]
        self._offsets = np.cumsum([0] + [t.num_rows for t in tables])
        self.doc_index = np.concatenate([t.column("doc_index").to_numpy() for t in tables]) if tables \
            else np.zeros(0, np.int64)
        self.lengths = np.concatenate([t.column("length").to_numpy() for t in tables]) if tables \
            else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def tokens(self, ids: np.ndarray) -> np.ndarray:
        """Token ids of the given chunk ids: (len(ids), chunk_len) int32."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"chunk id out of range 0..{len(self) - 1} in split {self.split!r}")
        shard = np.searchsorted(self._offsets, ids, side="right") - 1
        out = np.empty((len(ids), self.chunk_len), dtype=np.int32)
        for s in np.unique(shard):
            sel = shard == s
            out[sel] = self._shard_tokens[s][ids[sel] - self._offsets[s]]
        return out

    def positions_in_document(self) -> np.ndarray:
        """(c,) int64: each chunk's index within its document (chunks of a document are consecutive)."""
        starts = np.ones(len(self), dtype=bool)
        starts[1:] = self.doc_index[1:] != self.doc_index[:-1]
        first = np.maximum.accumulate(np.where(starts, np.arange(len(self)), 0))
        return np.arange(len(self)) - first

    def continuation_ids(self) -> np.ndarray:
        """For each chunk, the next chunk of the same document, or -1 at a document's end."""
        nxt = np.arange(1, len(self) + 1, dtype=np.int64)
        same_doc = np.zeros(len(self), dtype=bool)
        same_doc[:-1] = self.doc_index[1:] == self.doc_index[:-1]
        return np.where(same_doc, nxt, -1)

    def num_sequences(self, chunks_per_seq: int) -> int:
        return len(self) // chunks_per_seq

    def sequence_chunk_ids(self, seq: int | np.ndarray, chunks_per_seq: int) -> np.ndarray:
        """Chunk ids of sequence(s) seq: (chunks_per_seq,) or (len(seq), chunks_per_seq)."""
        return np.asarray(seq)[..., None] * chunks_per_seq + np.arange(chunks_per_seq)


class ChunkStore:
    """A prepared data directory (the output of launch/prepare_data.py)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        path = self.root / "manifest.json"
        if not path.exists():
            raise DataError(f"no prepared data at {self.root} (missing {path}); "
                            f"run: python launch/prepare_data.py --config <your config>")
        try:
            self.manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: corrupt manifest ({e})") from None
        self.chunk_len: int = self.manifest["chunk_len"]
        self.pad_id: int = self.manifest["pad_id"]
        self.eot_id: int = self.manifest["eot_id"]
        self.fingerprint: str = self.manifest["fingerprint"]
        if self.manifest.get("version", 1) < 2:
            raise DataError(f"{path}: prepared by an older RetroPipe (chunk-store format {self.manifest.get('version', 1)},"
                            f" no document text hashes); delete {self.root} and run launch/prepare_data.py again")
        for split in SPLITS:
            for name in self.manifest["shards"][split]:
                if not (self.root / split / name).exists():
                    raise DataError(f"chunk store {self.root} is incomplete: {split}/{name} is missing")
        self._splits: dict[str, SplitChunks] = {}

    def split(self, name: str) -> SplitChunks:
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; splits are {SPLITS}")
        if name not in self._splits:
            self._splits[name] = SplitChunks(self.root, name, self.manifest["shards"][name], self.chunk_len)
        return self._splits[name]

    @cached_property
    def documents(self) -> pa.Table:
        return _open_ipc(self.root / "documents.arrow")

    def text_hashes(self, name: str) -> np.ndarray:
        """(chunks of the split,) uint64: the text hash of each chunk's document (data.chunking.text_hash)."""
        by_doc = self.documents.column("text_hash").to_numpy()
        return by_doc[self.split(name).doc_index]

    def split_bytes(self, name: str) -> int:
        """UTF-8 bytes of the split's documents: the denominator of bits per byte."""
        return int(self.manifest["splits"][name]["bytes"])
