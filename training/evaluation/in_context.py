"""The in-context rival: the baseline GPT-2 reading RETRO's neighbours in its context, no training
(In-Context RALM, Ram et al. 2023, arXiv 2302.00083).

    scores = score_in_context(gpt2, chunks, byte_lengths, window=256, neighbours=store, k=1)

As In-Context RALM does with a retrieval stride of one chunk and a query of the last chunk: every
chunk u is scored by its own forward, whose input is

    [neighbour k .. neighbour 1 of chunk u − 1, each with its continuation] [chunks u − T + 1 .. u]

and only chunk u's tokens are targets. Chunk u − 1's neighbours are the ones RETRO[ON] predicts
chunk u with (the chunked cross-attention's causal shift), read by the same rule (own document
and copies excluded, lined up, filtered: data/reading.py), so the two rows differ only in how the
model reads them. The best neighbour sits last, next to the text it continues; its missing tokens
(-1: no continuation, padding) are left out, not padded (data/reading.py in_context_tokens, the
rule the in-context-trained GPT-2 also trains with).

The window is split: k · r tokens for the neighbours (r = 2 · chunk_len, a neighbour and its
continuation), the rest, T = (window − k · r) / chunk_len whole chunks, for the text, as a user
of a fixed context would split it. With no neighbours the rows are exactly the sliding window of
T chunks sliding by one (scoring.score_split(window=T · chunk_len, stride=chunk_len)).
"""

from __future__ import annotations

import numpy as np
import torch

from retropipe.data.reading import in_context_text_chunks, in_context_tokens
from retropipe.training.evaluation.leakage import predicting_neighbours
from retropipe.training.evaluation.scoring import ScoredBatch, accumulate, head_nll


def text_chunks(window: int, chunk_len: int, k: int) -> int:
    """T: the chunks of text an in-context row holds beside k neighbours of 2 · chunk_len tokens."""
    return in_context_text_chunks(window, chunk_len, k, "eval.in_context_neighbours")


def in_context_rows(chunks, neighbours, ids: np.ndarray, T: int, k: int) -> tuple[list[np.ndarray], list[int]]:
    """Each chunk u of ids (b,): its row's tokens [neighbours][text] (n_u,) and where chunk u begins in it."""
    m = chunks.chunk_len
    nbrs = (predicting_neighbours(neighbours, chunks.split, ids, k) if neighbours is not None
            else np.full((len(ids), k, 2 * m), -1, np.int64))                        # (b, k, r)
    rows, starts = [], []
    for u, read in zip(ids, nbrs):
        first = max(0, u - T + 1)
        text = chunks.tokens(np.arange(first, u + 1)).reshape(-1)                    # ((u - first + 1) · m,)
        rows.append(in_context_tokens(read, text))
        starts.append(len(rows[-1]) - len(text) + (u - first) * m)
    return rows, starts


@torch.no_grad()
def in_context_batches(model, chunks, window: int, neighbours, k: int, batch_size: int = 4, device=None,
                       progress=None, max_chunks: int = 0):
    """One ScoredBatch per batch of chunks: each chunk's targets, predicted with its neighbours in context."""
    m = chunks.chunk_len
    T = text_chunks(window, m, k)
    device = device or next(model.parameters()).device
    c = min(len(chunks), max_chunks or len(chunks))
    batches = [np.arange(s, min(s + batch_size, c)) for s in range(0, c, batch_size)]
    for ids in (progress(batches) if progress else batches):
        rows, starts = in_context_rows(chunks, neighbours, ids, T, k)
        n = max(len(r) for r in rows)
        # Right-padded: a causal model's positions never see what comes after them.
        x = torch.from_numpy(np.stack([np.pad(r, (0, n - len(r))) for r in rows])).to(device)  # (b, n)
        h = model.hidden(x)                                                          # (b, n, d)
        keep = np.zeros((len(ids), n - 1), dtype=bool)
        for i, (u, start) in enumerate(zip(ids, starts)):
            real = int(chunks.lengths[u])
            # Targets at start .. start + real - 1, predicted from the position before each (the
            # split's very first token has none).
            keep[i, max(start - 1, 0):start + real - 1] = True
        kept = torch.from_numpy(keep).to(device)
        yield ScoredBatch(np.repeat(ids, keep.sum(1)), h[:, :-1][kept], x[:, 1:][kept])


def score_in_context(model, chunks, byte_lengths: np.ndarray, window: int, neighbours, k: int, batch_size: int = 4,
                     device=None, progress=None, max_chunks: int = 0):
    """ChunkScores of the in-context rival (see the module docstring); neighbours None = none read."""
    c = min(len(chunks), max_chunks or len(chunks))
    batches = in_context_batches(model, chunks, window, neighbours, k, batch_size, device, progress, max_chunks)
    return accumulate(batches, head_nll(model), chunks, byte_lengths, c)
