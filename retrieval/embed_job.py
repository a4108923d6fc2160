"""Frozen BERT embeddings of every chunk (RETRO §2.3), stored in shards aligned with the chunk store.

    model = load_embedder(resolve_model_path(""), device="cpu")
    vectors = embed(model, ["some text", "more text"])     # (2, d) float32, unit length

`embed` is the pure core; `embed_job` turns a range of chunk ids into text and embeds it. The
driver (`embed_stores`, for every part of a database at once; `embed_store` for one chunk store)
cuts every split into jobs of `retrieval.embed_batch_size` chunks and hands them, in one call, to
a runner: `serial_embed_runner` (in-process, tests) or `retrieval.ray_embed.RayEmbedRunner`
(Ray Data actors). A job is always the same chunks, whoever runs it, so the bytes written do not
depend on the runner, the number of actors or a resume. A chunk whose tokens copy an earlier
chunk's (retrieval.copies: the database's parts in order, then splits, then ids) is skipped by its
job and takes its source's vector: each text is embedded once.

Layout of `<retrieval_dir>/embeddings/`:
    <split>/shard-NNNNN.npy   (chunks in chunk-store shard NNNNN, d) float16, unit length
    manifest.json             model, dim, shards, sha256 per shard, chunk-store fingerprint
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from retropipe.data.chunking import SPLITS
from retropipe.data.cpu import emulated_bf16
from retropipe.data.errors import BUILD_DATABASE
from retropipe.data.stage import fingerprint, load_npy, open_stage, save_npy, sha256_file, write_json
from retropipe.data.store import ChunkStore
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.copies import ChunkCopies, ShardAssembly, find_copies
# The model behind retrieval.embedder (re-exported: retrieval.embed_job is where callers find them).
from retropipe.retrieval.embedder import (DEFAULT_MODEL_NAME, cached_embedder, embedding_backend,  # noqa: F401
                                          embedding_dim, hub_name, load_embedder, model_identity,
                                          resolve_embed_precision, resolve_model_path)

MANIFEST_VERSION = 1

# Texts per forward pass inside a job, sorted by length: less padding than one big batch, and
# big enough (16 × ~50 tokens) that the matmuls stay efficient on CPU.
SUB_BATCH = 16
# On a GPU a forward takes as many texts as fit this many tokens padded: 16 texts (~800 tokens)
# left all-MiniLM-L6-v2 waiting on its kernel launches (an H100 under 1% of its fp16 peak, no faster
# in fp16 than in fp32), and a fixed count of 512 padded the group holding a job's longest texts
# to them (48% of the tokens fed were padding). docs/benchmarks.md, "GPU: one NVIDIA H200".
GPU_SUB_BATCH_TOKENS = 32768


def sub_batches(lengths: list[int], device, sub_batch: int | None = None) -> list[np.ndarray]:
    """The texts of each forward, as indices into lengths (each text's tokens), shortest first:
    `sub_batch` texts at a time where given; else SUB_BATCH on a CPU, and on a GPU as many as
    fit GPU_SUB_BATCH_TOKENS tokens padded to the group's longest."""
    if sub_batch is not None and sub_batch < 1:
        raise ValueError(f"sub_batch {sub_batch}: texts per forward must be at least 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    if sub_batch is not None or not str(device).startswith("cuda"):
        n = sub_batch or SUB_BATCH
        return [order[s:s + n] for s in range(0, len(order), n)]
    groups, start = [], 0
    for i, n in enumerate(lengths[order]):
        if i > start and (i + 1 - start) * n > GPU_SUB_BATCH_TOKENS:
            groups.append(order[start:i])
            start = i
    return groups + [order[start:]] if len(order) else groups


def embed(model, texts: list[str], sub_batch: int | None = None) -> np.ndarray:
    """Sentence embeddings of texts: (len(texts), d) float32, L2-normalised.

    Texts are sorted by their length in the embedder's own tokens and run in sub-batches padded
    to their own longest text, so little compute goes to padding; the result is in the input
    order. Sorted by characters instead, the demo's chunks were fed with 25% padding in jobs of 64
    and about a fifth in any larger job (a chunk's characters say little about its WordPiece
    count); sorted by tokens, 16% in jobs of 64 and 2% in jobs of 1,024 (docs/benchmarks.md).
    A plain-torch BERT (retrieval/bert.py) tokenizes each text once; a SentenceTransformer
    tokenizes to sort and again to embed. sub_batch: texts per forward (None: the model's
    device's, `sub_batches`).
    """
    import torch

    if hasattr(model, "token_ids"):                                    # retrieval/bert.PlainBert
        ids = model.token_ids(texts)
        lengths = [len(i) for i in ids]

        def pooled(idx):
            return model.embed_ids([ids[i] for i in idx])
    else:
        from sentence_transformers.util import batch_to_device

        # preprocess() replaced tokenize() in sentence-transformers 6; keep both working.
        preprocess = getattr(model, "preprocess", None) or model.tokenize
        lengths = token_lengths(model, texts)

        def pooled(idx):
            return model(batch_to_device(preprocess([texts[i] for i in idx]), model.device))["sentence_embedding"]
    out = np.zeros((len(texts), embedding_dim(model)), dtype=np.float32)
    with torch.inference_mode():
        for idx in sub_batches(lengths, getattr(model, "device", "cpu"), sub_batch):
            out[idx] = torch.nn.functional.normalize(pooled(idx).float(), dim=-1).cpu().numpy()
    return out


def token_lengths(model, texts: list[str]) -> list[int]:
    """Each text's length in the tokens the embedder reads (special tokens and truncation
    included); characters for a model without a tokenizer of its own."""
    if hasattr(model, "token_ids"):
        return [len(i) for i in model.token_ids(texts)]
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return [len(t) for t in texts]
    limit = getattr(model, "max_seq_length", None)
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=True, truncation=limit is not None,
                                         max_length=limit)["input_ids"]]


def chunk_texts(tokens: np.ndarray, lengths: np.ndarray, encoding, eot_id: int) -> list[str]:
    """Decode chunks back to text: padding (beyond `length`) and end-of-text markers dropped."""
    texts = []
    for row, n in zip(tokens, lengths):
        ids = row[:n]
        texts.append(encoding.decode(ids[ids != eot_id].tolist()))
    return texts


@dataclass(frozen=True)
class EmbedJob:
    """Embed chunks [start, stop) of a split; they belong to chunk-store shard `shard` of the
    spec's chunk store number `part` (one pass embeds every part of a database)."""

    split: str
    shard: int
    start: int
    stop: int
    part: int = 0
    # Chunk ids in [start, stop) that copy an earlier chunk of the database (retrieval.copies): not
    # embedded, their rows left zero; the driver writes their sources' vectors there.
    skip: tuple[int, ...] = ()


@dataclass(frozen=True)
class EmbedSpec:
    """What a runner needs to embed jobs anywhere: plain paths and settings, picklable."""

    data_dirs: tuple[str, ...]  # the chunk stores, indexed by EmbedJob.part
    model_path: str
    tokenizer: str
    sub_batch: int | None = None  # texts per forward; None: the embedding device's (sub_batches)
    # The hub id when retrieval.embedder is one: a node without model_path fetches it by commit.
    hub_name: str | None = None
    # The embedder's precision, resolved once for the whole build (retrieval.embed_precision).
    precision: str = "fp32"
    # How the model is computed (embedder.load_embedder): "auto", or "sentence-transformers" to compare.
    backend: str = "auto"


def runner_precision(runner, precision: str) -> str:
    """retrieval.embed_precision on the device `runner` embeds on: a runner that knows its device
    says so (`embed_device`); one that does not embeds on this process's CPU. bf16 asked for by
    name on a CPU that emulates it is kept, with a warning (data/cpu.py emulated_bf16)."""
    device = runner.embed_device() if hasattr(runner, "embed_device") else "cpu"
    slow = emulated_bf16("retrieval.embed_precision", precision, device)
    if slow:
        print(f"build_index: warning: {slow}", file=sys.stderr, flush=True)
    return resolve_embed_precision(precision, device)


def embed_job(model, store: ChunkStore, encoding, job: EmbedJob, sub_batch: int | None = None) -> np.ndarray:
    """(stop - start, d) float16 embeddings of one job's chunks (`store`: the job's part); the
    rows of the chunks it skips (copies of earlier ones) are zeros."""
    split = store.split(job.split)
    ids = np.arange(job.start, job.stop)
    ids = ids[~np.isin(ids, np.asarray(job.skip, dtype=np.int64))]
    out = np.zeros((job.stop - job.start, embedding_dim(model)), np.float16)
    if len(ids):
        texts = chunk_texts(split.tokens(ids), split.lengths[ids], encoding, store.eot_id)
        out[ids - job.start] = embed(model, texts, sub_batch)
    return out


# runner(spec, jobs) -> iterator of (job, (n, d) float16 embeddings), in any order
EmbedRunner = Callable[[EmbedSpec, list[EmbedJob]], Iterator[tuple[EmbedJob, np.ndarray]]]


def serial_embed_runner(spec: EmbedSpec, jobs: list[EmbedJob]) -> Iterator[tuple[EmbedJob, np.ndarray]]:
    """Embed in this process (tests, or a machine without Ray)."""
    from retropipe.data.tokenizer import get_tokenizer

    if not jobs:
        return
    model = cached_embedder(spec.model_path, "cpu", spec.precision, spec.backend)
    stores, encoding = [ChunkStore(d) for d in spec.data_dirs], get_tokenizer(spec.tokenizer)
    for job in jobs:
        yield job, embed_job(model, stores[job.part], encoding, job, spec.sub_batch)


def plan_jobs(store: ChunkStore, split: str, shard: int, batch_size: int, part: int = 0) -> list[EmbedJob]:
    """Jobs of one chunk-store shard: fixed slices, so a resume recomputes exactly the same batches."""
    offsets = np.cumsum([0] + store.manifest["shard_chunks"][split])
    start, stop = int(offsets[shard]), int(offsets[shard + 1])
    return [EmbedJob(split, shard, s, min(s + batch_size, stop), part) for s in range(start, stop, batch_size)]


def shard_file(name: str) -> str:
    return name.replace(".arrow", ".npy")


def embed_store(store: ChunkStore, out_dir: Path, embedder: str, batch_size: int, runner: EmbedRunner,
                progress: Callable[[int], None] | None = None, precision: str = "fp32") -> dict:
    """Embed every chunk of every split into out_dir (resumable) with the embedder's weights in
    `precision` (resolved: fp32, bf16 or fp16); return the manifest."""
    return embed_stores([(store, Path(out_dir))], embedder, batch_size, runner, progress, precision)[0]


def embed_stores(parts: list[tuple[ChunkStore, Path]], embedder: str, batch_size: int, runner: EmbedRunner,
                 progress: Callable[[int], None] | None = None, precision: str = "fp32") -> list[dict]:
    """`embed_store` for every (chunk store, out_dir) of a database in one pass of the runner: one
    pool of embedding actors, each loading the model once, for all parts (a pass per part paid the
    actors' start-up per part). Each part stays its own stage: skipped when complete, resumed from
    its finished shards, its manifest written when its last shard is in. A chunk that copies an
    earlier one (in its part or an earlier part) is not embedded but takes that chunk's vector."""
    model_path = resolve_model_path(embedder)
    identity = model_identity(model_path, embedder)

    def inputs_of(store: ChunkStore) -> dict:
        # fp32, the only precision before there was a choice, is left out: such a build stays complete.
        return {"version": MANIFEST_VERSION, "chunk_store_fingerprint": store.fingerprint, "model": identity,
                **({"precision": precision} if precision != "fp32" else {})}

    manifests, names, pending, jobs = [], [], {}, []
    for p, (store, out_dir) in enumerate(parts):
        done = open_stage(out_dir, inputs_of(store))
        manifests.append({**done, "skipped": True} if done is not None else None)
        names.append({s: store.manifest["shards"][s] for s in SPLITS})
        missing = _missing_shard_jobs(store, out_dir, names[p], batch_size, p, pending) if done is None else []
        jobs += missing
        if progress:  # what is on disk already: a complete part, or a resumed part's finished shards
            progress(sum(len(store.split(s)) for s in SPLITS) - sum(j.stop - j.start for j in missing))
    # Each text is embedded once: a chunk that copies an earlier one takes its vector (retrieval.copies);
    # a shard is written as soon as it is complete, so a kill loses little.
    copies = find_copies([store for store, _ in parts]) if jobs else ChunkCopies()
    jobs = [replace(j, skip=tuple(copies.in_range(j.part, j.split, j.start, j.stop).tolist())) for j in jobs]
    shards = ShardAssembly([store for store, _ in parts], lambda p, split, i: parts[p][1] / split
                           / shard_file(names[p][split][i]), pending, copies, jobs)
    spec = EmbedSpec(tuple(str(Path(store.root).resolve()) for store, _ in parts), str(Path(model_path).resolve()),
                     parts[0][0].manifest["tokenizer"], hub_name=hub_name(embedder), precision=precision)
    embedded, copied, begin = [0] * len(parts), [0] * len(parts), time.perf_counter()
    for job, vectors in runner(spec, jobs):
        embedded[job.part] += len(vectors) - len(job.skip)
        copied[job.part] += len(job.skip)
        if progress:
            progress(len(vectors))
        shards.add(job, vectors)
    if shards.unwritten:
        raise RetrievalError(f"embedding runner returned no result for shards {shards.unwritten}")
    # The pass's time is shared by its parts: each records the pass's rate, over every chunk it wrote.
    seconds = time.perf_counter() - begin
    run = {"seconds": round(seconds, 2), "chunks_per_second": round((sum(embedded) + sum(copied)) / max(seconds, 1e-9), 1)}
    for p, (store, out_dir) in enumerate(parts):
        if manifests[p] is None:
            _write_empty_shards(out_dir, names[p], shards.dim)
            manifests[p] = {**_finalize(store, out_dir, inputs_of(store), names[p], model_path, identity, precision),
                            "run": {**run, "chunks_embedded": embedded[p], "chunks_copied": copied[p]}}
    return manifests


def _missing_shard_jobs(store: ChunkStore, out_dir: Path, names: dict, batch_size: int, part: int,
                        pending: dict) -> list[EmbedJob]:
    """The jobs of part `part`'s shards not written yet; pending[(part, split, shard)] = their count.
    A shard without chunks (a block with no validation document) has none: it is written empty."""
    jobs = []
    for split in SPLITS:
        (out_dir / split).mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(names[split]):
            if not (out_dir / split / shard_file(name)).exists():
                shard_jobs = plan_jobs(store, split, i, batch_size, part)
                jobs += shard_jobs
                if shard_jobs:
                    pending[(part, split, i)] = len(shard_jobs)
    return jobs


def _write_empty_shards(out_dir: Path, names: dict, dim: int | None) -> None:
    """Shards without chunks (a block with no validation document) written with the width of the
    others (read from a finished shard when this run embedded nothing)."""
    def shard(split, name):
        return out_dir / split / shard_file(name)

    if dim is None:
        dim = next((load_npy(shard(s, n), rerun=f"run {BUILD_DATABASE}").shape[1] for s in SPLITS for n in names[s]
                    if shard(s, n).exists() and load_npy(shard(s, n), rerun=f"run {BUILD_DATABASE}").shape[0]), None)
    for split in SPLITS:
        for name in names[split]:
            if not shard(split, name).exists():
                save_npy(shard(split, name), np.zeros((0, dim or 0), np.float16))


def _finalize(store: ChunkStore, out_dir: Path, inputs: dict, names: dict, model_path: Path, identity: dict,
              precision: str) -> dict:
    shas, dims = {}, set()
    for split in SPLITS:
        shas[split] = []
        for i, name in enumerate(names[split]):
            path = out_dir / split / shard_file(name)
            arr = load_npy(path, rerun=f"run {BUILD_DATABASE}")
            expected = store.manifest["shard_chunks"][split][i]
            if arr.shape[0] != expected or arr.dtype != np.float16:
                raise RetrievalError(f"{path}: {arr.shape} {arr.dtype}, expected ({expected}, d) float16; "
                                     f"delete it and run build_index again")
            if arr.shape[0]:
                dims.add(arr.shape[1])
            shas[split].append(sha256_file(path))
    if len(dims) > 1:
        raise RetrievalError(f"{out_dir}: embedding shards disagree on the dimension {sorted(dims)}")
    manifest = {
        "version": MANIFEST_VERSION, "inputs": inputs,
        "model": identity["name"], "model_path": str(model_path), "model_sha256": identity["sha256"],
        "precision": precision, "backend": embedding_backend(model_path),   # what computed it: same vectors either way
        "dim": dims.pop() if dims else 0, "dtype": "float16", "normalized": True,
        "chunk_store_fingerprint": store.fingerprint,
        "shards": {s: [shard_file(n) for n in names[s]] for s in SPLITS},
        "shard_chunks": {s: list(store.manifest["shard_chunks"][s]) for s in SPLITS},
        "sha256": shas,
    }
    manifest["fingerprint"] = fingerprint({k: manifest[k] for k in ("inputs", "dim", "sha256")})
    write_json(out_dir / "manifest.json", manifest)
    return manifest


class Embeddings:
    """Read a finished embeddings directory: shards memory-mapped, rows by chunk id."""

    def __init__(self, out_dir: Path, manifest: dict):
        self.dir, self.manifest = Path(out_dir), manifest
        self.dim: int = manifest["dim"]
        self.fingerprint: str = manifest["fingerprint"]
        self._maps: dict[tuple[str, int], np.ndarray] = {}  # memory-mapped shards, opened once

    def offsets(self, split: str) -> np.ndarray:
        return np.cumsum([0] + self.manifest["shard_chunks"][split])

    def __len__(self) -> int:
        return int(self.offsets("train")[-1])

    def count(self, split: str) -> int:
        return int(self.offsets(split)[-1])

    def shard_path(self, split: str, i: int) -> Path:
        return self.dir / split / self.manifest["shards"][split][i]

    def shard(self, split: str, i: int) -> np.ndarray:
        """(n, d) float32 of shard i (a copy: FAISS wants float32)."""
        arr = load_npy(self.shard_path(split, i), rerun=f"run {BUILD_DATABASE}")
        if arr.ndim != 2 or (arr.shape[0] and arr.shape[1] != self.dim):
            raise RetrievalError(f"{self.shard_path(split, i)}: shape {arr.shape} does not match the embedding "
                                 f"dimension {self.dim} in {self.dir / 'manifest.json'}")
        return np.asarray(arr, dtype=np.float32).reshape(-1, self.dim)

    def shards(self, split: str) -> Iterable[tuple[int, np.ndarray]]:
        """(first chunk id, (n, d) float32) per shard, in order."""
        offsets = self.offsets(split)
        for i in range(len(self.manifest["shards"][split])):
            yield int(offsets[i]), self.shard(split, i)

    def rows(self, split: str, ids: np.ndarray) -> np.ndarray:
        """(len(ids), d) float32 embeddings of the given chunk ids.

        The ids are sorted and cut into runs of one shard: a mask of all ids per shard touched
        cost len(ids) × shards, and the neighbour stage's re-rank, whose ids span the whole
        database, grew with the square of the database (bench/scaling/scale.py)."""
        ids = np.asarray(ids, dtype=np.int64)
        offsets = self.offsets(split)
        order = np.argsort(ids, kind="stable")
        shard = np.searchsorted(offsets, ids[order], side="right") - 1
        starts = np.flatnonzero(np.diff(shard, prepend=-1))       # where each run of one shard begins
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for begin, end in zip(starts, [*starts[1:], len(ids)]):
            s, sel = int(shard[begin]), order[begin:end]
            key = (split, s)
            if key not in self._maps:
                self._maps[key] = load_npy(self.shard_path(split, s), rerun=f"run {BUILD_DATABASE}")
            out[sel] = self._maps[key][ids[sel] - offsets[s]]
        return out
