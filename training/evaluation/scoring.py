"""Bits per byte with a sliding window, per chunk.

The evaluated split is read as one stream of chunks (documents in order, each chunk padded to
chunk_len). A window of L = window / chunk_len chunks slides by S = stride / chunk_len chunks;
each window scores only the targets in its last S chunks (the first window scores all), so
every real token after the first is predicted exactly once, with at least window − stride
tokens of context. Padding is never a target. Bits per byte = Σ NLL / ln 2 / Σ UTF-8 bytes of
the scored tokens (tiktoken's BPE is lossless on bytes, so Σ bytes is the text's byte length).
Results are kept per chunk, so any subset (an α bucket, training/evaluation/leakage.py) can be reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from retropipe.training.models.lm_head import SliceBuffers, token_nll


@dataclass
class ChunkScores:
    """Per evaluated chunk: summed NLL (nats) of its real tokens as targets, their count and bytes."""

    nll: np.ndarray      # (c,) float64
    tokens: np.ndarray   # (c,) int64
    bytes: np.ndarray    # (c,) int64

    def bits_per_byte(self, select: np.ndarray | None = None) -> float:
        sel = slice(None) if select is None else select
        return float(self.nll[sel].sum() / math.log(2) / max(self.bytes[sel].sum(), 1))

    def perplexity(self, select: np.ndarray | None = None) -> float:
        sel = slice(None) if select is None else select
        return float(math.exp(self.nll[sel].sum() / max(self.tokens[sel].sum(), 1)))


def token_byte_lengths(encoding) -> np.ndarray:
    """UTF-8 byte length of every token id (special tokens count 0 bytes)."""
    lengths = np.zeros(encoding.n_vocab, dtype=np.int64)
    for t in range(encoding.n_vocab):
        try:
            lengths[t] = len(encoding.decode_single_token_bytes(t))
        except KeyError:
            lengths[t] = 0
    lengths[encoding.eot_token] = 0
    return lengths


@dataclass
class ScoredBatch:
    """The targets one forward scores: each with the chunk it lies in and the hidden state that predicts it."""

    chunk: np.ndarray       # (t,) int64 chunk id of each target
    hidden: torch.Tensor    # (t, d) final hidden state (after ln_f) at the position before it
    target: torch.Tensor    # (t,) int64 the target token


@torch.no_grad()
def score_split(model, chunks, byte_lengths: np.ndarray, window: int, stride: int, neighbours=None,
                k: int = 0, batch_size: int = 4, device=None, progress=None,
                max_chunks: int = 0) -> ChunkScores:
    """Sliding-window scores of every chunk of a split (`chunks`: data.store.SplitChunks).

    `neighbours`: for RETRO, anything with neighbour_tokens(split, ids (b, l), k) -> (b, l, k, r)
    int64, -1 = missing (a data.neighbour_store.NeighbourStore); None = the baseline, or RETRO[OFF]
    when the model is RETRO. `k` neighbours per chunk (0 = all stored). Inputs go to `device`
    (None = the model's); each batch's per-token NLL comes back to the CPU once, for numpy.
    """
    c = min(len(chunks), max_chunks or len(chunks))
    batches = scored_batches(model, chunks, window, stride, neighbours, k, batch_size, device, progress, max_chunks)
    return accumulate(batches, head_nll(model), chunks, byte_lengths, c)


def head_nll(model):
    """ScoredBatch -> (t,) numpy NLL of its targets under the model's own head."""
    buffers = SliceBuffers()  # the head's slice buffers, kept from batch to batch
    return lambda b: token_nll(b.hidden, model.wte.weight, b.target, buffers=buffers).cpu().numpy()


def accumulate(batches, nll_of, chunks, byte_lengths: np.ndarray, c: int) -> ChunkScores:
    """Per-chunk sums of nll_of(batch) (t,) over the ScoredBatches of the first c chunks."""
    nll = np.zeros(c)
    count = np.zeros(c, dtype=np.int64)
    for b in batches:
        np.add.at(nll, b.chunk, nll_of(b))
        np.add.at(count, b.chunk, 1)
    return ChunkScores(nll, count, chunk_bytes(chunks, byte_lengths, c))


@torch.no_grad()
def scored_batches(model, chunks, window: int, stride: int, neighbours=None, k: int = 0, batch_size: int = 4,
                   device=None, progress=None, max_chunks: int = 0):
    """The sliding windows of score_split, a batch at a time: one ScoredBatch each (its kept targets)."""
    m = chunks.chunk_len
    device = device or next(model.parameters()).device
    if window % m or stride % m or stride > window:
        raise ValueError(f"window ({window}) and stride ({stride}) must be multiples of chunk_len ({m}), "
                         f"stride <= window")
    L, S, c = window // m, stride // m, min(len(chunks), max_chunks or len(chunks))
    scored_from = window_starts(c, L, S)  # window start → first chunk whose targets it scores
    starts = list(scored_from)
    retro = getattr(model, "cfg", None) is not None and model.cfg.retrieves
    batches = [starts[i:i + batch_size] for i in range(0, len(starts), batch_size)]
    for group in (progress(batches) if progress else batches):
        ids = np.stack([np.arange(s, s + L) for s in group])  # (b, L); windows never run past the end
        ids = np.minimum(ids, c - 1)
        b = len(group)
        tokens = chunks.tokens(ids.reshape(-1)).reshape(b, L * m).astype(np.int64)
        real = (np.arange(m)[None, None] < chunks.lengths[ids][..., None]).reshape(b, L * m)
        x = torch.from_numpy(tokens).to(device)
        nbr = window_neighbours(neighbours, chunks.split, ids, k, device) if retro and neighbours is not None else None
        h = model.hidden(x, nbr) if retro else model.hidden(x)                     # (b, n, d); nbr None: RETRO[OFF]
        # Target position p (1..n-1) of window row i lies in chunk ids[i, p // m]; keep it if it is
        # real, inside the split and in this window's scored range (and not a clamped repeat).
        pos = np.arange(1, L * m)
        target_chunk = ids[:, pos // m]                                             # (b, n - 1)
        unclamped = (np.array(group)[:, None] + pos[None] // m) == target_chunk
        first_scored = np.array([scored_from[s] for s in group])[:, None]
        keep = real[:, 1:] & unclamped & (target_chunk >= first_scored)
        # Only the kept positions go through the head (a window after the first scores its last
        # `stride` tokens, and the head is most of a small model's forward), slice by slice: the
        # logits of a whole batch are never held at once.
        kept = torch.from_numpy(keep).to(device)
        yield ScoredBatch(target_chunk[keep], h[:, :-1][kept], x[:, 1:][kept])


def window_neighbours(neighbours, split: str, ids: np.ndarray, k: int, device) -> torch.Tensor:
    """(b, L, k, r) int64 on `device`: what the windows' chunks ids (b, L) read, -1 = missing.

    The last chunk's neighbours steer only the window's last position (the causal shift), whose
    prediction lies past the window and is never scored: left unread (-1, in a new array, not the
    source's), the model encodes and attends for one chunk fewer per window (training/models/retro.py)."""
    last = (np.arange(ids.shape[1]) == ids.shape[1] - 1)[None, :, None, None]
    return torch.from_numpy(np.where(last, -1, neighbours.neighbour_tokens(split, ids, k=k))).to(device)


def window_starts(c: int, L: int, S: int) -> dict[int, int]:
    """The windows of L chunks over c chunks, sliding by S (the last one ends at the split's end):
    {first chunk of the window: first chunk whose targets it scores} (the chunks before are
    scored by an earlier window)."""
    starts = [0] + list(range(S, max(c - L, 0) + S, S)) if c > L else [0]
    scored_from, prev_end = {}, 0
    for s in sorted({min(s, max(c - L, 0)) for s in starts}):
        scored_from[s] = prev_end
        prev_end = min(s + L, c)
    return scored_from


def chunk_bytes(chunks, byte_lengths: np.ndarray, c: int) -> np.ndarray:
    """(c,) int64: UTF-8 bytes of the scored tokens of each of the first c chunks."""
    lengths = chunks.lengths
    all_tokens = chunks.tokens(np.arange(c))
    nbytes = np.array([byte_lengths[all_tokens[u, :lengths[u]]].sum() for u in range(c)], dtype=np.int64)
    # The very first token of the split is never a target: drop its bytes from the denominator.
    nbytes[0] -= byte_lengths[all_tokens[0, 0]]
    return nbytes
