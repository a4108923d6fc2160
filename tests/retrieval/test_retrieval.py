"""Retrieval database: FAISS index, leak-free neighbours, resume, bad input, further corpora.

Real components throughout (sentence-transformers, FAISS); the stores are handcrafted corpora with
8-token chunks (tests/corpora.py), so embedding them takes a second or two. The embedder itself is
tested in test_embedder.py, Ray in test_retrieval_ray.py, reading the neighbours in
tests/data/test_reading.py.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from retropipe.data.stage import fingerprint, read_json, save_npy, write_json
from retropipe.data.store import ChunkStore
from retropipe.data.chunking import SPLITS
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.build_database import build_retrieval
from retropipe.retrieval.copies import find_copies
from retropipe.retrieval.database_parts import DatabaseVectors
from retropipe.retrieval.embed_job import Embeddings, serial_embed_runner
from retropipe.retrieval.index import add_groups, build_index, exact_search, load_index, make_index, sample_rows
from retropipe.retrieval.neighbour_search import excluded_hashes, select_neighbours
from tests.corpora import CHUNK_LEN, ROOT, SEQ_CHUNKS, TOPICS, make_store, neighbours_of, retrieval_cfg

# --- neighbour selection -----------------------------------------------------------------

def test_select_neighbours_excludes_documents_and_pads():
    db_hash = np.array([10, 10, 11, 11, 12, 13], dtype=np.uint64)  # document text hash of each database chunk
    db_pos = np.array([0, 1, 0, 1, 0, 0])
    cand = np.array([[0, 2, 4, 5], [1, 0, -1, -1], [5, 3, 2, 4]])
    excluded = np.array([[10, 0], [10, 0], [11, 13]], dtype=np.uint64)
    assert select_neighbours(cand, db_hash, db_pos, excluded, k=2).tolist() == [[2, 4], [-1, -1], [4, -1]]
    assert select_neighbours(cand[:, :1], db_hash, db_pos, excluded, k=3).tolist() == [[-1] * 3, [-1] * 3, [-1] * 3]


def test_select_neighbours_keeps_one_copy_of_identical_chunks():
    # Chunks 0 and 2 are the first chunk of two documents with the same text: the second is dropped.
    db_hash = np.array([7, 7, 7, 9], dtype=np.uint64)
    db_pos = np.array([0, 1, 0, 0])
    out = select_neighbours(np.array([[0, 2, 1, 3]]), db_hash, db_pos, np.zeros((1, 1), np.uint64), k=3)
    assert out.tolist() == [[0, 1, 3]]


def test_excluded_hashes_cover_the_whole_sequence():
    hashes = np.array([7, 7, 8, 9, 9, 9, 10], dtype=np.uint64)  # 7 chunks, sequences of 3: [0,1,2] [3,4,5] [6]
    assert excluded_hashes(hashes, np.array([1, 4, 6]), 3).tolist() == [[7, 7, 8], [9, 9, 9], [10, 0, 0]]
    assert excluded_hashes(hashes, np.array([1, 4]), None).tolist() == [[7], [9]]


def test_embedding_rows_come_back_in_the_order_asked_across_shards(tmp_path):
    # Unsorted, repeated ids over shards of other sizes (one empty): each row its own chunk's vector.
    sizes, vectors = [5, 0, 7, 3], np.random.default_rng(0).standard_normal((15, 4)).astype(np.float16)
    (tmp_path / "train").mkdir()
    for i, (start, n) in enumerate(zip(np.cumsum([0] + sizes), sizes)):
        save_npy(tmp_path / "train" / f"shard-{i:05d}.npy", vectors[start:start + n])
    emb = Embeddings(tmp_path, {"dim": 4, "fingerprint": "f", "shard_chunks": {"train": sizes},
                                "shards": {"train": [f"shard-{i:05d}.npy" for i in range(4)]}})
    for ids in ([14, 0, 3, 14, 5, 12, 1], [], [11]):
        np.testing.assert_array_equal(emb.rows("train", np.array(ids, np.int64)), vectors[ids].astype(np.float32))


def test_no_neighbour_from_the_same_document_or_sequence(built):
    root, store, result = built
    nbrs = neighbours_of(root)
    train, val = store.split("train"), store.split("validation")
    assert nbrs["train"].shape == (len(train), 2) and nbrs["validation"].shape == (len(val), 2)
    for q in range(len(train)):
        seq_docs = set(train.doc_index[train.sequence_chunk_ids(q // SEQ_CHUNKS, SEQ_CHUNKS).clip(max=len(train) - 1)])
        for n in nbrs["train"][q]:
            assert n == -1 or train.doc_index[n] not in seq_docs
    assert (nbrs["validation"] >= 0).all()  # the database holds only training documents: nothing excluded
    # The rule must have fired: for some chunks the raw nearest candidate was from their own sequence.
    emb = Embeddings(root / "retrieval" / "embeddings", result["embeddings"])
    _, raw = exact_search(emb.rows("train", np.arange(len(train))), emb.shards("train"), 3)
    same_seq = [train.doc_index[raw[q, 1]] in set(train.doc_index[(q // SEQ_CHUNKS) * SEQ_CHUNKS:][:SEQ_CHUNKS])
                for q in range(len(train))]
    assert sum(same_seq) >= 3


def test_fewer_allowed_chunks_than_k_are_padded_not_wrapped(tmp_path):
    # Train: doc A (3 chunks) and doc B (1 chunk); chunks_per_seq=1 leaves only the same-doc rule.
    store = make_store(tmp_path, [("train", "one two three four five six seven eight " * 3),
                                  ("train", "alpha beta"), ("validation", "one two three")])
    train = store.split("train")
    assert len(train) >= 4 and len(set(train.doc_index.tolist())) == 2
    build_retrieval(retrieval_cfg(k=2, candidates=10), store, tmp_path / "retrieval", chunks_per_seq=1)
    nbrs = neighbours_of(tmp_path)["train"]
    doc_b = train.doc_index[-1]
    b_chunk = int(np.flatnonzero(train.doc_index == doc_b)[0])
    for q in np.flatnonzero(train.doc_index != doc_b):
        assert nbrs[q].tolist() == [b_chunk, -1]
    manifest = read_json(tmp_path / "retrieval" / "neighbours" / "manifest.json")
    assert manifest["splits"]["train"]["missing"] == (train.doc_index != doc_b).sum()


# --- index -------------------------------------------------------------------------------

def fake_embeddings(root: Path, shard_sizes: list[int], dim: int = 32, seed: int = 0) -> DatabaseVectors:
    """An embeddings directory of clustered unit vectors in real files, as a one-part database (index tests)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((16, dim))
    (root / "train").mkdir(parents=True)
    (root / "validation").mkdir()
    names = []
    for i, n in enumerate(shard_sizes):
        x = centres[rng.integers(0, 16, n)] + 0.3 * rng.standard_normal((n, dim))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        names.append(f"shard-{i:05d}.npy")
        save_npy(root / "train" / names[-1], x.astype(np.float16))
        save_npy(root / "validation" / names[-1], np.zeros((0, dim), np.float16))
    manifest = {"dim": dim, "shards": {"train": names, "validation": names},
                "shard_chunks": {"train": shard_sizes, "validation": [0] * len(names)},
                "fingerprint": fingerprint(shard_sizes)}
    write_json(root / "manifest.json", manifest)
    return DatabaseVectors([(0, Embeddings(root, manifest))])


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "IVF8,PQ4"])
def test_sharded_merged_index_equals_single_pass(tmp_path, factory):
    emb = fake_embeddings(tmp_path / "emb", [700, 0, 500, 800])
    manifest = build_index(emb, tmp_path / "index", factory, train_sample=1500, seed=3)
    merged = load_index(tmp_path / "index", manifest, emb.dim, nprobe=4, ef_search=16)
    single = make_index(factory, emb.dim)
    if not single.is_trained:
        single.train(sample_rows(emb, 1500, 3))
    everything = np.concatenate([x for _, x in emb.shards()])
    if manifest["merge"] == "ivf":
        single.add_with_ids(everything, np.arange(len(everything)))
        single.nprobe = 4
        assert (tmp_path / "index" / "index.ivfdata").exists()  # on-disk inverted lists
    else:
        single.add(everything)
    queries = everything[::37]
    d1, i1 = merged.search(queries, 5)
    d2, i2 = single.search(queries, 5)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(d1, d2, rtol=1e-5, atol=1e-6)
    assert manifest["ntotal"] == 2000 and not list((tmp_path / "index" / "shards").iterdir())


def test_add_tasks_take_consecutive_shards_of_at_least_64_vectors_a_list():
    sources = [(0, "a", 700), (700, "b", 0), (700, "c", 500), (1200, "d", 800)]
    assert [[s[1] for s in g] for g in add_groups(sources, 8)] == [["a"], ["b", "c", "d"]]   # 8 lists: 512 vectors
    assert [[s[1] for s in g] for g in add_groups(sources, 0)] == [["a"], ["b"], ["c"], ["d"]]  # no lists


def test_ivf_index_survives_moving_the_workdir(tmp_path):
    emb = fake_embeddings(tmp_path / "emb", [600, 600])
    manifest = build_index(emb, tmp_path / "index", "IVF8,Flat", train_sample=0, seed=1)
    shutil.move(tmp_path / "index", tmp_path / "moved")
    index = load_index(tmp_path / "moved", manifest, emb.dim, nprobe=8, ef_search=16)
    _, ids = index.search(emb.rows(np.arange(5)), 1)
    assert ids[:, 0].tolist() == list(range(5))


# --- resume ------------------------------------------------------------------------------

class Interrupt(Exception):
    pass


def test_interrupted_stages_resume_to_identical_neighbours(built, tmp_path):
    ref_root, ref_store, ref = built
    root = tmp_path
    shutil.copytree(ref_root / "data", root / "data")
    store = ChunkStore(root / "data")
    cfg = retrieval_cfg()

    def dies_midway(spec, jobs):  # the embedding stage killed after a few jobs
        for n, item in enumerate(serial_embed_runner(spec, jobs)):
            if n == 3:
                raise Interrupt()
            yield item

    with pytest.raises(Interrupt):
        build_retrieval(cfg, store, root / "retrieval", SEQ_CHUNKS, embed_runner=dies_midway)
    assert not (root / "retrieval" / "embeddings" / "manifest.json").exists()

    def add_dies(fn, jobs, n):  # the index stage killed after one shard was added
        for i, args in enumerate(jobs):
            if i == 1:
                raise Interrupt()
            yield fn(*args)

    with pytest.raises(Interrupt):
        build_retrieval(cfg, store, root / "retrieval", SEQ_CHUNKS, executor=add_dies)
    assert read_json(root / "retrieval" / "embeddings" / "manifest.json") is not None
    assert not (root / "retrieval" / "index" / "manifest.json").exists()

    result = build_retrieval(cfg, store, root / "retrieval", SEQ_CHUNKS)
    assert result["embeddings"]["sha256"] == ref["embeddings"]["sha256"]
    for split, arr in neighbours_of(root).items():
        np.testing.assert_array_equal(arr, neighbours_of(ref_root)[split])

    # The last stage's output lost: only it is redone, to the same bytes.
    (root / "retrieval" / "neighbours" / "manifest.json").unlink()
    (root / "retrieval" / "neighbours" / "train.npy").unlink()
    again = build_retrieval(cfg, store, root / "retrieval", SEQ_CHUNKS)
    assert again["embeddings"].get("skipped") and again["index"].get("skipped")
    assert not again["neighbours"].get("skipped")
    assert again["neighbours"]["splits"] == ref["neighbours"]["splits"]

    # Other inputs (a new k) rebuild the neighbours only; the same inputs skip everything.
    other = build_retrieval(retrieval_cfg(k=1), store, root / "retrieval", SEQ_CHUNKS)
    assert other["index"].get("skipped") and other["neighbours"]["k"] == 1
    assert build_retrieval(retrieval_cfg(k=1), store, root / "retrieval", SEQ_CHUNKS)["neighbours"].get("skipped")


# --- bad input: clear errors, exit code 2 --------------------------------------------------

def run_cli(workdir: Path, *sets: str, capsys=None) -> tuple[int, str]:
    from retropipe.launch.build_index import main

    args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--no-progress", "--set", f"workdir={workdir}",
            "--set", f"data.chunk_len={CHUNK_LEN}", "--set", "train.seq_len=32"]
    for s in sets:
        args += ["--set", s]
    code = main(args)
    return code, capsys.readouterr().err if capsys else ""


def test_missing_or_corrupt_chunk_store_is_exit_2(tmp_path, built, capsys):
    code, err = run_cli(tmp_path / "empty", capsys=capsys)
    assert code == 2 and "manifest.json" in err and "prepare_data" in err
    shutil.copytree(built[0] / "data", tmp_path / "w" / "data")
    shard = tmp_path / "w" / "data" / "train" / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:100])
    code, err = run_cli(tmp_path / "w", capsys=capsys)
    assert code == 2 and "shard-00000.arrow" in err


@pytest.mark.parametrize("setting, key", [("retrieval.index=IVF4,PQ7", "retrieval.index"),
                                          ("retrieval.index=NotAnIndex9", "retrieval.index"),
                                          ("retrieval.k=100000 retrieval.candidates=100000", "retrieval.k")])
def test_bad_settings_are_exit_2_naming_the_key(tmp_path, built, capsys, setting, key):
    shutil.copytree(built[0] / "data", tmp_path / "data")
    code, err = run_cli(tmp_path, *setting.split(), capsys=capsys)
    assert code == 2 and f"'{key}'" in err, err
    assert not (tmp_path / "retrieval" / "embeddings" / "manifest.json").exists()  # failed before any work


def test_index_dimension_mismatch_is_a_clear_error(tmp_path, built, capsys):
    import faiss

    shutil.copytree(built[0] / "data", tmp_path / "data")
    shutil.copytree(built[0] / "retrieval", tmp_path / "retrieval")
    faiss.write_index(faiss.IndexFlatL2(16), str(tmp_path / "retrieval" / "index" / "index.faissindex"))
    shutil.rmtree(tmp_path / "retrieval" / "neighbours")
    code, err = run_cli(tmp_path, "retrieval.embed_batch_size=8", "retrieval.recall_queries=10",
                        "retrieval.train_sample=0", capsys=capsys)
    assert code == 2 and "index.faissindex" in err and "dimension 16" in err and "384" in err


def test_untrainable_index_names_the_key(tmp_path):
    emb = fake_embeddings(tmp_path / "emb", [50])
    with pytest.raises(RetrievalError, match="retrieval.index.*IVF64"):
        build_index(emb, tmp_path / "index", "IVF64,Flat", train_sample=0, seed=0)


def test_an_index_the_database_cannot_train_is_refused_before_embedding(built):
    from retropipe.retrieval.build_database import check_inputs

    _, store, _ = built
    with pytest.raises(RetrievalError, match="retrieval.index.*IVF1024,Flat.*needs at least 1024"):
        check_inputs(retrieval_cfg(index="IVF1024,Flat"), store, dim=384)
    check_inputs(retrieval_cfg(index="IVF4,Flat"), store, dim=384)  # enough chunks for 4 lists


# --- a database beyond the training split -----------------------------------------------------

def test_further_corpora_join_the_database_and_copies_of_evaluated_documents_stay_out(tmp_path, built):
    from retropipe.data.database_reader import Database

    ref_root, _, ref = built
    shutil.copytree(ref_root / "data", tmp_path / "data")
    shutil.copytree(ref_root / "retrieval", tmp_path / "retrieval")
    store = ChunkStore(tmp_path / "data")
    val_docs = store.documents.filter(np.asarray(store.documents.column("split").to_pylist()) == "validation")
    val_hash = val_docs.column("text_hash").to_numpy()
    # The extra corpus: an exact copy of every validation document (a leak, never to be served) and
    # near-copies of them (one word changed: allowed, and the nearest neighbours there are).
    val_texts = [TOPICS[i % len(TOPICS)] for i in range(3)]
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"id": f"copy{i}", "text": t}) + "\n" for i, t in enumerate(val_texts))
                     + "".join(json.dumps({"id": f"near{i}", "text": t.replace(" the ", " a ").replace(" in ", " on ")})
                               + "\n" for i, t in enumerate(val_texts)))
    from retropipe.data.config import DataConfig as DC
    result = build_retrieval(retrieval_cfg(corpora=[str(extra)]), store, tmp_path / "retrieval", SEQ_CHUNKS,
                             data_cfg=DC(chunk_len=CHUNK_LEN))
    assert result["embeddings"].get("skipped")  # the training data's embeddings were reused
    assert not result["index"].get("skipped")   # the index covers the new part
    db = Database(tmp_path / "retrieval")
    n0 = len(store.split("train"))
    assert [p.name for p in db.parts][0] == "train" and db.parts[1].offset == n0 and len(db) > n0
    nbrs = np.load(tmp_path / "retrieval" / "neighbours" / "validation.npy", allow_pickle=False)
    val = store.split("validation")
    for u in range(len(val)):
        own = store.text_hashes("validation")[u]
        for n in nbrs[u]:
            assert n < 0 or db.text_hashes[n] != own  # never the copy of its own document
    assert (nbrs >= n0).any()  # the near-copies in the new part are found
    manifest = read_json(tmp_path / "retrieval" / "neighbours" / "manifest.json")
    copies = np.isin(val_hash, db.document_hashes)
    assert manifest["splits"]["validation"]["documents_with_copies_in_database"] == copies.sum() > 0
    # Tokens of a database id in part 1 are that part's chunk (+ continuation).
    tokens = db.neighbour_tokens(np.array([n0]))
    part = db.parts[1].split
    np.testing.assert_array_equal(tokens[0, :part.lengths[0]], part.tokens([0])[0, :part.lengths[0]])


def test_every_part_of_the_database_is_embedded_in_one_pass(tmp_path, built):
    """One call of the runner (one pool of Ray actors, each loading the model once) embeds the
    training data and every further corpus; killed midway, the rerun embeds only what is missing;
    the training part's bytes are what a pass of its own gives, and the corpus's copies of its chunks
    take their vectors, read back from the killed pass's shards."""
    from retropipe.data.config import DataConfig

    ref_root, _, ref = built
    shutil.copytree(ref_root / "data", tmp_path / "data")
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"id": f"x{i}", "text": t.replace(" the ", " a ")}) + "\n"
                             for i, t in enumerate(TOPICS)))
    calls = []

    def counting(spec, jobs):
        calls.append(sorted({job.part for job in jobs}))
        yield from serial_embed_runner(spec, jobs)

    def dies_in_part_1(spec, jobs):  # killed once part 0 is done and part 1 has begun
        jobs = sorted(jobs, key=lambda j: j.part)
        for n, item in enumerate(serial_embed_runner(spec, jobs)):
            if jobs[n].part == 1 and jobs[n - 1].part == 1:
                raise Interrupt()
            yield item

    with pytest.raises(Interrupt):
        build_retrieval(retrieval_cfg(corpora=[str(extra)]), ChunkStore(tmp_path / "data"), tmp_path / "retrieval",
                        SEQ_CHUNKS, data_cfg=DataConfig(chunk_len=CHUNK_LEN), embed_runner=dies_in_part_1)
    assert not (tmp_path / "retrieval" / "embeddings" / "manifest.json").exists()  # finished only at the pass's end
    result = build_retrieval(retrieval_cfg(corpora=[str(extra)]), ChunkStore(tmp_path / "data"), tmp_path / "retrieval",
                             SEQ_CHUNKS, data_cfg=DataConfig(chunk_len=CHUNK_LEN), embed_runner=counting)
    assert calls == [[1]]  # the rerun embeds only what the killed pass had not written: part 1's rest
    assert result["embeddings"]["sha256"] == ref["embeddings"]["sha256"]  # the training part, as alone
    assert len(result["parts"]) == 2 and sum(result["parts"][1]["shard_chunks"]["train"]) > 0
    corpus = result["database"]["parts"][1]
    found = find_copies([ChunkStore(tmp_path / "data"), ChunkStore(corpus["data_absolute"])])
    copies = found.ids[(1, "train")]
    sources = found.sources_of(1, "train", copies)
    assert (sources[:, 0] == 0).any()    # the corpus repeats some training chunks word for word
    vectors = [Embeddings(d, m) for d, m in ((tmp_path / "retrieval" / "embeddings", result["parts"][0]),
                                             (corpus["embeddings_absolute"], result["parts"][1]))]
    for chunk, (part, split, source) in zip(copies.tolist(), sources.tolist()):
        np.testing.assert_array_equal(vectors[1].rows("train", [chunk]), vectors[part].rows(SPLITS[split], [source]))
    again = build_retrieval(retrieval_cfg(corpora=[str(extra)]), ChunkStore(tmp_path / "data"), tmp_path / "retrieval",
                            SEQ_CHUNKS, data_cfg=DataConfig(chunk_len=CHUNK_LEN), embed_runner=counting)
    assert calls[1:] == [[]] and all(p.get("skipped") for p in again["parts"])  # complete: nothing embedded again
