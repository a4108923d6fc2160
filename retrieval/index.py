"""The FAISS index over the database's chunk embeddings (RETRO §2.3), faiss-contrib style.

    train on a seeded sample → add the embedding shards in parallel tasks → merge → recall check

Metric: L2 on unit-length embeddings. For unit vectors ‖q − x‖² = 2 − 2·cos(q, x), so the
ranking is exactly cosine similarity's, and L2 is the metric every FAISS index type (IVF
coarse quantizers, HNSW, OPQ, PQ) supports best.

IVF indexes are merged with on-disk inverted lists (`faiss.contrib.ondisk.merge_ondisk`), so the
merged index need not fit in one worker's memory; flat-code indexes (Flat, PQ, SQ) are merged
in memory; anything else (e.g. plain HNSW) is added in one pass by the driver.

Vectors come from `retrieval.database_parts.DatabaseVectors`: every part's embedding shards in
database-id order, so the index's ids are database ids.

Layout of `<retrieval_dir>/index/`:
    trained.faissindex        the trained, empty index
    shards/part-NNNNN-MMMMM.faissindex   one per add task: embedding shards NNNNN..MMMMM of the
                              database (ids = database ids), until the merge
    index.faissindex (+ index.ivfdata for IVF)   the merged index
    manifest.json             factory, metric, dim, ntotal, train sample, recall@k, fingerprint
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from retropipe.data.stage import Executor, fingerprint, open_stage, serial_executor, sha256_file, tmp_path, write_json
from retropipe.retrieval import RetrievalError

MANIFEST_VERSION = 2  # 2: over the database's parts (ids are database ids)

INDEX_FILE, IVFDATA_FILE, TRAINED_FILE = "index.faissindex", "index.ivfdata", "trained.faissindex"
# Vectors an IVF add task takes at least, per list. Every task reads the trained index (its K
# centroids, and IVF-PQ's precomputed table of K·M·256 floats) and the merge visits every task's
# file list by list: with a task per embedding shard (a few thousand chunks) both grew as
# shards × K, faster than the database (bench/scaling/scale.py: IVF1397,PQ32 over 122k chunks,
# add 38.5 → 23.0 s and merge 8.7 → 0.1 s on one thread). At 64 a list the task's overhead is a
# small part of its adds.
ADD_VECTORS_PER_LIST = 64


def faiss_module():
    """The faiss module, or a RetrievalError saying which extra installs it (FAISS is an extra:
    faiss-cpu and faiss-gpu-cu12 are the same module and cannot both be dependencies)."""
    try:
        import faiss
    except ImportError:
        raise RetrievalError("FAISS is not installed: pip install 'retropipe[cpu]' (faiss-cpu), or "
                             "'retropipe[gpu]' (faiss-gpu-cu12) on a CUDA 12 machine") from None
    return faiss


def make_index(factory: str, dim: int):
    """An empty index from a factory string, or a RetrievalError naming retrieval.index."""
    faiss = faiss_module()

    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_L2)
    except RuntimeError as e:
        reason = str(e).split(": ", 1)[-1].strip() if "Error" in str(e) else str(e)
        raise RetrievalError(f"config key 'retrieval.index': FAISS rejects {factory!r} for {dim}-d "
                             f"embeddings: {reason}") from None
    # Polysemous training (on by default for PQ) only serves Hamming-threshold search, which we
    # never use; it costs more than the PQ training itself. Search results do not change.
    for sub in (index, faiss.try_extract_index_ivf(index)):
        if sub is not None and hasattr(sub, "do_polysemous_training"):
            sub.do_polysemous_training = False
    return index


def merge_kind(index) -> str:
    """"ivf" (on-disk merge), "codes" (in-memory merge) or "serial" (not mergeable: one pass)."""
    faiss = faiss_module()

    if faiss.try_extract_index_ivf(index) is not None:
        return "ivf"
    if isinstance(index, faiss.IndexFlatCodes):
        return "codes"
    return "serial"


def write_index(index, path: Path) -> None:
    faiss = faiss_module()

    faiss.write_index(index, str(tmp_path(path)))
    os.replace(tmp_path(path), path)


def read_index(path: Path):
    faiss = faiss_module()

    if not Path(path).exists():
        raise RetrievalError(f"{path}: missing FAISS index; run build_index again")
    try:  # on-disk inverted lists are looked up next to the index, wherever the workdir moved
        return faiss.read_index(str(path), faiss.IO_FLAG_ONDISK_SAME_DIR)
    except RuntimeError as e:
        raise RetrievalError(f"{path}: unreadable FAISS index ({str(e).splitlines()[-1]}); "
                             f"delete {Path(path).parent} and run build_index again") from None


def set_search_params(index, nprobe: int, ef_search: int) -> None:
    """retrieval.nprobe / retrieval.ef_search, wherever they apply inside the index."""
    faiss = faiss_module()

    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = min(nprobe, ivf.nlist)
        quantizer = faiss.downcast_index(ivf.quantizer)
        if hasattr(quantizer, "hnsw"):
            quantizer.hnsw.efSearch = ef_search
    params = faiss.ParameterSpace()
    try:
        params.set_index_parameter(index, "efSearch", ef_search)
    except RuntimeError:
        pass  # not an HNSW index


def sample_rows(vectors, n: int, seed: int) -> np.ndarray:
    """(min(n, N), d) float32: a seeded random sample of the database's embeddings (n = 0: all)."""
    total = len(vectors)
    if n == 0 or n >= total:
        return np.concatenate([x for _, x in vectors.shards()]) if total else np.zeros((0, vectors.dim), np.float32)
    ids = np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))
    return vectors.rows(ids)


def add_groups(sources: list[tuple[int, Path, int]], lists: int) -> list[list[tuple[int, Path, int]]]:
    """The add tasks: consecutive embedding shards (first id, path, rows) holding at least
    lists · ADD_VECTORS_PER_LIST vectors (the last task may hold fewer); a shard a task for an
    index without lists (its copies cost nothing to read). Depends on the shards and the index
    alone, so a resumed build finds the same tasks."""
    if lists <= 0:
        return [[source] for source in sources]
    groups, size = [], 0
    for source in sources:
        if not groups or size >= lists * ADD_VECTORS_PER_LIST:
            groups.append([])
            size = 0
        groups[-1].append(source)
        size += source[2]
    return groups


def add_shards(trained_path: str, sources: list[tuple[int, str]], out_path: str) -> tuple[str, int]:
    """The unit of parallel work: add embedding shards, given as (first id, .npy path) in id order,
    to a copy of the trained index, one shard in memory at a time.

    Runs in a Ray task (retried if its worker dies) or in-process; the output is written
    atomically, so a retry or a rerun simply rewrites it.
    """
    faiss = faiss_module()

    index = faiss.read_index(trained_path)
    ivf, added = merge_kind(index) == "ivf", 0
    for first_id, emb_path in sources:
        x = np.load(emb_path, mmap_mode="r", allow_pickle=False).astype(np.float32)  # (n, d)
        if ivf:
            index.add_with_ids(x, np.arange(first_id, first_id + len(x), dtype=np.int64))
        else:
            index.add(x)  # flat codes keep insertion order; tasks are merged in order
        added += len(x)
    write_index(index, Path(out_path))
    return out_path, added


def build_index(vectors, out_dir: Path, factory: str, train_sample: int, seed: int,
                executor: Executor = serial_executor, workers: int = 2) -> dict:
    """Train, add in shards, merge (resumable); return the manifest (without the recall check).

    vectors: a retrieval.database_parts.DatabaseVectors (shard_files(), shards(), rows(ids), dim, fingerprint).
    """
    inputs = {"version": MANIFEST_VERSION, "embeddings_fingerprint": vectors.fingerprint, "factory": factory,
              "train_sample": train_sample, "seed": seed}
    manifest = open_stage(out_dir, inputs)
    if manifest is not None:
        return {**manifest, "skipped": True}
    if len(vectors) == 0:
        raise RetrievalError("the database has no chunks: nothing to index")
    seconds = {}
    begin = time.perf_counter()
    trained, sample_size = _train(vectors, out_dir, factory, train_sample, seed)
    seconds["train"] = round(time.perf_counter() - begin, 2)
    begin = time.perf_counter()
    shard_paths = _add_shards(vectors, out_dir, trained, executor, workers)
    kind = merge_kind(read_index(trained))
    seconds["add"] = round(time.perf_counter() - begin, 2)
    begin = time.perf_counter()
    merged = _merge(vectors, out_dir, trained, kind, shard_paths)
    seconds["merge"] = round(time.perf_counter() - begin, 2)
    if merged.ntotal != len(vectors):
        raise RetrievalError(f"{out_dir / INDEX_FILE}: holds {merged.ntotal} vectors, expected {len(vectors)}")
    files = [INDEX_FILE] + ([IVFDATA_FILE] if kind == "ivf" else [])
    manifest = {
        "version": MANIFEST_VERSION, "inputs": inputs, "factory": factory, "metric": "l2 (unit vectors: cosine)",
        "dim": vectors.dim, "ntotal": int(merged.ntotal), "merge": kind, "train_sample": sample_size,
        "embeddings_fingerprint": vectors.fingerprint, "files": files,
        "sha256": {f: sha256_file(out_dir / f) for f in files}, "seconds": seconds,
    }
    manifest["fingerprint"] = fingerprint({"inputs": inputs, "sha256": manifest["sha256"]})
    write_json(out_dir / "manifest.json", manifest)
    for path in shard_paths:  # merged: the tasks' copies are no longer needed
        path.unlink(missing_ok=True)
    return manifest


def _train(vectors, out_dir: Path, factory: str, train_sample: int, seed: int) -> tuple[Path, int]:
    """The trained, empty index on disk (kept by a resumed build) and the vectors it was trained on."""
    index = make_index(factory, vectors.dim)
    trained = out_dir / TRAINED_FILE
    # Vectors the index is trained on (the same when a resumed build finds the trained index).
    sample_size = 0 if index.is_trained else (len(vectors) if train_sample == 0 else min(train_sample, len(vectors)))
    if not trained.exists():
        if not index.is_trained:
            sample = sample_rows(vectors, train_sample, seed)
            try:
                index.train(sample)
            except RuntimeError as e:
                raise RetrievalError(f"config key 'retrieval.index': FAISS cannot train {factory!r} on "
                                     f"{len(sample)} vectors ({str(e).splitlines()[-1].strip()}); use fewer "
                                     f"lists/centroids or a larger retrieval.train_sample / database") from None
        write_index(index, trained)
    return trained, sample_size


def _add_shards(vectors, out_dir: Path, trained: Path, executor: Executor, workers: int) -> list[Path]:
    """The embedding shards added to copies of the trained index by tasks (add_groups), in parallel
    (a task is the unit of resumption); nothing for an index that is not mergeable (the merge adds
    everything in one pass)."""
    faiss = faiss_module()

    index = read_index(trained)
    kind = merge_kind(index)
    if kind == "serial":
        return []
    shards_dir = out_dir / "shards"
    shards_dir.mkdir(exist_ok=True)
    groups, start = add_groups(vectors.shard_files(), faiss.extract_index_ivf(index).nlist if kind == "ivf" else 0), 0
    part_paths, jobs = [], []
    for group in groups:
        path = shards_dir / f"part-{start:05d}-{start + len(group) - 1:05d}.faissindex"
        start += len(group)
        part_paths.append(path)
        # Absolute paths: a task may run on another node, or in another working directory.
        if not path.exists():
            jobs.append((str(trained.resolve()), [(first, str(Path(p).resolve())) for first, p, _ in group],
                         str(path.resolve())))
    for _ in executor(add_shards, jobs, workers):
        pass
    return part_paths


def _merge(vectors, out_dir: Path, trained: Path, kind: str, shard_paths: list[Path]):
    """The shards merged into the final index, written into place (IVF: with on-disk inverted lists)."""
    if kind == "ivf":
        return _merge_ivf(read_index(trained), shard_paths, out_dir)
    merged = read_index(trained)
    if kind == "codes":
        faiss = faiss_module()
        for path in shard_paths:
            merged.merge_from(faiss.read_index(str(path)), 0)
    else:
        for _, x in vectors.shards():
            merged.add(x)
    write_index(merged, out_dir / INDEX_FILE)
    return merged


def _merge_ivf(index, shard_paths: list[Path], out_dir: Path):
    """merge_ondisk into index.ivfdata, both files renamed into place only when complete."""
    faiss = faiss_module()
    from faiss.contrib.ondisk import merge_ondisk

    data_tmp = tmp_path(out_dir / IVFDATA_FILE)
    data_tmp.unlink(missing_ok=True)
    merge_ondisk(index, [str(p) for p in shard_paths], str(data_tmp))
    invlists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
    invlists.filename = IVFDATA_FILE  # a bare name: read back with IO_FLAG_ONDISK_SAME_DIR
    faiss.write_index(index, str(tmp_path(out_dir / INDEX_FILE)))
    os.replace(data_tmp, out_dir / IVFDATA_FILE)
    os.replace(tmp_path(out_dir / INDEX_FILE), out_dir / INDEX_FILE)
    return index


def load_index(out_dir: Path, manifest: dict, dim: int, nprobe: int, ef_search: int):
    """The merged index, checked against the embeddings' dimension, with search parameters set."""
    index = read_index(out_dir / INDEX_FILE)
    if index.d != dim:
        raise RetrievalError(f"{out_dir / INDEX_FILE}: index dimension {index.d} does not match the embedding "
                             f"dimension {dim} (embeddings/manifest.json); delete {out_dir} and run build_index again")
    if index.ntotal != manifest["ntotal"]:
        raise RetrievalError(f"{out_dir / INDEX_FILE}: holds {index.ntotal} vectors, its manifest says "
                             f"{manifest['ntotal']}; delete {out_dir} and run build_index again")
    set_search_params(index, nprobe, ef_search)
    return index


def search_params(index, allowed: np.ndarray | None):
    """FAISS search parameters restricting results to the database ids `allowed` (sorted int64), or None.

    The index's own nprobe / efSearch are carried over: parameters given to a search replace them.
    """
    if allowed is None:
        return None
    faiss = faiss_module()

    selector = faiss.IDSelectorBatch(len(allowed), faiss.swig_ptr(np.ascontiguousarray(allowed, dtype=np.int64)))
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        params = faiss.SearchParametersIVF(sel=selector, nprobe=ivf.nprobe)
    else:
        params = faiss.SearchParameters(sel=selector)
    params._keep = (selector, allowed)  # the selector points into `allowed`: keep both alive
    return params


def search(index, queries: np.ndarray, fetch: int, rows: Callable[[np.ndarray], np.ndarray] | None = None,
           allowed: np.ndarray | None = None) -> np.ndarray:
    """(q, fetch) database ids, nearest first, -1 = none; re-ranked by exact distance when rows is given.

    rows(ids) -> (len(ids), d) float32 database vectors (the stored embeddings). Re-ranking the
    candidates recovers most of the recall PQ codes lose, at `fetch` row reads per query.
    allowed: only these database ids may be returned (a smaller database inside this index).
    """
    params = search_params(index, allowed)
    _, ids = index.search(queries, fetch, params=params) if params is not None else index.search(queries, fetch)
    if rows is None:
        return ids
    out = np.empty_like(ids)
    for start in range(0, len(ids), 4096):  # bounded memory: 4096 × C × d floats at a time
        block, q = ids[start:start + 4096], queries[start:start + 4096]
        vectors = rows(np.maximum(block, 0).reshape(-1)).reshape(*block.shape, -1)  # (q, C, d)
        dist = np.where(block >= 0, ((vectors - q[:, None, :]) ** 2).sum(-1), np.inf)
        out[start:start + 4096] = np.take_along_axis(block, np.argsort(dist, axis=1, kind="stable"), 1)
    return out


def exact_search(queries: np.ndarray, shards: Iterable[tuple[int, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact L2 top-k over database shards given as (first id, (n, d)): (distances, ids), each (q, k)."""
    faiss = faiss_module()

    best_d = np.full((len(queries), 0), np.inf, dtype=np.float32)
    best_i = np.full((len(queries), 0), -1, dtype=np.int64)
    for first, x in shards:
        if not len(x):
            continue
        d, i = faiss.knn(queries, x, min(k, len(x)))
        best_d, best_i = np.concatenate([best_d, d], 1), np.concatenate([best_i, i + first], 1)
        order = np.argsort(best_d, axis=1, kind="stable")[:, :k]
        best_d, best_i = np.take_along_axis(best_d, order, 1), np.take_along_axis(best_i, order, 1)
    return best_d, best_i


def recall_at_k(queries: np.ndarray, found: np.ndarray, exact_d: np.ndarray, rows: Callable[[np.ndarray], np.ndarray]) -> float:
    """Share of the index's top-k that are within the exact k-th distance (ties count as hits).

    Counting by distance rather than by id keeps exact duplicates (identical chunks) from
    looking like misses. rows(ids) -> (len(ids), d) gives database vectors.
    """
    k = exact_d.shape[1]
    ids = found[:, :k]
    valid = ids >= 0
    vectors = rows(np.where(valid, ids, 0).reshape(-1)).reshape(*ids.shape, -1)   # (q, k, d)
    true_d = ((vectors - queries[:, None, :]) ** 2).sum(-1)                        # (q, k)
    hits = valid & (true_d <= exact_d[:, -1:] + 1e-4)
    return float(hits.sum() / ids.size)


def recall_check(index, vectors, query_emb, k: int, n_queries: int, seed: int, fetch: int | None = None,
                 rerank: bool = False) -> dict:
    """recall@k of the index (as the neighbour stage searches it: `fetch` candidates, optionally
    re-ranked) against exact search over `vectors` (DatabaseVectors), on validation chunks of the
    training data (query_emb: its retrieval.embed_job.Embeddings), which are not in the database."""
    split = "validation" if query_emb.count("validation") else "train"
    total = query_emb.count(split)
    n = min(n_queries, total)
    if n == 0 or k > len(vectors):
        return {"k": k, "queries": 0, "recall": None, "query_split": split}
    ids = np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))
    queries = query_emb.rows(split, ids)
    exact_d, _ = exact_search(queries, vectors.shards(), k)
    found = search(index, queries, min(max(fetch or k, k), index.ntotal), vectors.rows if rerank else None)
    return {"k": k, "queries": n, "query_split": split, "rerank": rerank,
            "recall": round(recall_at_k(queries, found, exact_d, vectors.rows), 4)}
