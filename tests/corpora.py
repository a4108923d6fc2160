"""Small corpora and chunk stores that several test modules build (helpers; fixtures are in conftest.py).

The stores use 8-token chunks and a handful of documents, so preparing and embedding them takes
a second or two with the real tokenizer and the real bundled BERT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from retropipe.data.chunking import split_of
from retropipe.data.config import DataConfig
from retropipe.data.prepare import prepare
from retropipe.data.store import ChunkStore
from retropipe.retrieval.config import RetrievalConfig

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

TOPICS = ["apples and pears grow in the orchard", "the ship sails across stormy ocean waves",
          "compilers parse source code into syntax trees", "violins and cellos play in the orchestra",
          "glaciers carve valleys in the cold mountains", "bakers knead dough for fresh bread"]
CHUNK_LEN, SEQ_CHUNKS = 8, 4  # 8-token chunks; training sequences of 4 chunks (seq_len 32)


def doc_id(split: str, n: int, seed: int = 1234, fraction: float = 0.2) -> str:
    """An id that the data stage puts in `split` (the split is a hash of the id)."""
    i = 0
    while split_of(f"{split}-{n}-{i}", seed, fraction) != split:
        i += 1
    return f"{split}-{n}-{i}"


def make_store(root: Path, docs: list[tuple[str, str]], docs_per_shard: int = 4) -> ChunkStore:
    """Prepare [(split, text)] into root/data with 8-token chunks; return the ChunkStore."""
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": doc_id(s, n), "text": t}) + "\n" for n, (s, t) in enumerate(docs)))
    cfg = DataConfig(corpus=str(corpus), chunk_len=CHUNK_LEN, validation_fraction=0.2, docs_per_shard=docs_per_shard)
    prepare(cfg, root / "data", progress=False)
    return ChunkStore(root / "data")


def topic_docs(n_train: int = 14, n_val: int = 3) -> list[tuple[str, str]]:
    """Documents repeating one topic each, so the nearest chunks are often of the same document."""
    docs = [("train", " ".join([TOPICS[i % len(TOPICS)]] * (1 + i % 3))) for i in range(n_train)]
    docs[3:3] = [("validation", TOPICS[i % len(TOPICS)]) for i in range(n_val)]
    return docs


def retrieval_cfg(**kw) -> RetrievalConfig:
    return RetrievalConfig(**{"embed_batch_size": 8, "recall_queries": 10, "train_sample": 0, **kw})


def build_workdir(cfg) -> None:
    """A composed config's data and retrieval database, built in-process (as `make demo`'s first
    two stages build them, without Ray)."""
    from retropipe.retrieval.build_database import build_retrieval

    prepare(cfg.data, cfg.data_dir, progress=False)
    build_retrieval(cfg.retrieval, ChunkStore(cfg.data_dir), cfg.retrieval_dir,
                    chunks_per_seq=cfg.train.seq_len // cfg.data.chunk_len)


def neighbours_of(root: Path) -> dict:
    return {s: np.load(root / "retrieval" / "neighbours" / f"{s}.npy", allow_pickle=False)
            for s in ("train", "validation")}
