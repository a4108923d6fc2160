"""Documents → tokens → fixed-length chunks, as Arrow tables. Pure: no Ray, no files.

A document becomes its tokens plus end-of-text, cut into `chunk_len`-token chunks that
never cross documents; the last chunk is padded with `pad_id` and keeps its real `length`
so later stages can mask the padding out of the loss. One block of documents becomes one
shard per split; the same block always gives the same bytes, whoever processes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

SPLITS = ("train", "validation")


def chunk_schema(chunk_len: int) -> pa.Schema:
    return pa.schema([
        ("doc_index", pa.int64()),                      # row of the document in documents.arrow
        ("tokens", pa.list_(pa.int32(), chunk_len)),    # chunk_len token ids, padded with pad_id
        ("length", pa.int32()),                         # real tokens in this chunk (1..chunk_len)
    ])


DOC_SCHEMA = pa.schema([
    ("doc_index", pa.int64()),
    ("source_id", pa.string()),
    ("split", pa.string()),
    ("num_tokens", pa.int64()),   # including the end-of-text token
    ("num_chunks", pa.int64()),
    ("num_bytes", pa.int64()),    # UTF-8 bytes of the normalised text: the bits-per-byte denominator
    ("text_hash", pa.uint64()),   # of the normalised text: exact duplicates share it (text_hash())
])


def text_hash(text: str) -> int:
    """64-bit blake2b of a document's normalised text: equal texts, equal hashes, whatever their ids.

    The retrieval database never serves a query a chunk of a document with the same hash as the
    query's own document (or, in training, as any document of its sequence): exact copies of a
    document are leaks as much as the document itself.
    """
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def split_of(source_id: str, seed: int, validation_fraction: float) -> str:
    """Deterministic split from a hash of (seed, document id): stable across runs and machines."""
    digest = hashlib.blake2b(f"{seed}\x00{source_id}".encode(), digest_size=8).digest()
    return "validation" if int.from_bytes(digest, "big") / 2**64 < validation_fraction else "train"


@dataclass
class Block:
    """The Arrow IPC bytes of one block: a chunk shard per split plus its document rows."""

    index: int
    shards: dict[str, bytes]
    documents: bytes
    stats: dict


def chunk_tokens(tokens: np.ndarray, chunk_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(n,) token ids → ((c, chunk_len) padded chunks, (c,) real lengths), c = ceil(n / chunk_len)."""
    n = len(tokens)
    c = -(-n // chunk_len)
    padded = np.full(c * chunk_len, pad_id, dtype=np.int32)
    padded[:n] = tokens
    lengths = np.full(c, chunk_len, dtype=np.int32)
    lengths[-1] = n - (c - 1) * chunk_len
    return padded.reshape(c, chunk_len), lengths


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def tokenize_block(index: int, first_doc: int, docs: list[tuple[str, str]], encoding, chunk_len: int,
                   seed: int, validation_fraction: float) -> Block:
    """Tokenize and chunk one block of (source_id, text) documents numbered from `first_doc`."""
    eot = encoding.eot_token
    token_lists = encoding.encode_ordinary_batch([text for _, text in docs], num_threads=1)
    per_split = {s: ([], [], []) for s in SPLITS}  # doc_index, chunks, lengths
    doc_rows = {name: [] for name in DOC_SCHEMA.names}
    for i, ((source_id, text), ids) in enumerate(zip(docs, token_lists)):
        doc_index = first_doc + i
        split = split_of(source_id, seed, validation_fraction)
        tokens = np.asarray(ids + [eot], dtype=np.int32)
        chunks, lengths = chunk_tokens(tokens, chunk_len, pad_id=eot)
        doc_idx, chunk_list, length_list = per_split[split]
        doc_idx.append(np.full(len(chunks), doc_index, dtype=np.int64))
        chunk_list.append(chunks)
        length_list.append(lengths)
        for name, value in zip(DOC_SCHEMA.names, (doc_index, source_id, split, len(tokens), len(chunks),
                                                  len(text.encode("utf-8")), text_hash(text))):
            doc_rows[name].append(value)

    schema = chunk_schema(chunk_len)
    shards, stats = {}, {"documents": {}, "chunks": {}, "tokens": {}, "bytes": {}}
    for split, (doc_idx, chunk_list, length_list) in per_split.items():
        chunks = np.concatenate(chunk_list) if chunk_list else np.zeros((0, chunk_len), np.int32)
        flat = pa.array(chunks.reshape(-1), type=pa.int32())
        table = pa.table([
            pa.array(np.concatenate(doc_idx) if doc_idx else np.zeros(0, np.int64)),
            pa.FixedSizeListArray.from_arrays(flat, chunk_len),
            pa.array(np.concatenate(length_list) if length_list else np.zeros(0, np.int32)),
        ], schema=schema)
        shards[split] = _ipc_bytes(table)
        in_split = [j for j, s in enumerate(doc_rows["split"]) if s == split]
        stats["documents"][split] = len(in_split)
        stats["chunks"][split] = len(chunks)
        stats["tokens"][split] = int(sum(doc_rows["num_tokens"][j] for j in in_split))
        stats["bytes"][split] = int(sum(doc_rows["num_bytes"][j] for j in in_split))
    documents = _ipc_bytes(pa.table(doc_rows, schema=DOC_SCHEMA))
    return Block(index, shards, documents, stats)
