"""retrieval.method: BM25 and hybrid (RRF) retrieval beside dense, through the same build and exclusions.

Real bm25s and FAISS on the handcrafted 8-token-chunk corpora of tests/corpora.py: a BM25 build
embeds nothing and takes well under a second; the hybrid test reuses the session's dense build
(`built`), so it embeds nothing either.
"""

import json
import shutil

import numpy as np
import pytest

from retropipe.data.config import DataConfig
from retropipe.data.database_reader import Database
from retropipe.data.errors import ConfigError
from retropipe.data.stage import read_json, serial_executor
from retropipe.data.store import ChunkStore
from retropipe.retrieval.build_database import build_retrieval
from retropipe.retrieval.heldout import split_neighbours
from retropipe.retrieval.methods.bm25 import Bm25Search, store_texts, top_ids
from retropipe.retrieval.methods.hybrid import rrf
from retropipe.retrieval.query import Retriever
from tests.corpora import CHUNK_LEN, SEQ_CHUNKS, TOPICS, make_store, neighbours_of, retrieval_cfg, topic_docs
from tests.retrieval.test_retrieval import Interrupt, run_cli

RARE = "the zeppelin pilot spread quince marmalade on a kumquat"


def write_corpus(path, texts):
    path.write_text("".join(json.dumps({"id": f"x{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return str(path)


@pytest.fixture(scope="module")
def bm25_built(tmp_path_factory):
    """A topic store plus one document of rare words, and a further corpus holding an exact copy of
    every validation document (a leak, never to be served) and a near copy of each (allowed), built
    with retrieval.method bm25."""
    root = tmp_path_factory.mktemp("bm25")
    store = make_store(root, topic_docs() + [("train", RARE)])
    val_texts = [TOPICS[i % len(TOPICS)] for i in range(3)]          # topic_docs' validation documents
    extra = write_corpus(root / "extra.jsonl", val_texts + [t.replace(" the ", " a ") + " again" for t in val_texts])
    result = build_retrieval(retrieval_cfg(method="bm25", corpora=[extra]), store, root / "retrieval", SEQ_CHUNKS,
                             data_cfg=DataConfig(chunk_len=CHUNK_LEN))
    return root, store, result, extra


def check_no_leak(root, store):
    """No neighbour of a training chunk from a document of its training sequence, none of a
    validation chunk from a document with its own text (compared by text hash, as the build does)."""
    db = Database(root / "retrieval")
    nbrs = neighbours_of(root)
    train_hash, val_hash = store.text_hashes("train"), store.text_hashes("validation")
    for q, row in enumerate(nbrs["train"]):
        seq = set(train_hash[(q // SEQ_CHUNKS) * SEQ_CHUNKS:][:SEQ_CHUNKS].tolist())
        assert all(n < 0 or int(db.text_hashes[n]) not in seq for n in row), (q, row)
    for u, row in enumerate(nbrs["validation"]):
        assert all(n < 0 or db.text_hashes[n] != val_hash[u] for n in row), (u, row)
    return db, nbrs


def test_bm25_ranks_the_chunk_sharing_rare_words_first(bm25_built):
    root, store, _, _ = bm25_built
    retriever = Retriever(root / "retrieval", retrieval_cfg())       # the config says dense; the database bm25
    assert retriever.method == "bm25" and retriever.index_manifest is None
    ids = retriever.neighbour_ids(["a zeppelin pilot and his quince", "one kumquat"], k=2)
    texts = store_texts(store, "train", 0, len(store.split("train")))  # part 0: database id = chunk id
    assert texts[ids[0, 0]] == "the zeppelin pilot spread quince mar"  # the only chunk holding those words
    assert texts[ids[1, 0]] == "malade on a kumquat"
    assert top_ids(np.array([0.0, 2.0, 0.5, 2.0, 0.0], np.float32), 4).tolist() == [1, 3, 2, -1]  # no word shared: none


def test_bm25_excludes_the_own_sequence_and_exact_copies(bm25_built):
    root, store, result, _ = bm25_built
    db, nbrs = check_no_leak(root, store)
    # The rules fired: unfiltered, many training chunks' best BM25 match is of their own training
    # sequence (often themselves: part 0 is the training split) ...
    search = Bm25Search(root / "retrieval" / "bm25", store, fetch=5)
    raw = search.of_texts(store_texts(store, "train", 0, len(store.split("train"))))[:, 0]
    train_hash = store.text_hashes("train")
    own = [int(db.text_hashes[raw[q]]) in set(train_hash[(q // SEQ_CHUNKS) * SEQ_CHUNKS:][:SEQ_CHUNKS].tolist())
           for q in range(len(raw))]
    assert sum(own) >= 10
    # ... and some validation chunk's best match has its own document's text (an exact copy).
    raw_val = search.of_texts(store_texts(store, "validation", 0, len(store.split("validation"))))[:, 0]
    assert (db.text_hashes[raw_val] == store.text_hashes("validation")).any()
    assert (nbrs["validation"] >= db.parts[1].offset).any()         # the near copies in the corpus are found
    assert result["neighbours"]["splits"]["validation"]["documents_with_copies_in_database"] == 3


def test_bm25_build_records_its_method_embeds_nothing_and_a_rerun_skips(bm25_built, built):
    root, store, result, extra = bm25_built
    out = root / "retrieval"
    assert not (out / "embeddings").exists() and not (out / "index").exists()   # no embedder, no FAISS
    database = read_json(out / "database.json")
    assert database["method"] == "bm25" and database["embedder"] is None
    manifest = read_json(out / "neighbours" / "manifest.json")
    assert manifest["method"] == "bm25" and manifest["inputs"]["bm25_fingerprint"] == result["bm25"]["fingerprint"]
    assert "index_fingerprint" not in manifest["inputs"]
    again = build_retrieval(retrieval_cfg(method="bm25", corpora=[extra]), store, out, SEQ_CHUNKS,
                            data_cfg=DataConfig(chunk_len=CHUNK_LEN))
    assert again["bm25"].get("skipped") and again["neighbours"].get("skipped")


def test_the_same_database_as_dense_or_bm25_has_other_fingerprints(tmp_path, built):
    shutil.copytree(built[0] / "data", tmp_path / "data")
    shutil.copytree(built[0] / "retrieval", tmp_path / "retrieval")
    store = ChunkStore(tmp_path / "data")
    bm25 = build_retrieval(retrieval_cfg(method="bm25"), store, tmp_path / "retrieval", SEQ_CHUNKS)
    assert bm25["database"]["fingerprint"] != built[2]["database"]["fingerprint"]
    assert not bm25["neighbours"].get("skipped")
    assert bm25["neighbours"]["fingerprint"] != built[2]["neighbours"]["fingerprint"]


def test_bm25_queries_resume_per_shard_to_the_same_neighbours(tmp_path, bm25_built):
    store = make_store(tmp_path, topic_docs())
    shards = sum(n > 0 for split in ("train", "validation") for n in store.manifest["shard_chunks"][split])
    assert shards >= 4
    ran = []

    def dies_after_one(fn, jobs, n):
        for i, args in enumerate(jobs):
            if i == 1:
                raise Interrupt()
            yield fn(*args)

    def counting(fn, jobs, n):
        jobs = list(jobs)
        ran.append(len(jobs))
        yield from serial_executor(fn, jobs, n)

    with pytest.raises(Interrupt):
        build_retrieval(retrieval_cfg(method="bm25"), store, tmp_path / "retrieval", SEQ_CHUNKS, executor=dies_after_one)
    assert (tmp_path / "retrieval" / "neighbours" / "parts" / "train" / "shard-00000.npy").exists()
    result = build_retrieval(retrieval_cfg(method="bm25"), store, tmp_path / "retrieval", SEQ_CHUNKS, executor=counting)
    assert result["bm25"].get("skipped") and sum(ran) == shards - 1   # the finished shard is not queried again
    fresh = tmp_path / "fresh"
    shutil.copytree(tmp_path / "data", fresh / "data")
    build_retrieval(retrieval_cfg(method="bm25"), ChunkStore(fresh / "data"), fresh / "retrieval", SEQ_CHUNKS)
    for split, ids in neighbours_of(tmp_path).items():
        np.testing.assert_array_equal(ids, neighbours_of(fresh)[split])


def test_evaluation_searches_a_database_by_its_own_method_and_subset(bm25_built, tmp_path):
    root, store, _, _ = bm25_built
    retriever = Retriever(root / "retrieval", retrieval_cfg())       # dense config, bm25 database
    whole = split_neighbours(retriever, store, "validation", tmp_path / "whole", retrieval_cfg())
    assert read_json(tmp_path / "whole" / "manifest.json")["method"] == "bm25"
    assert not (tmp_path / "embeddings").exists()                   # nothing embedded for BM25
    np.testing.assert_array_equal(np.load(tmp_path / "whole" / "validation.npy"), neighbours_of(root)["validation"])
    allowed = np.arange(retriever.database.parts[1].offset, dtype=np.int64)   # the training split only
    subset = split_neighbours(retriever, store, "validation", tmp_path / "subset", retrieval_cfg(), allowed=allowed)
    ids = np.load(tmp_path / "subset" / "validation.npy")
    assert ((ids < len(allowed)) & (ids >= -1)).all() and (ids >= 0).any()
    assert (whole.neighbour_ids("validation", np.arange(len(ids))) >= len(allowed)).any()  # the subset mattered
    assert subset.neighbour_ids("validation", np.arange(len(ids))).shape == ids.shape


def test_rrf_fuses_by_summed_reciprocal_rank():
    # 1 and 3 are in both lists (1/61 + 1/63 each), 2 and 4 in one (1/62): ties go to the id read
    # first, rank by rank, the dense list first.
    fused = rrf(np.array([[1, 2, 3, -1]]), np.array([[3, 4, 1, -1]]))
    assert fused.tolist() == [[1, 3, 2, 4, -1, -1, -1, -1]]
    # An id second in both lists (2/62) beats the top of one (1/61); lists of unequal length.
    assert rrf(np.array([[5, 6]]), np.array([[7, 6, 8]])).tolist() == [[6, 5, 7, 8, -1, -1]]


def test_hybrid_fuses_both_lists_and_keeps_the_no_leak_rules(tmp_path, bm25_built):
    """The same database built dense, bm25, hybrid in turn (two candidates each): a hybrid result
    holds the top of both lists, and every chunk keeps as many neighbours as the better method."""
    root, _, _, extra = bm25_built
    shutil.copytree(root / "data", tmp_path / "data")
    shutil.copytree(root / "retrieval", tmp_path / "retrieval")
    store = ChunkStore(tmp_path / "data")
    # "fruit trees": dense finds the orchard's apples and pears, BM25 the compilers' syntax trees.
    queries = ["fruit trees", "bakers knead dough", "a zeppelin sails across stormy ocean waves"]
    ids, kept, result = {}, {}, None
    for method in ("dense", "bm25", "hybrid"):
        cfg = retrieval_cfg(method=method, k=2, candidates=2, corpora=[extra])
        result = build_retrieval(cfg, store, tmp_path / "retrieval", SEQ_CHUNKS, data_cfg=DataConfig(chunk_len=CHUNK_LEN))
        ids[method] = Retriever(tmp_path / "retrieval", retrieval_cfg(k=2, candidates=2)).neighbour_ids(queries, k=2)
        kept[method] = {split: (nbrs >= 0).sum(1) for split, nbrs in neighbours_of(tmp_path).items()}
    assert result["bm25"].get("skipped") and result["index"].get("skipped")  # hybrid reuses both indexes
    assert result["neighbours"]["method"] == "hybrid" and result["neighbours"]["inputs"]["fusion"] == "rrf-60"
    check_no_leak(tmp_path, store)
    assert ids["dense"][0, 0] != ids["bm25"][0, 0]                          # the methods disagree ...
    for dense, bm25, hybrid in zip(ids["dense"], ids["bm25"], ids["hybrid"]):
        assert {dense[0], bm25[0]} - {-1} <= set(hybrid.tolist())          # ... and hybrid keeps both tops
    for split in ("train", "validation"):                                    # the fused list loses no survivor
        assert (kept["hybrid"][split] >= np.maximum(kept["dense"][split], kept["bm25"][split])).all()


def test_a_bad_method_names_the_key(tmp_path, built, capsys):
    with pytest.raises(ConfigError, match="'retrieval.method'.*'tfidf'"):
        retrieval_cfg(method="tfidf")
    shutil.copytree(built[0] / "data", tmp_path / "data")
    code, err = run_cli(tmp_path, "retrieval.method=sparse", capsys=capsys)
    assert code == 2 and "'retrieval.method'" in err and "'dense', 'bm25', 'hybrid'" in err, err
    assert not (tmp_path / "retrieval").exists()
