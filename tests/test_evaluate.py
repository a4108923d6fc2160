"""Bits per byte by hand vs the tool, the overlap ratio α, and the sliding window."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.config import DataConfig
from data.prepare import prepare
from data.store import ChunkStore
from data.tokenizer import get_tokenizer
from training.config import ModelConfig
from training.evaluate import longest_common_substring, overlap_ratios, score_split, token_byte_lengths
from training.model import GPT2

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Bits per byte — naïve café ☕", "short"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    prepare(DataConfig(corpus=str(corpus), chunk_len=8, validation_fraction=0.0), root / "data", progress=False)
    torch.manual_seed(0)
    model = GPT2(ModelConfig(n_layer=1, n_head=2, n_embd=16, n_positions=128, chunk_len=8)).eval()
    enc = get_tokenizer("gpt2")
    return ChunkStore(root / "data").split("train"), model, enc


def test_bits_per_byte_equals_a_hand_computation(tiny):
    chunks, model, enc = tiny
    # By hand: the documents' tokens + end-of-text, back to back, one forward pass, every
    # token after the first is a target, bytes are the UTF-8 bytes of the texts.
    stream = [t for text in TEXTS for t in enc.encode_ordinary(text) + [enc.eot_token]]
    # ...except that the model sees each document padded to whole chunks: rebuild that input.
    padded, real = [], []
    for text in TEXTS:
        toks = enc.encode_ordinary(text) + [enc.eot_token]
        pad = -len(toks) % 8
        padded += toks + [enc.eot_token] * pad
        real += [True] * len(toks) + [False] * pad
    x = torch.tensor([padded])
    with torch.no_grad():
        nll = F.cross_entropy(model(x)[0, :-1], x[0, 1:], reduction="none").numpy()
    total = sum(v for v, r in zip(nll, real[1:]) if r)
    n_bytes = sum(len(t.encode()) for t in TEXTS) - len(enc.decode_single_token_bytes(stream[0]))
    expected = total / math.log(2) / n_bytes

    window = len(padded)
    scores = score_split(model, chunks, token_byte_lengths(enc), window=window, stride=window)
    assert scores.bytes.sum() == n_bytes
    assert scores.tokens.sum() == len(stream) - 1
    assert scores.bits_per_byte() == pytest.approx(expected, rel=1e-5)


def test_sliding_window_scores_every_token_once(tiny):
    chunks, model, enc = tiny
    full = score_split(model, chunks, token_byte_lengths(enc), window=len(chunks) * 8, stride=len(chunks) * 8)
    for window, stride in ((32, 16), (24, 8), (16, 8)):
        s = score_split(model, chunks, token_byte_lengths(enc), window=window, stride=stride)
        assert (s.tokens == full.tokens).all(), (window, stride)  # each target scored exactly once
        assert (s.bytes == full.bytes).all()
    with pytest.raises(ValueError, match="multiples of chunk_len"):
        score_split(model, chunks, token_byte_lengths(enc), window=30, stride=10)


def test_longest_common_substring_and_alpha():
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    assert longest_common_substring(a, np.array([9, 3, 4, 5, 9, 1, 2])) == 3
    assert longest_common_substring(a, np.array([8, 7, 6])) == 1
    assert longest_common_substring(a, np.array([], dtype=int)) == 0
    chunks = np.stack([a, a + 100])
    nbrs = np.stack([np.stack([np.r_[a, a], np.r_[a[:2], [0] * 14]]),             # full copy, k=2
                     np.stack([np.r_[[0] * 8, a + 100], np.full(16, 7)])])       # copy in the continuation
    mask = np.ones_like(nbrs, dtype=bool)
    mask[1, 0, 8:] = False  # ...but the continuation is masked: it must not count
    alpha = overlap_ratios(chunks, np.array([8, 8]), nbrs, mask, chunk_len=8)
    assert alpha.tolist() == [1.0, 0.0]
