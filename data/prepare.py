"""Prepare a corpus into a chunk store: read → blocks → tokenize/chunk (in parallel) → shards.

The driver streams documents and cuts them into blocks of `docs_per_shard`; an executor
(Ray in launch/prepare_data.py, a plain loop in tests) runs `tokenize_block` on each; the
driver writes every result atomically. Block boundaries depend only on the corpus and the
config, so the bytes on disk do not depend on the number of workers. A block whose marker
(`blocks/NNNNN.json`) exists is not redone, so a killed run resumes where it stopped.

Output layout of `out_dir` (documented in docs/architecture.md):
    prepare.json                  config fingerprint; a different config is refused
    train/shard-NNNNN.arrow       chunk shards (Arrow IPC files, memory-mappable)
    validation/shard-NNNNN.arrow
    blocks/NNNNN.arrow|.json      per-block document rows and stats (the resume markers)
    documents.arrow               every kept document, with first_chunk within its split
    manifest.json                 written last: counts, bad-record counters, fingerprint
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from retropipe.data.chunking import SPLITS, Block, tokenize_block
from retropipe.data.config import DataConfig
from retropipe.data.errors import DataError
from retropipe.data.corpus_formats import BadRecords, read_documents
from retropipe.data.stage import Executor, atomic_write, fault_point, fingerprint, output_settings, serial_executor
from retropipe.data.tokenizer import get_tokenizer

# 2: documents.arrow has text_hash (exact-duplicate detection for the retrieval database).
MANIFEST_VERSION = 2


def config_fingerprint(cfg: DataConfig) -> str:
    """Fingerprint of the settings that change the bytes written (DataConfig.RUNTIME_KEYS do not)."""
    settings = output_settings(cfg)
    if settings.get("whitespace") == "keep":  # what data was before the key existed: the same fingerprint
        del settings["whitespace"]
    return fingerprint({**settings, "manifest_version": MANIFEST_VERSION})


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def process_block(index: int, first_doc: int, docs: list[tuple[str, str]], cfg: DataConfig) -> Block:
    """The unit of parallel work: runs in a Ray worker (or in-process), touches no files."""
    enc = get_tokenizer(cfg.tokenizer)
    return tokenize_block(index, first_doc, docs, enc, cfg.chunk_len, cfg.seed, cfg.validation_fraction)


def _write_block(out: Path, block: Block) -> dict:
    hashes = {split: atomic_write(out / split / shard_name(block.index), block.shards[split]) for split in SPLITS}
    atomic_write(out / "blocks" / f"{block.index:05d}.arrow", block.documents)
    marker = {"index": block.index, "sha256": hashes, **block.stats}
    atomic_write(out / "blocks" / f"{block.index:05d}.json", json.dumps(marker).encode())  # last: the marker
    return marker


def _claim_directory(out: Path, cfg: DataConfig) -> None:
    """Refuse to mix outputs of different configs in one directory."""
    claim = out / "prepare.json"
    fingerprint = config_fingerprint(cfg)
    if claim.exists():
        previous = json.loads(claim.read_text())
        if previous.get("manifest_version", 1) != MANIFEST_VERSION:
            raise DataError(f"{out} holds data prepared by an older RetroPipe (chunk-store format "
                            f"{previous.get('manifest_version', 1)}, now {MANIFEST_VERSION}); delete {out} and prepare again")
        if previous.get("config_fingerprint") != fingerprint:
            raise DataError(f"{out} holds data prepared with a different data config "
                            f"(fingerprint {previous.get('config_fingerprint')} != {fingerprint}, "
                            f"previous: {previous.get('config')}); use another workdir or delete {out}")
        return
    for sub in ("blocks", *SPLITS):
        (out / sub).mkdir(parents=True, exist_ok=True)
    atomic_write(claim, json.dumps({"config_fingerprint": fingerprint, "manifest_version": MANIFEST_VERSION,
                                    "config": asdict(cfg)}, indent=1).encode())


def load_manifest(out: Path) -> dict | None:
    path = Path(out) / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def prepare(cfg: DataConfig, out_dir: str | os.PathLike, executor: Executor = serial_executor,
            progress: bool = True) -> dict:
    """Prepare cfg.corpus into out_dir (resumable, idempotent); return the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _claim_directory(out, cfg)
    manifest = load_manifest(out)
    if manifest is not None:
        manifest["skipped"] = True
        return manifest

    start = time.perf_counter()
    bad = BadRecords(cfg.on_bad_record)
    done = {int(p.stem) for p in (out / "blocks").glob("*.json")}
    n_blocks = 0

    def jobs() -> Iterator[tuple]:
        nonlocal n_blocks
        docs, first_doc = [], 0
        for doc in read_documents(cfg.corpus, cfg.text_field, cfg.id_field, bad, cfg.max_documents, cfg.whitespace):
            docs.append((doc.source_id, doc.text))
            if len(docs) == cfg.docs_per_shard:
                if n_blocks not in done:
                    yield (n_blocks, first_doc, docs, cfg)
                n_blocks, first_doc, docs = n_blocks + 1, first_doc + len(docs), []
        if docs:
            if n_blocks not in done:
                yield (n_blocks, first_doc, docs, cfg)
            n_blocks += 1

    from tqdm import tqdm
    new_tokens = 0
    with tqdm(desc="prepare", unit=" blocks", disable=not progress, dynamic_ncols=True) as bar:
        for written, block in enumerate(executor(process_block, jobs(), cfg.num_workers), start=1):
            marker = _write_block(out, block)
            new_tokens += sum(marker["tokens"].values())
            bar.update(1)
            fault_point("prepare", written)  # tests: a hard crash after `written` blocks
    if n_blocks == 0:
        raise DataError(f"data.corpus={cfg.corpus!r}: no non-empty documents found")
    elapsed = time.perf_counter() - start
    manifest = _finalize(out, cfg, n_blocks, dict(bad.counts))
    manifest["run"] = {"seconds": round(elapsed, 3), "tokens_processed": new_tokens,
                       "tokens_per_second": round(new_tokens / max(elapsed, 1e-9), 1),
                       "blocks_resumed": len(done & set(range(n_blocks)))}
    return manifest


def _finalize(out: Path, cfg: DataConfig, n_blocks: int, bad_counts: dict) -> dict:
    markers = [json.loads((out / "blocks" / f"{i:05d}.json").read_text()) for i in range(n_blocks)]
    docs = pa.concat_tables([pa.ipc.open_file(pa.memory_map(str(out / "blocks" / f"{i:05d}.arrow"))).read_all()
                             for i in range(n_blocks)])
    # first_chunk: where each document's chunks start within its split (chunk ids are per split).
    split_col = np.asarray(docs.column("split").to_pylist())
    num_chunks = docs.column("num_chunks").to_numpy()
    first_chunk = np.zeros(len(docs), dtype=np.int64)
    for split in SPLITS:
        sel = split_col == split
        first_chunk[sel] = np.cumsum(num_chunks[sel]) - num_chunks[sel]
    docs = docs.append_column("first_chunk", pa.array(first_chunk))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, docs.schema) as writer:
        writer.write_table(docs)
    docs_sha = atomic_write(out / "documents.arrow", sink.getvalue().to_pybytes())

    h = hashlib.sha256()
    for split in SPLITS:
        for m in markers:
            h.update(f"{split}/{shard_name(m['index'])}:{m['sha256'][split]}\n".encode())
    h.update(f"documents.arrow:{docs_sha}\n".encode())
    totals = {key: {s: sum(m[key][s] for m in markers) for s in SPLITS}
              for key in ("documents", "chunks", "tokens", "bytes")}
    enc = get_tokenizer(cfg.tokenizer)
    manifest = {
        "version": MANIFEST_VERSION,
        "tokenizer": cfg.tokenizer, "vocab_size": enc.n_vocab, "eot_id": enc.eot_token,
        "pad_id": enc.eot_token, "chunk_len": cfg.chunk_len,
        "shards": {s: [shard_name(m["index"]) for m in markers] for s in SPLITS},
        "shard_chunks": {s: [m["chunks"][s] for m in markers] for s in SPLITS},
        "splits": {s: {k: totals[k][s] for k in totals} for s in SPLITS},
        "bad_records": dict(sorted(bad_counts.items())),
        "config_fingerprint": config_fingerprint(cfg),
        "fingerprint": h.hexdigest(),
    }
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=1).encode())
    return manifest


def summary(manifest: dict) -> str:
    """A one-screen summary of a prepared chunk store."""
    lines = [f"{'split':<12}{'documents':>12}{'chunks':>12}{'tokens':>14}{'bytes':>14}"]
    for split, c in manifest["splits"].items():
        lines.append(f"{split:<12}{c['documents']:>12,}{c['chunks']:>12,}{c['tokens']:>14,}{c['bytes']:>14,}")
    bad = manifest["bad_records"]
    lines.append("bad records: " + (", ".join(f"{k}={v}" for k, v in bad.items()) if bad else "none"))
    run = manifest.get("run")
    if manifest.get("skipped"):
        lines.append("already complete: nothing to do")
    elif run:
        lines.append(f"{run['tokens_processed']:,} tokens in {run['seconds']:.1f}s "
                     f"({run['tokens_per_second']:,.0f} tokens/s); blocks resumed: {run['blocks_resumed']}")
    lines.append(f"tokenizer {manifest['tokenizer']}, chunk_len {manifest['chunk_len']}, "
                 f"fingerprint {manifest['fingerprint'][:16]}")
    return "\n".join(lines)
