"""The stages bench/scaling/scale.py measures, one (stage, size) a process: setup untimed, then
the stage under `measured` (its seconds; its peak RSS above the RSS before it; the anonymous part).
The sizes, what each counts and why the inputs are what they are: scale.py's docstring.
"""

from __future__ import annotations

import ctypes
import gzip
import json
import math
import resource
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from retropipe.data.config import DEFAULT_CORPUS, DataConfig

# Per mode: replicas of the corpus (prepare, index, neighbours), chunks (embed, evaluate) and
# sequences a step (train). The test's are the smallest that still run every stage.
SIZES = {
    "tiny": {"data": (0.02, 0.04), "embed": (24, 48), "train": (1, 2), "evaluate": (8, 16)},
    "quick": {"data": (2, 4, 8, 16), "embed": (512, 1024, 2048, 4096), "train": (1, 2, 4, 8),
              "evaluate": (128, 256, 512, 1024)},
    "full": {"data": (8, 16, 32, 64, 128), "embed": (1024, 2048, 4096, 8192), "train": (4, 8, 16, 32, 64),
             "evaluate": (1024, 2048, 4096, 8192, 16384)},
}
CORPUS_DOCS = 3306            # documents of the shipped corpus
DATA = dict(chunk_len=64, validation_fraction=0.05, docs_per_shard=512, whitespace="collapse", num_workers=1)
SEQ_LEN, CHUNKS_PER_SEQ, K, CANDIDATES, NPROBE, DIM = 256, 4, 2, 20, 16, 384


# -- measuring, in the child ------------------------------------------------------------------

def status_kb(field: str) -> int:
    """A /proc/self/status field (VmRSS, RssAnon) in kB."""
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), 0)


def release_free_heap() -> None:
    """Return the heap that setup freed to the kernel (glibc's malloc_trim): a stage that reused it
    would show less growth than it has, the more so the smaller it is, which lifted the index's
    memory exponent from its 0.5 to 0.73."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: the measure keeps that bias
        pass


def measured(stage) -> dict:
    """stage()'s result with its seconds, its peak MB above the RSS before it and the anonymous part."""
    release_free_heap()
    before, anon_before = status_kb("VmRSS"), status_kb("RssAnon")
    try:   # the high-water mark restarts here: setup's own peak must not stand in for the stage's
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    anon, done = [anon_before], threading.Event()

    def sample():
        while not done.wait(0.01):
            anon[0] = max(anon[0], status_kb("RssAnon"))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    result = stage()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # kB on Linux
    return {**result, "seconds": seconds, "peak_mb": (peak - before) / 1024,
            "anon_mb": (max(anon[0], status_kb("RssAnon")) - anon_before) / 1024}


# -- inputs ------------------------------------------------------------------------------------

def replicated_corpus(path: Path, replicas: int) -> Path:
    """The shipped corpus `replicas` times over, each replica's documents distinct (the docstring)."""
    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    with open(path, "w", encoding="utf-8") as out:
        for r in range(replicas):
            for d in docs:
                out.write(json.dumps(d if r == 0 else {**d, "id": f"{d['id']}#{r}", "text": f"({r}) {d['text']}"}))
                out.write("\n")
    return path


def data_config(corpus: Path, documents: int) -> DataConfig:
    return DataConfig(corpus=str(corpus), max_documents=documents, **DATA)


def prepared(work: Path, documents: int, corpus: Path):
    """The chunk store of the corpus's first `documents` documents (prepared here if missing)."""
    from retropipe.data.prepare import prepare
    from retropipe.data.store import ChunkStore

    prepare(data_config(corpus, documents), work / f"data-{documents}", progress=False)
    return ChunkStore(work / f"data-{documents}")


def synthetic_embeddings(store, out: Path) -> Path:
    """Clustered unit vectors as an embeddings directory of `store` (both splits, its shards)."""
    from bench.index import ClusteredVectors
    from retropipe.data.stage import save_npy, write_json

    if (out / "manifest.json").exists():
        return out
    counts, names = store.manifest["shard_chunks"], {}
    gen = ClusteredVectors(DIM, max(sum(map(sum, counts.values())) // 100, 8), rank=32, spread=1.0, seed=1234)
    for split, sizes in counts.items():
        (out / split).mkdir(parents=True, exist_ok=True)
        names[split] = [n.replace(".arrow", ".npy") for n in store.manifest["shards"][split]]
        x = gen.sample(sum(sizes)).astype(np.float16)
        for name, start, n in zip(names[split], np.cumsum([0] + sizes), sizes):
            save_npy(out / split / name, x[start:start + n])
    write_json(out / "manifest.json", {"dim": DIM, "fingerprint": f"synthetic-{store.fingerprint}", "shards": names,
                                       "shard_chunks": counts, "chunk_store_fingerprint": store.fingerprint})
    return out


def database_at(work: Path, replicas: float, corpus: Path):
    """(store, database root, its vectors): prepare's store at this size, a database of its training split."""
    from retropipe.data.database_reader import Database
    from retropipe.retrieval.database_parts import PartSource, open_vectors, write_database

    store = prepared(work, round(replicas * CORPUS_DOCS), corpus)
    root = work / f"retrieval-{round(replicas * CORPUS_DOCS)}"
    emb = synthetic_embeddings(store, root / "embeddings")
    write_database(root, [PartSource("train", store, emb)], {"name": "synthetic", "sha256": "synthetic"})
    return store, root, open_vectors(Database(root))


def index_settings(template: str, n: int) -> tuple[str, int]:
    """(factory, training vectors) for a database of n chunks (the docstring)."""
    lists = max(round(4 * math.sqrt(n)), 1)
    sample = min(30 * lists, n)
    factory = template.replace("{K}", str(lists))
    return (factory.replace("PQ32", "PQ32x4") if sample < 39 * 256 else factory), sample


# -- the stages: setup untimed, then measured(the stage) ---------------------------------------

def run_prepare(work: Path, replicas: float, corpus: Path, args) -> dict:
    from retropipe.data.prepare import prepare
    from retropipe.data.stage import serial_executor

    documents = round(replicas * CORPUS_DOCS)
    shutil.rmtree(work / f"data-{documents}", ignore_errors=True)   # a stage found complete would be skipped

    def stage():
        manifest = prepare(data_config(corpus, documents), work / f"data-{documents}", serial_executor, progress=False)
        return {"units": sum(map(sum, manifest["shard_chunks"].values())),
                "tokens": sum(s["tokens"] for s in manifest["splits"].values())}
    return measured(stage)


def run_embed(work: Path, chunks: int, corpus: Path, args) -> dict:
    from retropipe.data.tokenizer import get_tokenizer
    from retropipe.retrieval.embed_job import (cached_embedder, chunk_texts, embed, embed_stores,
                                               resolve_embed_precision, resolve_model_path, serial_embed_runner)

    whole = prepared(work / "embed", CORPUS_DOCS, Path(DEFAULT_CORPUS))   # its first documents holding `chunks`
    documents = int(np.searchsorted(np.cumsum(whole.documents.column("num_chunks").to_numpy()), chunks)) + 1
    store = prepared(work / "embed", min(documents, CORPUS_DOCS), Path(DEFAULT_CORPUS))
    precision = resolve_embed_precision("auto", "cpu")
    model = cached_embedder(str(resolve_model_path("").resolve()), "cpu", precision, "auto")  # as an actor's
    split = store.split("train")   # warm-up: the common sub-batch shapes' kernels made before the stage
    embed(model, chunk_texts(split.tokens(np.arange(min(len(split), 256))), split.lengths[:256],
                             get_tokenizer(store.manifest["tokenizer"]), store.eot_id))
    shutil.rmtree(work / "embed" / f"embeddings-{chunks}", ignore_errors=True)

    def stage():
        manifest = embed_stores([(store, work / "embed" / f"embeddings-{chunks}")], "", 1024, serial_embed_runner,
                                precision=precision)[0]
        return {"units": sum(map(sum, manifest["shard_chunks"].values())), "precision": precision}
    return measured(stage)


def run_index(work: Path, replicas: float, corpus: Path, args) -> dict:
    from retropipe.data.stage import serial_executor
    from retropipe.retrieval.index import build_index

    _, root, vectors = database_at(work, replicas, corpus)
    factory, sample = index_settings(args.factory, len(vectors))
    shutil.rmtree(root / "index", ignore_errors=True)

    def stage():
        manifest = build_index(vectors, root / "index", factory, sample, 1234, serial_executor, 1)
        return {"units": len(vectors), "factory": factory, "train_sample": sample, "parts": manifest["seconds"]}
    return measured(stage)


def run_neighbours(work: Path, replicas: float, corpus: Path, args) -> dict:
    from retropipe.data.database_reader import Database
    from retropipe.data.stage import read_json
    from retropipe.retrieval.index import load_index
    from retropipe.retrieval.methods.dense import DenseSearch
    from retropipe.retrieval.neighbour_search import query_neighbours

    store, root, vectors = database_at(work, replicas, corpus)
    index = load_index(root / "index", read_json(root / "index" / "manifest.json"), DIM, NPROBE, 64)
    search = DenseSearch(index, vectors.parts[0][1], CANDIDATES, vectors.rows)
    inputs = {"bench": "scale", "embeddings_fingerprint": vectors.fingerprint, "index_fingerprint": "bench"}
    shutil.rmtree(root / "neighbours", ignore_errors=True)

    def stage():
        manifest = query_neighbours(search, store, Database(root), root / "neighbours", inputs, K, CANDIDATES,
                                    CHUNKS_PER_SEQ)
        return {"units": manifest["run"]["chunks_queried"],
                "missing": sum(s["missing"] for s in manifest["splits"].values())}
    return measured(stage)


def tiny_model(kind: str):
    """configs/tiny.yaml's model with the fused head training uses, and the precision `auto` picks here."""
    import torch

    from retropipe.data.cpu import cpu_has_bf16
    from retropipe.training.models.config import ModelConfig
    from retropipe.training.models.registry import build_model

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", kind=kind, n_positions=SEQ_LEN, chunk_len=DATA["chunk_len"],
                             embedding_init_std=0.1)
    return build_model(cfg, fused_head=True), (torch.bfloat16 if cpu_has_bf16() else torch.float32)


def run_train(work: Path, batch: int, corpus: Path, args, kind: str) -> dict:
    import torch

    from retropipe.training.models.gpt2 import FusedLoss

    model, dtype = tiny_model(kind)
    optimizer, loss_fn, steps = torch.optim.AdamW(model.parameters(), lr=1e-4), FusedLoss(), 3
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50257, (batch, SEQ_LEN + 1), generator=g)
    nbr = torch.randint(0, 50257, (batch, CHUNKS_PER_SEQ, K, 2 * DATA["chunk_len"]), generator=g)
    inputs = (tokens[:, :-1],) if kind == "gpt2" else (tokens[:, :-1], nbr)

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model(*inputs), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step()   # warm-up: AdamW's moments and the kernels exist before the stage

    def stage():
        for _ in range(steps):
            step()
        return {"units": batch * SEQ_LEN}
    result = measured(stage)
    return {**result, "seconds": result["seconds"] / steps}


def run_evaluate(work: Path, chunks: int, corpus: Path, args) -> dict:
    import torch

    from retropipe.data.tokenizer import get_tokenizer
    from retropipe.training.evaluation.scoring import score_split, token_byte_lengths

    store = prepared(work, round(SIZES[args.mode]["data"][0] * CORPUS_DOCS), corpus)
    model, dtype = tiny_model("retro")
    byte_lengths = token_byte_lengths(get_tokenizer(store.manifest["tokenizer"]))
    fixed = np.random.default_rng(0).integers(0, 50257, (K, 2 * DATA["chunk_len"]), dtype=np.int64)
    # Every chunk reads the same neighbours: scoring's cost, not retrieval's.
    source = SimpleNamespace(neighbour_tokens=lambda split, ids, k=0: np.broadcast_to(fixed, (*ids.shape,
                                                                                              *fixed.shape)))

    def score(n: int):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            return score_split(model.eval(), store.split("train"), byte_lengths, SEQ_LEN, SEQ_LEN // 2, source, K,
                               16, max_chunks=n)
    score(min(chunks, 40))   # warm-up: a full batch of windows' kernels made before the stage

    def stage():
        scores = score(chunks)
        return {"units": len(scores.nll), "bits_per_byte": round(scores.bits_per_byte(), 4)}
    return measured(stage)


RUNS = {"prepare": run_prepare, "embed": run_embed, "index": run_index, "neighbours": run_neighbours,
        "train-gpt2": lambda *a: run_train(*a, kind="gpt2"), "train-retro": lambda *a: run_train(*a, kind="retro"),
        "evaluate": run_evaluate}
