"""The retrieval database, build side: its parts, their embeddings in one id space, database.json.

    parts = prepare_corpora(cfg.retrieval.corpora, cfg.data, store, retrieval_dir, executor)
    vectors = DatabaseVectors([(0, train_embeddings), (N0, corpus_embeddings), ...])
    write_database(retrieval_dir, parts, embedder_identity, cfg.retrieval.method)

Part 0 is the training split of the training chunk store (`<workdir>/data`); every corpus of
`retrieval.corpora` becomes a further part, prepared into `<retrieval_dir>/corpora/<name>/data`
by the data stage's own code (same tokenizer and chunk_len as the training data, every document
in split "train") and embedded once into `<retrieval_dir>/corpora/<name>/embeddings`. A chunk's
database id is its part's offset plus its chunk id within the part (data/database_reader.py reads it).
Adding a corpus adds a part: the parts already embedded are reused, only the index is rebuilt.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from retropipe.data.config import DataConfig
from retropipe.data.database_reader import DATABASE_FILE
from retropipe.data.errors import DataError, TokenizerError
from retropipe.data.prepare import prepare
from retropipe.data.stage import Executor, fingerprint, path_tag, serial_executor, write_json
from retropipe.data.store import ChunkStore
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.embed_job import Embeddings

DATABASE_VERSION = 1


@dataclass
class PartSource:
    """Where one part of the database lives while it is built."""

    name: str
    store: ChunkStore
    embeddings_dir: Path


def prepare_corpora(corpora: list[str], data_cfg: DataConfig, store: ChunkStore, retrieval_dir: Path,
                    executor: Executor = serial_executor, progress: bool = False) -> list[PartSource]:
    """Part 0 (the training split) plus every further corpus, prepared (resumable, skipped when complete)."""
    parts = [PartSource("train", store, Path(retrieval_dir) / "embeddings")]
    for corpus in corpora:
        name = path_tag(corpus)
        part_dir = Path(retrieval_dir) / "corpora" / name
        # The training data's tokenizer and chunk_len (from its manifest: one source of truth) and
        # reader settings; every document goes to the "train" split, the database's only split.
        part_cfg = dataclasses.replace(data_cfg, corpus=corpus, tokenizer=store.manifest["tokenizer"],
                                       chunk_len=store.chunk_len, validation_fraction=0.0, max_documents=0)
        try:
            prepare(part_cfg, part_dir / "data", executor=executor, progress=progress)
        except (DataError, TokenizerError) as e:  # name the key that brought the corpus in
            raise RetrievalError(f"config key 'retrieval.corpora': {corpus}: {e}") from None
        parts.append(PartSource(name, ChunkStore(part_dir / "data"), part_dir / "embeddings"))
    return parts


class DatabaseVectors:
    """The database's embeddings in database-id order: each part's training-split shards, in turn."""

    def __init__(self, parts: list[tuple[int, Embeddings]]):
        self.parts = parts
        dims = {e.dim for _, e in parts if e.count("train")}
        if len(dims) > 1:
            raise RetrievalError(f"the database's parts were embedded with different widths {sorted(dims)}")
        self.dim: int = dims.pop() if dims else parts[0][1].dim
        self.fingerprint = fingerprint([[offset, e.fingerprint] for offset, e in parts])
        self._offsets = np.array([offset for offset, _ in parts] + [len(self)], dtype=np.int64)

    def __len__(self) -> int:
        offset, last = self.parts[-1]
        return offset + last.count("train")

    def shard_files(self) -> list[tuple[int, Path, int]]:
        """(first database id, .npy path, rows) of every training-split shard of every part."""
        out = []
        for offset, emb in self.parts:
            starts = emb.offsets("train")
            for i in range(len(emb.manifest["shards"]["train"])):
                out.append((offset + int(starts[i]), emb.shard_path("train", i), int(starts[i + 1] - starts[i])))
        return out

    def shards(self) -> Iterator[tuple[int, np.ndarray]]:
        """(first database id, (n, d) float32) per shard, in id order."""
        for offset, emb in self.parts:
            for first, x in emb.shards("train"):
                yield offset + first, x

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), d) float32 embeddings of database ids."""
        ids = np.asarray(ids, dtype=np.int64)
        part = np.searchsorted(self._offsets, ids, side="right") - 1
        if len(ids) and part[0] == part[-1] and (part == part[0]).all():  # one part: its rows, not a copy of
            offset, emb = self.parts[part[0]]                            # them (the index's training sample)
            return emb.rows("train", ids - offset)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for p in np.unique(part):
            sel = part == p
            offset, emb = self.parts[p]
            out[sel] = emb.rows("train", ids[sel] - offset)
        return out


def _relative(path: Path, root: Path) -> str:
    return os.path.relpath(Path(path).resolve(), Path(root).resolve())


def write_database(root: Path, parts: list[PartSource], embedder: dict | None, method: str = "dense") -> dict:
    """database.json: the parts (paths relative to root, and absolute), offsets, fingerprints, and the
    retrieval method (retrieval/methods/), which queries of this database use whatever their config
    says. embedder: the embedder's identity; None for a method that embeds nothing (bm25: the parts
    then record no embeddings directory)."""
    entries, offset = [], 0
    for part in parts:
        chunks = len(part.store.split("train"))
        entry = {"name": part.name, "data": _relative(part.store.root, root),
                 "data_absolute": str(Path(part.store.root).resolve())}
        if embedder is not None:
            entry.update(embeddings=_relative(part.embeddings_dir, root),
                         embeddings_absolute=str(Path(part.embeddings_dir).resolve()))
        entries.append({**entry, "fingerprint": part.store.fingerprint, "offset": offset, "chunks": chunks,
                        "tokens": part.store.manifest["splits"]["train"]["tokens"],
                        "documents": part.store.manifest["splits"]["train"]["documents"]})
        offset += chunks
    identity = {"version": DATABASE_VERSION, "parts": [[e["name"], e["fingerprint"]] for e in entries],
                "embedder": embedder["sha256"] if embedder is not None else None}
    if method != "dense":  # a dense database keeps the fingerprint it had before methods existed
        identity["method"] = method
    manifest = {"version": DATABASE_VERSION, "method": method, "parts": entries, "chunks": offset,
                "tokens": sum(e["tokens"] for e in entries), "embedder": embedder,
                "fingerprint": fingerprint(identity)}
    write_json(Path(root) / DATABASE_FILE, manifest)
    return manifest


def open_vectors(database) -> DatabaseVectors:
    """The embeddings of a built database (data.database_reader.Database), from the paths database.json records."""
    from retropipe.data.database_reader import resolve_part_path
    from retropipe.data.stage import read_json

    parts = []
    for entry, part in zip(database.manifest["parts"], database.parts):
        emb_dir = resolve_part_path(database.root, entry, "embeddings")
        manifest = read_json(emb_dir / "manifest.json", rerun="run launch/build_index.py again")
        if manifest is None or manifest.get("chunk_store_fingerprint") != part.store.fingerprint:
            raise RetrievalError(f"no embeddings of database part {part.name!r} at {emb_dir} (or they are stale); "
                                 f"run launch/build_index.py again")
        parts.append((part.offset, Embeddings(emb_dir, manifest)))
    return DatabaseVectors(parts)
