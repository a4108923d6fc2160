"""The training sample order and the label shift (training/run/batches.py): in-process, a real chunk store."""

import itertools

import numpy as np
import pytest

from retropipe.data.config import DataConfig
from retropipe.data.prepare import prepare
from retropipe.data.store import ChunkStore
from retropipe.training.run.batches import IGNORE_INDEX, SequenceBatches, micro_batches, sequence_ids_for

CHUNK = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "data"
    prepare(DataConfig(chunk_len=CHUNK, max_documents=60, validation_fraction=0.1, num_workers=1), out, progress=False)
    return ChunkStore(out)


def test_data_parallel_ranks_read_disjoint_samples_covering_each_epoch():
    n, size, world, seed = 40, 2, 4, 7
    per_epoch = n // (size * world)  # micro-batches per rank that fit in one epoch
    seen = {r: np.concatenate([sequence_ids_for(j, size, r, world, n, seed) for j in range(per_epoch)])
            for r in range(world)}
    for a, b in itertools.combinations(range(world), 2):
        assert not set(seen[a]) & set(seen[b]), (a, b)
    everything = np.concatenate(list(seen.values()))
    assert sorted(everything) == list(range(n))  # an epoch is a permutation of the split
    # The next epoch is another permutation, so the order does not repeat.
    nxt = np.concatenate([sequence_ids_for(j, size, 0, world, n, seed) for j in range(per_epoch, 2 * per_epoch)])
    assert not np.array_equal(nxt, seen[0])


def test_the_order_is_a_pure_function_of_the_seed():
    ids = lambda seed: [sequence_ids_for(j, 4, 1, 2, 50, seed).tolist() for j in range(30)]  # noqa: E731
    assert ids(1234) == ids(1234)
    assert ids(1234) != ids(1235)
    with pytest.raises(ValueError, match="no complete training sequence"):
        sequence_ids_for(0, 4, 0, 1, 0, 1)


def test_micro_batches_resume_from_any_offset(store):
    data = SequenceBatches(store, "train", 4 * CHUNK)
    assert len(data) >= 8
    run = micro_batches(data, 0, 2, 1, 2, 1234)
    whole = [next(run) for _ in range(3 * len(data))]  # several epochs
    for start in (0, 1, 5, len(data) + 3):
        resumed = micro_batches(data, start, 2, 1, 2, 1234)
        for expected in whole[start:start + 6]:
            got = next(resumed)
            assert np.array_equal(got["tokens"], expected["tokens"]) and np.array_equal(got["labels"], expected["labels"])


def test_labels_are_the_next_tokens_with_padding_masked(store):
    data = SequenceBatches(store, "train", 4 * CHUNK)
    chunks = store.split("train")
    seq = np.arange(len(data))
    batch = data.batch(seq)
    tokens, labels = batch["tokens"], batch["labels"]
    assert tokens.shape == labels.shape == (len(seq), 4 * CHUNK) and labels.dtype == np.int64
    # Ground truth from the store: the split's tokens laid end to end, a mask of real tokens.
    flat = chunks.tokens(np.arange(len(chunks))).reshape(-1).astype(np.int64)
    real = (np.arange(CHUNK)[None, :] < chunks.lengths[:, None]).reshape(-1)
    masked = 0
    for s in seq:
        for i in range(4 * CHUNK):
            pos = s * 4 * CHUNK + i  # this token's place in the split
            assert tokens[s, i] == flat[pos]
            nxt = pos + 1
            if nxt < len(flat) and real[nxt]:
                assert labels[s, i] == flat[nxt], (s, i)
            else:
                assert labels[s, i] == IGNORE_INDEX, (s, i)
                masked += 1
    assert masked > 0  # documents end mid-chunk in this corpus: the rule was exercised
    assert (labels != IGNORE_INDEX).mean() > 0.5


def test_a_sequence_length_that_is_not_whole_chunks_is_refused(store):
    with pytest.raises(ValueError, match="not a multiple of chunk_len 16"):
        SequenceBatches(store, "train", 40)
