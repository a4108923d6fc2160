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


class OwnNextChunk:
    """A neighbour source: each chunk's neighbour is the next chunk and the one after (k = 1), the
    last 3 tokens missing; what an in-context row must place, tokens left out where missing."""

    def __init__(self, chunks):
        self.chunks = chunks

    def neighbour_tokens(self, split, ids, k):
        nxt = np.minimum(ids + 1, len(self.chunks) - 2)
        pair = np.concatenate([self.chunks.tokens(nxt.reshape(-1)), self.chunks.tokens(nxt.reshape(-1) + 1)], -1)
        pair = pair.astype(np.int64).reshape(*ids.shape, 1, 2 * CHUNK)
        pair[..., -3:] = -1
        return pair


def test_an_in_context_batch_reads_the_last_chunks_neighbours_before_its_text(store):
    """model.in_context: the sequence's last chunk is the target, after its predecessor's
    neighbours and the text that fits (5 chunks of 16: one neighbour of 32 tokens, 3 chunks)."""
    chunks = store.split("train")
    plain = SequenceBatches(store, "train", 5 * CHUNK)
    data = SequenceBatches(store, "train", 5 * CHUNK, OwnNextChunk(chunks), in_context=1)
    seq = np.arange(6)
    batch, whole = data.batch(seq), plain.batch(seq)
    assert set(batch) == {"tokens", "labels"} and batch["tokens"].shape == (6, 5 * CHUNK)
    for s in seq:
        ids = chunks.sequence_chunk_ids(np.array([s]), 5)[0]
        read = OwnNextChunk(chunks).neighbour_tokens("train", ids[-2:-1], 1)[0, 0]
        read = read[read >= 0]
        text = whole["tokens"][s, 2 * CHUNK:]
        n = len(read) + len(text)
        assert batch["tokens"][s, :n].tolist() == read.tolist() + text.tolist()
        assert (batch["tokens"][s, n:] == store.pad_id).all()
        targets = batch["labels"][s] != IGNORE_INDEX
        # Only the last chunk's real tokens are targets, predicted from the position before each.
        assert batch["labels"][s, n - CHUNK - 1:n - 1].tolist() == whole["labels"][s, -CHUNK - 1:-1].tolist()
        assert targets.sum() == (whole["labels"][s, -CHUNK - 1:-1] != IGNORE_INDEX).sum() > 0
    with pytest.raises(ValueError, match="model.in_context"):
        SequenceBatches(store, "train", 3 * CHUNK, OwnNextChunk(chunks), in_context=1)
