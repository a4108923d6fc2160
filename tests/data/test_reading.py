"""Reading the neighbours (data/neighbour_store.py, data/reading.py): what a chunk of a split is given,
lined up with it or not, filtered, shuffled; on the handcrafted topic corpora of tests/corpora.py and
their real retrieval database (the session's `built` fixture).
"""

import shutil

import numpy as np
import pytest

from retropipe.data.errors import DataError
from retropipe.data.neighbour_store import NeighbourStore
from retropipe.data.reading import ALIGNMENT_RULE, Reading, shuffled_order
from retropipe.data.stage import read_json, save_npy, write_json
from retropipe.retrieval.build_database import build_retrieval
from tests.corpora import CHUNK_LEN, SEQ_CHUNKS, TOPICS, make_store, retrieval_cfg

# --- the reader (data/neighbour_store.py) -------------------------------------------------------

def test_neighbour_store_tokens(built):
    root, store, _ = built
    reader = NeighbourStore.of(root / "retrieval", store, chunks_per_seq=SEQ_CHUNKS)
    train = store.split("train")
    chunk_ids = train.sequence_chunk_ids(np.array([0, 1]), SEQ_CHUNKS)          # (b=2, l=4)
    ids = reader.neighbour_ids("train", chunk_ids)
    tokens = reader.neighbour_tokens("train", chunk_ids)
    assert ids.shape == (2, 4, 2) and tokens.shape == (2, 4, 2, 2 * CHUNK_LEN) and tokens.dtype == np.int64
    cont = train.continuation_ids()
    for b, l, j in np.ndindex(2, 4, 2):
        n = ids[b, l, j]
        assert n >= 0  # without further corpora, database ids are training-split chunk ids
        length = train.lengths[n]
        np.testing.assert_array_equal(tokens[b, l, j, :length], train.tokens([n])[0, :length])
        assert (tokens[b, l, j, length:CHUNK_LEN] == -1).all()  # padding inside the chunk
        c = cont[n]
        if c < 0:  # the neighbour ends its document: no continuation
            assert (tokens[b, l, j, CHUNK_LEN:] == -1).all()
        else:
            np.testing.assert_array_equal(tokens[b, l, j, CHUNK_LEN:CHUNK_LEN + train.lengths[c]],
                                          train.tokens([c])[0, :train.lengths[c]])
    one = reader.neighbour_tokens("validation", np.zeros((1, 1), np.int64), k=1)
    assert one.shape == (1, 1, 1, 2 * CHUNK_LEN)
    with pytest.raises(DataError, match="holds 2 per chunk"):
        reader.neighbour_ids("train", chunk_ids, k=3)


def test_self_neighbour_lessons_put_the_chunk_and_its_continuation_first(built):
    from retropipe.training.run.batches import SequenceBatches
    from retropipe.training.run.lessons import Lessons

    root, store, _ = built
    reader = NeighbourStore.of(root / "retrieval", store, chunks_per_seq=SEQ_CHUNKS)
    train = store.split("train")
    seq = np.arange(train.num_sequences(SEQ_CHUNKS))
    plain = SequenceBatches(store, "train", SEQ_CHUNKS * CHUNK_LEN, reader, k=2).batch(seq)
    taught = SequenceBatches(store, "train", SEQ_CHUNKS * CHUNK_LEN, reader, k=2, lessons=Lessons(copy=0.5), seed=3)
    got = taught.batch(seq)
    chunk_ids = train.sequence_chunk_ids(seq, SEQ_CHUNKS)                         # (b, l)
    lesson = Lessons(copy=0.5).kinds(chunk_ids, 3)[0]
    assert 0.3 < lesson.mean() < 0.7 and not np.array_equal(lesson, Lessons(copy=0.5).kinds(chunk_ids, 4)[0])
    np.testing.assert_array_equal(got["tokens"], plain["tokens"])
    np.testing.assert_array_equal(got["neighbours"][~lesson], plain["neighbours"][~lesson])
    np.testing.assert_array_equal(got["neighbours"][lesson, 1], plain["neighbours"][lesson, 1])
    # A lesson's first neighbour is the chunk itself, then the next chunk of its document.
    cont = train.continuation_ids()
    for b, l in zip(*np.nonzero(lesson)):
        c, first = chunk_ids[b, l], got["neighbours"][b, l, 0]
        np.testing.assert_array_equal(first[:train.lengths[c]], train.tokens([c])[0, :train.lengths[c]])
        if cont[c] >= 0:
            np.testing.assert_array_equal(first[CHUNK_LEN:CHUNK_LEN + train.lengths[cont[c]]],
                                          train.tokens([cont[c]])[0, :train.lengths[cont[c]]])
        else:
            assert (first[CHUNK_LEN:] == -1).all()
    assert (got["neighbours"][lesson, 0] != plain["neighbours"][lesson, 0]).any()
    # Resuming repeats the lessons: the same (seed, chunk) always gets the same neighbours.
    np.testing.assert_array_equal(taught.batch(seq)["neighbours"], got["neighbours"])


def test_neighbour_store_marks_missing_neighbours(tmp_path, built):
    root, store, _ = built
    shutil.copytree(root / "retrieval" / "neighbours", tmp_path / "neighbours")
    arr = np.load(tmp_path / "neighbours" / "train.npy", allow_pickle=False)
    arr[0] = [5, -1]
    save_npy(tmp_path / "neighbours" / "train.npy", arr)
    # The copy finds its database through the absolute path the manifest also records.
    tokens = NeighbourStore(tmp_path / "neighbours", store).neighbour_tokens("train", np.array([[0]]))
    assert tokens[0, 0, 0, 0] >= 0 and (tokens[0, 0, 1] == -1).all()


def test_neighbour_store_refuses_stale_neighbours(tmp_path, built):
    root, store, _ = built
    shutil.copytree(root / "retrieval" / "neighbours", tmp_path / "neighbours")
    manifest = read_json(tmp_path / "neighbours" / "manifest.json")
    write_json(tmp_path / "neighbours" / "manifest.json", {**manifest, "chunk_store_fingerprint": "0ld"})
    with pytest.raises(DataError, match=f"0ld.*{store.fingerprint}.*build_index"):
        NeighbourStore(tmp_path / "neighbours", store)
    write_json(tmp_path / "neighbours" / "manifest.json", {**manifest, "database_fingerprint": "0ld"})
    with pytest.raises(DataError, match="stale neighbours.*database 0ld"):
        NeighbourStore(tmp_path / "neighbours", store)
    write_json(tmp_path / "neighbours" / "manifest.json", manifest)
    with pytest.raises(DataError, match="8 chunks per sequence"):
        NeighbourStore(tmp_path / "neighbours", store, chunks_per_seq=8)
    with pytest.raises(DataError, match="no neighbours"):
        NeighbourStore(tmp_path / "nowhere", store)


@pytest.mark.parametrize("shift", [5, -3, 0])
def test_aligned_neighbours_continue_the_query_text(tmp_path, shift):
    """A neighbour whose document holds the query's text s tokens from its chunk start is read from there."""
    words = [f"{w}{i}" for i, w in enumerate(" ".join(TOPICS).split())]          # no text repeats itself
    docs = [("train", " ".join(words[i::3])) for i in range(3)] + [("validation", TOPICS[0])]
    store = make_store(tmp_path, docs)
    build_retrieval(retrieval_cfg(k=1), store, tmp_path / "retrieval", chunks_per_seq=SEQ_CHUNKS)
    db = NeighbourStore.of(tmp_path / "retrieval", store).database
    m = db.chunk_len
    nxt = db.next_chunks(np.arange(len(db)))
    full = db.chunk_tokens(np.arange(len(db))).min(-1) >= 0

    def text_around(n):  # 4m tokens of one document: the chunk before n, n and two after
        return db.chunk_tokens(np.array([n - 1, n, nxt[n], nxt[nxt[n]]])).reshape(-1)

    def unambiguous(text):  # the query's text occurs at one shift only (topic documents repeat themselves)
        return sum((text[m + s:2 * m + s - 2] == text[m + shift:2 * m + shift - 2]).all() for s in range(1 - m, m)) == 1

    middle = [n for n in range(1, len(db)) if db.positions[n] > 0 and nxt[n] >= 0 and nxt[nxt[n]] >= 0
              and full[n - 1] and full[n] and full[nxt[n]] and unambiguous(text_around(n))]
    assert middle, "the fixture has no document of four chunks"
    n = middle[0]
    text = text_around(n)
    query = text[m + shift:2 * m + shift].copy()
    query[-2:] = -1                                                                    # a short final chunk
    aligned = Reading(align=True).tokens(db, np.array([[n, -1]]), query[None])          # (1, k=2, r)
    np.testing.assert_array_equal(aligned[0, 0], text[m + shift:3 * m + shift])
    assert (aligned[0, 1] == -1).all()
    unrelated = np.full(m, 50000, dtype=np.int64)                                      # matches nothing: as retrieved
    np.testing.assert_array_equal(Reading(align=True).tokens(db, np.array([[n]]), unrelated[None]),
                                  db.neighbour_tokens(np.array([[n]])))
    # retrieval.aligned_only: the neighbour that lines up stays, the unrelated one is dropped.
    only = Reading(align=True, aligned_only=True).tokens(db, np.array([[n], [n]]), np.stack([query, unrelated]))
    np.testing.assert_array_equal(only[0, 0], aligned[0, 0])
    assert (only[1, 0] == -1).all()


def test_best_shift_needs_enough_matching_tokens():
    from retropipe.data.reading import best_shifts
    m = 8
    region = np.arange(4 * m)[None]                                   # (1, 4m)
    query = np.arange(m + 2, 2 * m + 2)[None].copy()                  # region's text 2 tokens late
    shifts, lined_up = best_shifts(query, region, min_match=m)
    assert shifts[0] == 2 and lined_up[0]
    query[0, 3:] = -1                                                 # only 3 tokens left to match
    shifts, lined_up = best_shifts(query, region, min_match=4)
    assert shifts[0] == 0 and not lined_up[0]
    shifts, lined_up = best_shifts(query, region, min_match=3)
    assert shifts[0] == 2 and lined_up[0]


def test_best_shift_lines_up_the_end_of_the_query():
    """A phrase inserted in the middle: most tokens match at one shift, the query's end at another.
    The end decides, because the continuation is read right after it."""
    from retropipe.data.reading import best_shifts
    m = 16
    region = np.arange(4 * m)[None]                                   # (1, 4m): distinct tokens
    t = np.arange(m)
    query = np.where(t < 10, m + t, m + 3 + t)[None]                  # 10 tokens at shift 0, the last 6 at 3
    shifts, lined_up = best_shifts(query, region, min_match=4)
    assert shifts[0] == 3 and lined_up[0]
    query[0, -4:] = -1                                                # the end is padding: most matches decide
    shifts, lined_up = best_shifts(query, region, min_match=4)
    assert shifts[0] == 0 and lined_up[0]


def test_one_reading_decides_what_a_chunk_reads(built):
    """Training reads lined up and unfiltered, evaluation lined up and filtered; SHUFFLED reads the
    neighbours retrieved for another document's chunk as retrieved, on every evaluation path; every
    field of the rule is in the settings that fingerprint a report."""
    from retropipe.retrieval.config import RetrievalConfig

    root, store, _ = built
    cfg = RetrievalConfig(aligned_only=True)
    assert Reading.for_training(cfg) == Reading(align=True)
    assert Reading.for_evaluation(cfg) == Reading(align=True, aligned_only=True)
    assert Reading.for_evaluation(RetrievalConfig(align_neighbours=False)) == Reading()
    with pytest.raises(ValueError, match="needs align"):
        Reading(aligned_only=True)
    on = NeighbourStore.of(root / "retrieval", store, reading=Reading.for_evaluation(cfg))
    shuffled = on.read_as(on.reading.but(shuffled=True))
    assert on.reading.shuffled is False and shuffled.reading.shuffled is True
    val = store.split("validation")
    ids = np.arange(len(val))
    order = shuffled_order(val.doc_index)
    assert (val.doc_index[order] != val.doc_index).all()
    raw = on.read_as(Reading())                                   # [N, F] as retrieved
    np.testing.assert_array_equal(shuffled.neighbour_tokens("validation", ids), raw.neighbour_tokens("validation", order))
    kept = on.neighbour_tokens("validation", order)
    assert (kept < 0).sum() > 0 and (shuffled.neighbour_tokens("validation", ids) < 0).sum() < (kept < 0).sum()
    settings = shuffled.reading.settings()
    assert settings == {"align": True, "aligned_only": True, "shuffled": True, "alignment_rule": ALIGNMENT_RULE}
    assert on.reading.settings() != settings


def test_diverging_and_distractor_lessons_teach_when_not_to_copy(built):
    """A diverging lesson holds the chunk and its continuation up to a random token of the
    continuation, then another document's text; a distractor is another document's chunk as
    retrieved. One draw per chunk: the copy lessons stay where they were."""
    from retropipe.training.run.batches import SequenceBatches
    from retropipe.training.run.lessons import Lessons, other_chunks

    root, store, _ = built
    reader = NeighbourStore.of(root / "retrieval", store, chunks_per_seq=SEQ_CHUNKS)
    train = store.split("train")
    seq = np.arange(train.num_sequences(SEQ_CHUNKS))
    lessons = Lessons(copy=0.3, diverging=0.3, distractor=0.3)
    got = SequenceBatches(store, "train", SEQ_CHUNKS * CHUNK_LEN, reader, k=2, lessons=lessons, seed=3).batch(seq)
    chunk_ids = train.sequence_chunk_ids(seq, SEQ_CHUNKS)
    copy, diverging, distractor = lessons.kinds(chunk_ids, 3)
    np.testing.assert_array_equal(copy, Lessons(copy=0.3).kinds(chunk_ids, 3)[0])
    assert not (copy & diverging).any() and not (diverging & distractor).any() and diverging.any() and distractor.any()
    own = reader.own_tokens(chunk_ids)                                              # (b, l, r)
    others = reader.database.neighbour_tokens(other_chunks(chunk_ids, len(train), 3)[..., None])[..., 0, :]
    first = got["neighbours"][..., 0, :]
    np.testing.assert_array_equal(first[copy], own[copy])
    np.testing.assert_array_equal(first[distractor], others[distractor])
    for (b, l) in zip(*np.nonzero(diverging)):
        cut = np.flatnonzero(first[b, l] != own[b, l])
        cut = cut[0] if len(cut) else 2 * CHUNK_LEN
        assert cut >= CHUNK_LEN  # the chunk itself is whole; the divergence lies in the continuation
        np.testing.assert_array_equal(first[b, l, cut:], others[b, l, cut:])
    docs = train.doc_index
    assert (docs[other_chunks(chunk_ids, len(train), 3)] != docs[chunk_ids]).mean() > 0.9
