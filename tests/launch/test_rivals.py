"""The rivals that need no training: GPT-2 with the neighbours in its context, and a kNN-LM."""

import json

import numpy as np
import pytest
import torch

from retropipe.data.config import ConfigError, DataConfig
from retropipe.data.database_reader import Part
from retropipe.data.prepare import prepare
from retropipe.data.store import ChunkStore
from retropipe.data.tokenizer import get_tokenizer
from retropipe.launch.evaluate import knn_datastore_index
from retropipe.training.evaluation.config import EvalConfig
from retropipe.training.evaluation.in_context import in_context_rows, score_in_context, text_chunks
from retropipe.training.evaluation.knn_lm import (Datastore, KnnSettings, build_datastore, knn_probability,
                                                  paired_batches, score_knn_lm, tune)
from retropipe.training.evaluation.scoring import score_split, token_byte_lengths
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2
from retropipe.training.models.retro import Retro

M = 8
TEXTS = ["The quick brown fox jumps over the lazy dog and runs far into the green forest. " * 2,
         "A kluge is a clever device, whether in hardware or software, that works for reasons nobody knows.",
         "Bits per byte count the UTF-8 bytes of the text, naïve café ☕ included, so tokenizers compare."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("rivals")
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    prepare(DataConfig(corpus=str(corpus), chunk_len=M, validation_fraction=0.0), root / "data", progress=False)
    torch.manual_seed(0)
    model = GPT2(ModelConfig(n_layer=2, n_head=2, n_embd=16, n_positions=64, chunk_len=M)).eval()
    store = ChunkStore(root / "data")
    return store, model, token_byte_lengths(get_tokenizer("gpt2"))


class TableNeighbours:
    """A neighbour source over a fixed (chunks, k, r) table of tokens."""

    def __init__(self, table):
        self.table = table

    def neighbour_tokens(self, split, ids, k):
        return self.table[ids][..., :k, :].copy()


def test_in_context_without_neighbours_is_the_sliding_window_of_its_text(tiny):
    store, model, lengths = tiny
    chunks = store.split("train")
    empty = TableNeighbours(np.full((len(chunks), 1, 2 * M), -1))
    window = 2 * M + 3 * M                                  # one neighbour with its continuation + 3 chunks
    assert text_chunks(window, M, 1) == 3
    rival = score_in_context(model, chunks, lengths, window, empty, k=1, batch_size=3)
    plain = score_split(model, chunks, lengths, window=3 * M, stride=M)
    np.testing.assert_allclose(rival.nll, plain.nll, rtol=1e-5)
    assert (rival.tokens == plain.tokens).all() and (rival.bytes == plain.bytes).all()


def test_in_context_puts_the_previous_chunks_neighbours_before_its_text(tiny):
    store, model, lengths = tiny
    chunks = store.split("train")
    c = len(chunks)
    table = np.random.default_rng(0).integers(0, 1000, (c, 2, 2 * M))
    table[:, :, -3:] = -1                                   # missing tokens are left out, not padded
    rows, starts = in_context_rows(chunks, TableNeighbours(table), np.array([0, 3]), T=2, k=2)
    text = chunks.tokens(np.arange(4)).astype(np.int64)
    assert rows[0].tolist() == text[0].tolist() and starts[0] == 0          # chunk 0: nothing retrieved before it
    read = [t for t in table[2, 1] if t >= 0] + [t for t in table[2, 0] if t >= 0]  # chunk 2's, best one last
    assert rows[1].tolist() == read + text[2].tolist() + text[3].tolist() and starts[1] == len(read) + M
    rival = score_in_context(model, chunks, lengths, 4 * M + 2 * M, TableNeighbours(table), k=1)
    empty = score_in_context(model, chunks, lengths, 4 * M + 2 * M, None, k=1)
    assert rival.nll[0] == pytest.approx(empty.nll[0]) and abs(rival.nll[1:] - empty.nll[1:]).max() > 1e-3
    with pytest.raises(ValueError, match="eval.in_context_neighbours"):
        text_chunks(4 * M, M, 2)                            # two neighbours fill the window: no room for text


def one_part(store, hashes):
    """A database of one part, the store's training split, its documents hashed as `hashes` says."""
    chunks = store.split("train")
    return type("Db", (), {"parts": [Part("train", store, 0, len(chunks))], "text_hashes": hashes})()


def test_the_datastore_never_returns_the_evaluated_document(tiny):
    store, model, _ = tiny
    chunks, hashes = store.split("train"), store.text_hashes("train")
    built = build_datastore(model, one_part(store, hashes), 4 * M, 2 * M, knn_datastore_index)
    assert len(built) == chunks.lengths.sum() - 1         # every token but the very first
    entries = Datastore(built.search, np.arange(len(built)), built.hashes)  # values = entry ids
    keys = torch.from_numpy(np.random.default_rng(0).normal(size=(20, 16)).astype(np.float32))
    for doc in np.unique(hashes):
        dist, ids = entries.neighbours(keys, np.full(20, doc, np.uint64), k=8)
        found = ids[ids >= 0]
        assert len(found) and (built.hashes[found] != doc).all() and np.isfinite(dist[ids >= 0]).all()
    alone = Datastore(built.search, built.values, np.full(len(built), 7, np.uint64))
    dist, vals = alone.neighbours(keys, np.full(20, 7, np.uint64))
    assert np.isinf(dist).all() and (vals == -1).all()      # all excluded: none, never another's


def test_knn_lm_with_lambda_zero_is_the_baseline_and_reads_a_copy_of_the_text(tiny):
    store, model, lengths = tiny
    chunks, hashes = store.split("train"), store.text_hashes("train")
    # The datastore holds this very text as another document's (an exact copy under another hash).
    copy = build_datastore(model, one_part(store, hashes + np.uint64(1)), 4 * M, 2 * M, knn_datastore_index)
    baseline = score_split(model, chunks, lengths, 4 * M, 2 * M)
    off = score_knn_lm(model, chunks, lengths, hashes, copy, KnnSettings(0.0, 8, 1.0), 4 * M, 2 * M)
    np.testing.assert_allclose(off.nll, baseline.nll, rtol=1e-9)
    settings = tune(model, chunks, hashes, copy, 4 * M, 2 * M, tune_chunks=len(chunks))
    on = score_knn_lm(model, chunks, lengths, hashes, copy, settings, 4 * M, 2 * M)
    assert settings.lam > 0.5 and on.bits_per_byte() < 0.5 * baseline.bits_per_byte()
    # The same datastore under the documents' own hashes: each chunk reads only the other documents,
    # never its own text, and gains none of that.
    own = build_datastore(model, one_part(store, hashes), 4 * M, 2 * M, knn_datastore_index)
    alone = score_knn_lm(model, chunks, lengths, hashes, own, settings, 4 * M, 2 * M)
    assert alone.bits_per_byte() > baseline.bits_per_byte() > on.bits_per_byte()


def test_retro_with_a_knn_lm_reads_its_neighbours_and_queries_its_trunks_datastore(tiny):
    store, _, lengths = tiny
    chunks, hashes = store.split("train"), store.text_hashes("train")
    torch.manual_seed(0)
    retro = Retro(ModelConfig(kind="retro", n_layer=2, n_head=2, n_embd=16, n_positions=64, chunk_len=M,
                              encoder_layers=1, encoder_embd=8, encoder_head=2)).eval()
    with torch.no_grad():  # away from the initialisation, where the CCAs may add exactly nothing
        for p in retro.parameters():
            p.add_(0.1 * torch.randn_like(p))
    table = TableNeighbours(np.random.default_rng(1).integers(0, 1000, (len(chunks), 2, 2 * M)))
    on = score_split(retro, chunks, lengths, 4 * M, 2 * M, table, 2)
    off = score_split(retro, chunks, lengths, 4 * M, 2 * M)
    assert abs(on.nll - off.nll).max() > 1e-3                # reading the neighbours changes the predictions
    # A datastore of the trunk's states over this very text as another document's: each query, the
    # trunk's state, finds its own entry (at fp16's rounding), where RETRO's state read for the LM
    # term would not.
    copy = build_datastore(retro, one_part(store, hashes + np.uint64(1)), 4 * M, 2 * M, knn_datastore_index)
    for b in paired_batches(retro, chunks, 4 * M, 2 * M, table, 2):
        near, far = (copy.neighbours(q, hashes[b.chunk])[0][:, 0] for q in (b.query, b.lm.hidden))
        assert near.max() < 1e-4 < far.max(), (near.max(), far.max())
    zero = score_knn_lm(retro, chunks, lengths, hashes, copy, KnnSettings(0.0, 8, 1.0), 4 * M, 2 * M,
                        neighbours=table, k=2)
    np.testing.assert_allclose(zero.nll, on.nll, rtol=1e-9)   # λ = 0: RETRO[ON] exactly
    settings = tune(retro, chunks, hashes, copy, 4 * M, 2 * M, len(chunks), neighbours=table, k=2)
    mixed = score_knn_lm(retro, chunks, lengths, hashes, copy, settings, 4 * M, 2 * M, neighbours=table, k=2)
    assert settings.lam > 0.5 and mixed.bits_per_byte() < 0.5 * on.bits_per_byte()


def test_retro_with_a_knn_lm_is_refused_for_another_corpus_or_database(tmp_path, capsys):
    from retropipe.launch.evaluate import main

    for elsewhere in (["--corpus", str(tmp_path / "other.jsonl")], ["--database", str(tmp_path)]):
        assert main(["--config", "configs/tiny.yaml", "--set", "eval.retro_knn_lm=true", *elsewhere,
                     "--checkpoint", str(tmp_path)]) == 2
        assert "config key 'eval.retro_knn_lm'" in capsys.readouterr().err


def test_knn_probability_weights_the_nearest_and_skips_the_missing():
    dist = np.array([[0.0, 1.0, np.inf], [np.inf, np.inf, np.inf]])
    vals = np.array([[5, 6, -1], [-1, -1, -1]])
    p, has = knn_probability(dist, vals, np.array([5, 5]), k=3, temperature=1.0)
    assert p[0] == pytest.approx(1 / (1 + np.exp(-1.0))) and has.tolist() == [True, False] and p[1] == 0


def test_unknown_rivals_are_refused_naming_the_key():
    assert EvalConfig(rivals=["in_context", "knn_lm"]).rivals == ["in_context", "knn_lm"]
    with pytest.raises(ConfigError, match="eval.rivals"):
        EvalConfig(rivals=["in_context_trained_by_magic"])
    with pytest.raises(ConfigError, match="eval.in_context_neighbours"):
        EvalConfig(in_context_neighbours=0)
