"""Exact copies among a database's chunks: found, embedded once, their vectors copied, whatever the order
jobs come back in and across a resume. The real bundled BERT embeds (tests/corpora.py's 8-token stores)."""

import dataclasses
import shutil

import numpy as np
import pytest

from retropipe.data.chunking import SPLITS
from retropipe.data.store import ChunkStore
from retropipe.retrieval import copies as copies_module
from retropipe.retrieval.copies import ShardAssembly, find_copies
from retropipe.retrieval.embed_job import Embeddings, embed, embed_store, plan_jobs, serial_embed_runner
from tests.corpora import make_store, topic_docs


class Interrupt(Exception):
    pass


def chunk_rows(store: ChunkStore) -> list[tuple[tuple[int, int, int], tuple]]:
    """((0, split index, id), the chunk's real tokens) for every chunk, in the database's order."""
    out = []
    for s, split in enumerate(SPLITS):
        chunks = store.split(split)
        for i in range(len(chunks)):
            out.append(((0, s, i), tuple(chunks.tokens([i])[0, :chunks.lengths[i]].tolist())))
    return out


def copies_as_dict(found) -> dict:
    return {(p, SPLITS.index(split), int(i)): tuple(int(x) for x in src)
            for (p, split), ids in found.ids.items() for i, src in zip(ids, found.sources[(p, split)])}


def test_each_repeated_chunk_copies_its_first_occurrence(tmp_path):
    store = make_store(tmp_path, topic_docs())
    first, expected = {}, {}
    for key, tokens in chunk_rows(store):
        if tokens in first:
            expected[key] = first[tokens]
        else:
            first[tokens] = key
    assert len(expected) >= 10   # the topic corpus repeats its sentences: there is something to find
    assert copies_as_dict(find_copies([store])) == expected


def test_a_hash_collision_copies_nothing_wrong(tmp_path, monkeypatch):
    """Every chunk hashed alike: only chunks whose tokens equal the very first chunk's are copies."""
    store = make_store(tmp_path, topic_docs())
    monkeypatch.setattr(copies_module, "chunk_keys", lambda split, width: np.zeros(len(split), np.uint64))
    rows = chunk_rows(store)
    expected = {key: rows[0][0] for key, tokens in rows[1:] if tokens == rows[0][1]}
    assert copies_as_dict(find_copies([store])) == expected


def embedded_rows(out_dir, manifest) -> dict:
    emb = Embeddings(out_dir, manifest)
    return {split: emb.rows(split, np.arange(emb.count(split))) for split in SPLITS}


def test_copies_are_not_embedded_and_take_their_sources_vectors(tmp_path):
    store = make_store(tmp_path, topic_docs())
    found = find_copies([store])
    fed = []

    def counting(spec, jobs):
        fed.extend(j.stop - j.start - len(j.skip) for j in jobs)
        yield from serial_embed_runner(spec, jobs)

    manifest = embed_store(store, tmp_path / "emb", "", 8, counting)
    total = sum(len(store.split(s)) for s in SPLITS)
    assert sum(fed) == total - len(found) and len(found) > 0
    assert manifest["run"]["chunks_embedded"] == total - len(found) and manifest["run"]["chunks_copied"] == len(found)
    rows = embedded_rows(tmp_path / "emb", manifest)
    for (p, s, i), (_, src_s, src_i) in copies_as_dict(found).items():
        np.testing.assert_array_equal(rows[SPLITS[s]][i], rows[SPLITS[src_s]][src_i])
    # A copy's vector is its own text's: the same text embedded alone.
    from retropipe.data.tokenizer import get_tokenizer
    from retropipe.retrieval.embed_job import cached_embedder, chunk_texts, resolve_model_path
    (_, s, i) = next(iter(copies_as_dict(found)))
    chunks = store.split(SPLITS[s])
    text = chunk_texts(chunks.tokens([i]), chunks.lengths[[i]], get_tokenizer(store.manifest["tokenizer"]),
                       store.eot_id)
    alone = embed(cached_embedder(str(resolve_model_path(""))), text)[0]
    assert float(alone @ rows[SPLITS[s]][i]) > 0.999


@pytest.mark.parametrize("order", ["reversed", "killed then resumed"])
def test_shards_wait_for_their_sources_and_resume_to_the_same_bytes(tmp_path, order):
    """Jobs returned last to first (a copy's source arrives after its shard's own jobs), or a pass
    killed midway and resumed (sources then read from shards on disk): the bytes of one pass in order."""
    (tmp_path / "ref").mkdir()
    ref_store = make_store(tmp_path / "ref", topic_docs())
    ref = embed_store(ref_store, tmp_path / "ref" / "emb", "", 4, serial_embed_runner)
    shutil.copytree(tmp_path / "ref" / "data", tmp_path / "data")
    store, out = ChunkStore(tmp_path / "data"), tmp_path / "emb"

    def reversed_runner(spec, jobs):
        yield from reversed(list(serial_embed_runner(spec, jobs)))

    def dies_midway(spec, jobs):
        for n, item in enumerate(serial_embed_runner(spec, jobs)):
            if n == len(jobs) // 2:
                raise Interrupt()
            yield item

    if order == "reversed":
        manifest = embed_store(store, out, "", 4, reversed_runner)
    else:
        with pytest.raises(Interrupt):
            embed_store(store, out, "", 4, dies_midway)
        written = sorted(out.rglob("*.npy"))
        assert written and not (out / "manifest.json").exists()
        manifest = embed_store(store, out, "", 4, serial_embed_runner)
        assert 0 < manifest["run"]["chunks_embedded"] + manifest["run"]["chunks_copied"] < ref["run"]["chunks_embedded"] \
            + ref["run"]["chunks_copied"]    # the rerun wrote only what was missing
    assert manifest["sha256"] == ref["sha256"]


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_a_source_vector_is_held_only_until_its_last_copy_is_written(tmp_path, monkeypatch, order):
    """ShardAssembly on its own, with stand-in vectors: every shard written with its copies filled in,
    and no source's vector left in memory at the end of the pass. A shard that waits for a source
    looks each of its copies up once, not again on every job that arrives while it waits."""
    store = make_store(tmp_path, topic_docs())
    found = find_copies([store])
    jobs, pending = [], {}
    for split in SPLITS:
        for shard in range(len(store.manifest["shards"][split])):
            shard_jobs = [dataclasses.replace(j, skip=tuple(found.in_range(0, split, j.start, j.stop).tolist()))
                          for j in plan_jobs(store, split, shard, 4)]
            jobs += shard_jobs
            if shard_jobs:   # a shard without chunks is written empty, apart (embed_stores)
                pending[(0, split, shard)] = len(shard_jobs)
    shards = ShardAssembly([store], lambda p, split, i: tmp_path / f"{split}-{i}.npy", pending, found, jobs)
    lookups, misses = [0], [0]
    source = ShardAssembly._source

    def counted(self, *args):
        lookups[0] += 1
        vector = source(self, *args)
        misses[0] += vector is None
        return vector

    monkeypatch.setattr(ShardAssembly, "_source", counted)
    for job in (jobs if order == "in order" else jobs[::-1]):
        # each chunk's stand-in vector: its id, in every column; copies' rows left zero
        vectors = np.repeat(np.arange(job.start, job.stop, dtype=np.float16)[:, None], 3, 1)
        vectors[np.asarray(job.skip, np.int64) - job.start] = 0
        shards.add(job, vectors)
        assert len(shards.known) <= sum(shards.uses.values())
    assert not shards.unwritten and not shards.known
    assert lookups[0] - misses[0] == len(found) and (order == "in order") == (misses[0] == 0)
    offsets = {s: np.cumsum([0] + store.manifest["shard_chunks"][s]) for s in SPLITS}
    for (p, split, i), (_, src_split, src) in copies_as_dict(found).items():
        shard = np.searchsorted(offsets[SPLITS[split]], i, side="right") - 1
        row = np.load(tmp_path / f"{SPLITS[split]}-{shard}.npy")[i - offsets[SPLITS[split]][shard]]
        assert (row == src).all()
