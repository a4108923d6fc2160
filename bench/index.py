"""Benchmark the FAISS index as build_index builds and searches it: Flat vs IVF-PQ on ≥ 1M vectors.

    python bench/index.py [--n 1000000] [--factory IVF1024,PQ32] [--nprobe 4,8,16,32] [--rank 32]

Synthetic embeddings stand in for a large corpus: `--clusters` random unit centres, each point
its centre plus a Gaussian in a random `--rank`-dimensional subspace of that cluster (plus 10 %
isotropic noise), normalised to unit length and rounded to float16, as retrieval/embed_job.py
stores them. (`--rank 0` makes the clusters isotropic: every point of a cluster is then almost
equally far from a query, the worst case for PQ codes.) Queries come from the same
distribution but are not in the database, like validation chunks.

The vectors are written as an embeddings directory and indexed by `retrieval.index.build_index`
(seeded training sample, add per shard, merge; IVF lists merged on disk), read back by
`load_index` and searched by `retrieval.index.search`, fetching `--candidates` ids per query as
the neighbour stage does, with and without re-ranking on the stored vectors. Printed, side by
side in one run: build time, queries/s, recall@2 against exact search (`recall_at_k`, as the
build's recall check counts it) and queries/s relative to Flat.
Goal: an IVF-PQ setting with recall@2 ≥ 0.9 of exact search's at ≥ 10× its queries/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402

from retropipe.data.stage import save_npy  # noqa: E402
from retropipe.retrieval.database_parts import DatabaseVectors  # noqa: E402
from retropipe.retrieval.embed_job import Embeddings  # noqa: E402
from retropipe.retrieval.index import build_index, load_index, recall_at_k, search, set_search_params  # noqa: E402


class ClusteredVectors:
    """Seeded clustered unit vectors; `sample(n)` draws n more from the same mixture."""

    def __init__(self, dim: int, clusters: int, rank: int, spread: float, seed: int):
        self.rng = np.random.default_rng(seed)
        self.dim, self.rank, self.spread = dim, rank, spread
        self.centres = self._unit(self.rng.standard_normal((clusters, dim), dtype=np.float32))
        # Per-cluster orthonormal bases (clusters, rank, dim): real embeddings vary along few
        # directions locally, which is what lets a query's nearest neighbours stand out.
        self.bases = [np.linalg.qr(self.rng.standard_normal((dim, rank)))[0].T.astype(np.float32)
                      for _ in range(clusters)] if rank else None

    @staticmethod
    def _unit(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def sample(self, n: int) -> np.ndarray:
        """(n, dim) float32, unit length, rounded to float16 precision (the stored dtype)."""
        labels = self.rng.integers(0, len(self.centres), n)
        iso = 0.1 if self.rank else 1.0
        scale = np.float32(iso * self.spread / np.sqrt(self.dim))
        x = self.rng.standard_normal((n, self.dim), dtype=np.float32) * scale
        x += self.centres[labels]
        if self.rank:
            for c in np.unique(labels):  # one small matmul per cluster
                sel = np.flatnonzero(labels == c)
                u = self.rng.standard_normal((len(sel), self.rank), dtype=np.float32)
                x[sel] += (self.spread / np.sqrt(self.rank)) * (u @ self.bases[c])
        return self._unit(x).astype(np.float16).astype(np.float32)


def write_embeddings(out: Path, db: np.ndarray, queries: np.ndarray, shard_size: int) -> Embeddings:
    """An embeddings directory as retrieval/embed_job.py lays it out: float16 shards per split."""
    shards, counts = {"train": [], "validation": []}, {"train": [], "validation": []}
    for split, x in (("train", db), ("validation", queries)):
        (out / split).mkdir(parents=True, exist_ok=True)
        for i, start in enumerate(range(0, len(x), shard_size)):
            name = f"shard-{i:05d}.npy"
            save_npy(out / split / name, x[start:start + shard_size].astype(np.float16))
            shards[split].append(name)
            counts[split].append(len(x[start:start + shard_size]))
    manifest = {"dim": db.shape[1], "fingerprint": f"synthetic-{len(db)}", "shards": shards, "shard_chunks": counts}
    return Embeddings(out, manifest)


def queries_per_second(fn, n_queries: int, min_seconds: float = 1.0) -> float:
    """Queries/s of fn() (which searches n_queries), repeated until min_seconds have passed.

    The first call is a warm-up (it pages in on-disk inverted lists), kept only when it alone
    took min_seconds: a slow exact search need not run twice."""
    t0 = time.perf_counter()
    fn()
    if time.perf_counter() - t0 >= min_seconds:
        return n_queries / (time.perf_counter() - t0)
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return reps * n_queries / elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="database vectors")
    parser.add_argument("--dim", type=int, default=384, help="all-MiniLM-L6-v2's width")
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--rank", type=int, default=32, help="dimensions a cluster varies in (0 = isotropic)")
    parser.add_argument("--spread", type=float, default=1.0, help="cluster radius relative to the centre")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--factory", action="append", help="FAISS factory to compare with Flat (repeatable; "
                        "default IVF1024,PQ32)")
    parser.add_argument("--nprobe", default="4,8,16,32", help="IVF lists searched per query")
    parser.add_argument("--ef-search", type=int, default=64, help="HNSW breadth (HNSW quantizers)")
    parser.add_argument("--candidates", type=int, default=20, help="ids fetched per query (retrieval.candidates)")
    parser.add_argument("--k", type=int, default=2, help="recall@k")
    parser.add_argument("--train-sample", type=int, default=100_000, help="retrieval.train_sample")
    parser.add_argument("--shard-size", type=int, default=100_000, help="vectors per embedding shard")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds; the best is kept")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir under /tmp)")
    args = parser.parse_args(argv)
    factories = args.factory or ["IVF1024,PQ32"]
    nprobes = [int(p) for p in args.nprobe.split(",")]
    import faiss

    print(f"CPU, {os.cpu_count()} cores, faiss {faiss.__version__} ({faiss.omp_get_max_threads()} threads); "
          f"load average {os.getloadavg()[0]:.2f}")
    t0 = time.perf_counter()
    gen = ClusteredVectors(args.dim, args.clusters, args.rank, args.spread, args.seed)
    db, queries = gen.sample(args.n), gen.sample(args.queries)
    print(f"data: {args.n:,} × {args.dim} unit vectors in {args.clusters} clusters of rank {args.rank}, "
          f"{args.queries:,} queries; generated in {time.perf_counter() - t0:.1f} s")

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        emb = write_embeddings(Path(tmp) / "embeddings", db, queries, args.shard_size)
        vectors = DatabaseVectors([(0, emb)])        # the database a build indexes: one part, these shards
        rows = vectors.rows                            # the re-rank reads, as the product does
        indexes, builds = {}, {}
        for factory in ["Flat"] + factories:
            out = Path(tmp) / f"index-{len(indexes)}"
            t0 = time.perf_counter()
            manifest = build_index(vectors, out, factory, args.train_sample, args.seed)
            builds[factory] = (time.perf_counter() - t0, manifest["seconds"])
            indexes[factory] = load_index(out, manifest, args.dim, nprobes[0], args.ef_search)
            print(f"  built {factory!r} in {builds[factory][0]:.1f} s {manifest['seconds']}", flush=True)
        del db

        d_cand, _ = indexes["Flat"].search(queries, args.candidates)
        exact_d = d_cand[:, :args.k]
        cos = 1 - d_cand / 2  # unit vectors: ‖q − x‖² = 2 − 2 cos
        print(f"exact neighbours: mean cosine {cos[:, 0].mean():.3f} (1st), {cos[:, 1].mean():.3f} (2nd), "
              f"{cos[:, -1].mean():.3f} ({args.candidates}th)")

        # (factory, nprobe, rerank) -> [qps per round]; recall is deterministic, computed once.
        variants = [("Flat", 0, False)] + [(f, p, r) for f in factories for p in nprobes for r in (False, True)]
        qps, recall = {}, {}
        for _ in range(args.rounds):
            # Interleaved rounds: a neighbour on the shared machine slows every variant alike.
            for factory, nprobe, rerank in variants:
                index = indexes[factory]
                set_search_params(index, max(nprobe, 1), args.ef_search)
                fn = lambda: search(index, queries, args.candidates, rows if rerank else None)  # noqa: E731
                qps.setdefault((factory, nprobe, rerank), []).append(queries_per_second(fn, len(queries)))
                if (factory, nprobe, rerank) not in recall:
                    recall[(factory, nprobe, rerank)] = recall_at_k(queries, fn(), exact_d, rows)
    flat = max(qps[("Flat", 0, False)])
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; recall@{args.k} and queries/s fetching "
          f"{args.candidates} candidates per query, best of {args.rounds} rounds")
    print(f"{'index':<22} {'nprobe':>6} {'rerank':>6} {'build s':>8} {'queries/s':>10} {'× Flat':>7} "
          f"{'recall@' + str(args.k):>9} {'goal':>5}")
    met = []
    for factory, nprobe, rerank in variants:
        rate, rec = max(qps[(factory, nprobe, rerank)]), recall[(factory, nprobe, rerank)]
        ok = rec >= 0.9 * recall[("Flat", 0, False)] and rate >= 10 * flat
        if factory != "Flat":
            met.append((ok, factory, nprobe, rerank, rec, rate / flat))
        verdict = ("met" if ok else "-") if factory != "Flat" else ""
        print(f"{factory:<22} {nprobe or '-':>6} {'yes' if rerank else 'no':>6} {builds[factory][0]:>8.1f} "
              f"{rate:>10,.0f} {rate / flat:>6.1f}× {rec:>9.4f} {verdict:>5}")
    good = [m for m in met if m[0]]
    if good:
        _, factory, nprobe, rerank, rec, ratio = max(good, key=lambda m: m[5])
        print(f"goal met: {factory} nprobe {nprobe}{' re-ranked' if rerank else ''}: recall@{args.k} {rec:.3f} "
              f"(≥ 0.9 of exact) at {ratio:.0f}× Flat's queries/s (≥ 10×)")
    else:
        print("goal missed: no IVF-PQ setting reached recall ≥ 0.9 of exact at ≥ 10× Flat's queries/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
