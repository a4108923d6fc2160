"""Benchmark the neighbour stage: `query_neighbours` over every chunk of a prepared store.

    python bench/neighbours.py [--workdir /tmp/rp1] [--factory Flat --factory IVF64,PQ32] [--rounds 2]

Runs the product's neighbour query (FAISS search of `retrieval.candidates` ids per chunk,
optional re-rank on the stored embeddings, sequence/document exclusion, -1 padding, shards
written) over the whole training and validation splits, and prints chunks/s per index and
re-rank setting, the variants interleaved over `--rounds` rounds on the shared machine.

--workdir names a finished build (<workdir>/data and the database in <workdir>/retrieval, from
launch/prepare_data.py and launch/build_index.py: every part, the further corpora too); it is only
read. Without it the shipped corpus is prepared and embedded (Ray, one single-thread actor per
core) into a temp dir first, a database of its training split. The indexes are built into a temp
dir from the database's embeddings either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from retropipe.data.config import DataConfig  # noqa: E402
from retropipe.data.database_reader import Database  # noqa: E402
from retropipe.data.prepare import prepare  # noqa: E402
from retropipe.data.store import ChunkStore  # noqa: E402
from retropipe.retrieval.config import RetrievalConfig  # noqa: E402
from retropipe.retrieval.database_parts import DatabaseVectors, PartSource, open_vectors, write_database  # noqa: E402
from retropipe.retrieval.embed_job import Embeddings, embed_store, model_identity, resolve_model_path  # noqa: E402
from retropipe.retrieval.index import build_index, load_index  # noqa: E402
from retropipe.retrieval.methods.dense import DenseSearch  # noqa: E402
from retropipe.retrieval.neighbour_search import query_neighbours  # noqa: E402


Build = tuple[ChunkStore, Embeddings, Database, DatabaseVectors]


def open_build(workdir: Path) -> Build:
    """The training store, its embeddings (the queries), and the database it was built with."""
    return open_build_at(workdir / "retrieval", ChunkStore(workdir / "data"))


def fresh_build(tmp: Path) -> Build:
    """Prepare and embed the shipped corpus (a few minutes on 2 cores): a database of its training split."""
    from retropipe.launch.ray_utils import RayExecutor
    from retropipe.retrieval.ray_embed import RayEmbedRunner

    prepare(DataConfig(), tmp / "data", progress=False)
    store = ChunkStore(tmp / "data")
    executor = RayExecutor()
    try:
        runner = RayEmbedRunner(executor, actors=os.cpu_count() or 1)
        embed_store(store, tmp / "embeddings", "", 64, runner)
    finally:
        executor.close()
    write_database(tmp, [PartSource("train", store, tmp / "embeddings")], model_identity(resolve_model_path(""), ""))
    return open_build_at(tmp, store)


def open_build_at(root: Path, store: ChunkStore) -> Build:
    database = Database(root)
    if database.parts[0].store.fingerprint != store.fingerprint:
        raise SystemExit(f"{root} was built from another chunk store than {store.root}; run launch/build_index.py")
    vectors = open_vectors(database)
    return store, vectors.parts[0][1], database, vectors   # part 0: the training split's embeddings, the queries


def main(argv=None) -> int:
    defaults = RetrievalConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None, help="a finished build to read (default: build one)")
    parser.add_argument("--factory", action="append", help="index to query (repeatable; default Flat and IVF64,PQ32)")
    parser.add_argument("--k", type=int, default=defaults.k)
    parser.add_argument("--candidates", type=int, default=defaults.candidates)
    parser.add_argument("--nprobe", type=int, default=defaults.nprobe)
    parser.add_argument("--chunks-per-seq", type=int, default=4, help="train.seq_len / data.chunk_len")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    factories = args.factory or ["Flat", "IVF64,PQ32"]
    print(f"CPU, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store, emb, database, vectors = open_build(Path(args.workdir)) if args.workdir else fresh_build(tmp)
        total = emb.count("train") + emb.count("validation")
        print(f"store {store.root}: {emb.count('train'):,} training + {emb.count('validation'):,} validation "
              f"chunks, {emb.dim}-d embeddings; a database of {len(database):,} chunks in {len(database.parts)} "
              f"part(s); k {args.k} of {args.candidates} candidates, "
              f"sequences of {args.chunks_per_seq} chunks")
        variants, indexes = [], {}
        for i, factory in enumerate(factories):
            manifest = build_index(vectors, tmp / f"index-{i}", factory, defaults.train_sample, defaults.seed)
            indexes[factory] = load_index(tmp / f"index-{i}", manifest, emb.dim, args.nprobe, defaults.ef_search)
            variants += [(factory, False)] + ([(factory, True)] if factory != "Flat" else [])
        rates, results = {}, {}
        for r in range(args.rounds):
            for factory, rerank in variants:  # interleaved: the shared machine's speed drifts
                out = tmp / f"neighbours-{len(rates.get((factory, rerank), []))}-{factory}-{rerank}"
                inputs = {"bench": [factory, rerank, r], "embeddings_fingerprint": emb.fingerprint,
                          "index_fingerprint": factory}  # the keys its manifest copies
                t0 = time.perf_counter()
                search = DenseSearch(indexes[factory], emb, args.candidates, vectors.rows if rerank else None)
                results[(factory, rerank)] = query_neighbours(search, store, database, out, inputs, args.k,
                                                              args.candidates, args.chunks_per_seq)
                rates.setdefault((factory, rerank), []).append(total / (time.perf_counter() - t0))

    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; best of {args.rounds} rounds over {total:,} chunks")
    print(f"{'index':<14} {'nprobe':>6} {'rerank':>6} {'chunks/s':>10} {'missing ids':>11}")
    for factory, rerank in variants:
        splits = results[(factory, rerank)]["splits"]
        missing = sum(s["missing"] for s in splits.values())
        print(f"{factory:<14} {args.nprobe if factory != 'Flat' else '-':>6} {'yes' if rerank else 'no':>6} "
              f"{max(rates[(factory, rerank)]):>10,.0f} {missing:>11,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
