"""The kNN-LM rival: the baseline GPT-2 interpolated with a nearest-neighbour distribution over a
datastore built from the database's text, no training (Khandelwal et al. 2020, arXiv 1911.00172).

    store = build_datastore(gpt2, database, window, stride, index_builder)      # every database token
    settings = tune(gpt2, database.parts[0].split, train_hashes, store, ...)    # λ, k, T on training text
    scores = score_knn_lm(gpt2, chunks, byte_lengths, chunk_hashes, store, settings, window, stride)

The datastore holds one entry per token of the database (the training split and retrieval.corpora):
key = the baseline's final hidden state (after ln_f, what its head reads) at the position before
the token, value = the token, computed with the evaluation's own sliding window. A scored token's
hidden state fetches its nearest keys (squared L2); the kNN distribution is a softmax of −d / T over
the values of the first k that survive the exclusions, and

    p(token) = λ · p_kNN(token) + (1 − λ) · p_LM(token)

(p_LM alone where no entry survives). Exclusions as RETRO's reading: no entry from a document
whose text equals the scored chunk's document (its own, or an exact copy; data.chunking.text_hash).
λ, k and T are chosen on a slice of the training split (its own documents excluded the same way),
never on the evaluated text. The same targets as every other row: scoring.scored_batches.

RETRO + kNN-LM (eval.retro_knn_lm): RETRO[ON]'s distribution interpolated the same way, with a
datastore of RETRO's own trunk (its hidden state with no neighbours read, RETRO[OFF]'s): the
database's tokens have no neighbours of their own to read, so keys and queries both come from
the trunk, and the LM term from RETRO reading its neighbours (`neighbours`, k): two forwards a
batch, the same targets.

FAISS stays out of training/: the index comes in as `index_builder(keys) -> search(queries, n)`
(launch/evaluate.py builds it with retrieval/index.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from retropipe.training.evaluation.scoring import ScoredBatch, accumulate, head_nll, scored_batches

# What the tuning tries: neighbours read, λ, and T as multiples of the median nearest distance.
K_GRID = (8, 16, 32, 64)
LAMBDA_GRID = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
TEMPERATURE_GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
# Entries fetched per query before the exclusions: twice the most that are read.
FETCH = 2 * max(K_GRID)


@dataclass(frozen=True)
class KnnSettings:
    lam: float
    k: int
    temperature: float

    def as_dict(self) -> dict:
        return {"lambda": self.lam, "k": self.k, "temperature": round(self.temperature, 6)}


@dataclass
class Datastore:
    search: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]  # (q, d) f32, n -> D (q, n), I (q, n)
    values: np.ndarray    # (N,) int64 the token each key predicts
    hashes: np.ndarray    # (N,) uint64 text hash of the entry's document

    def __len__(self) -> int:
        return len(self.values)

    def neighbours(self, queries: torch.Tensor, excluded: np.ndarray, k: int = max(K_GRID)):
        """The first k surviving entries per query, nearest first: distances (q, k) float64 (inf =
        none) and values (q, k) int64 (-1 = none); excluded (q,) the query's document hash."""
        q = queries.float().cpu().numpy()
        d, i = self.search(np.ascontiguousarray(q), min(FETCH, len(self)))
        ok = (i >= 0) & (self.hashes[np.maximum(i, 0)] != excluded[:, None])
        order = np.argsort(~ok, axis=1, kind="stable")[:, :k]                    # survivors first, in rank order
        ok = np.take_along_axis(ok, order, 1)
        dist = np.where(ok, np.take_along_axis(d, order, 1).astype(np.float64), np.inf)
        vals = np.where(ok, self.values[np.maximum(np.take_along_axis(i, order, 1), 0)], -1)
        return dist, vals


@torch.no_grad()
def build_datastore(model, database, window: int, stride: int, index_builder, batch_size: int = 4,
                    device=None, progress=None) -> Datastore:
    """One entry per scored token of every part of `database` (data.database_reader.Database)."""
    keys, values, hashes = [], [], []
    for part in database.parts:
        part_hashes = database.text_hashes[part.offset:part.offset + part.chunks]
        for b in scored_batches(model, part.split, window, stride, batch_size=batch_size, device=device,
                                progress=progress):
            keys.append(b.hidden.float().cpu().numpy().astype(np.float16))
            values.append(b.target.cpu().numpy())
            hashes.append(part_hashes[b.chunk])
    keys = np.concatenate(keys) if keys else np.zeros((0, model.cfg.n_embd), np.float16)
    return Datastore(index_builder(keys), np.concatenate(values).astype(np.int64),
                     np.concatenate(hashes).astype(np.uint64))


def knn_probability(dist: np.ndarray, vals: np.ndarray, targets: np.ndarray, k: int, temperature: float):
    """p_kNN(target) (q,) from the first k neighbours (q, k), and whether any was there (q,) bool."""
    d, v = dist[:, :k], vals[:, :k]
    present = np.isfinite(d)
    nearest = np.where(present[:, :1], d[:, :1], 0.0)                           # the first is the nearest
    logits = np.where(present, -(np.where(present, d, 0.0) - nearest) / temperature, -np.inf)  # nearest at 0
    w = np.exp(logits)
    total = w.sum(1)
    hit = (w * (v == targets[:, None])).sum(1)
    has = present.any(1)
    return np.where(has, hit / np.where(has, total, 1.0), 0.0), has


def mixed_nll(lm_nll: np.ndarray, p_knn: np.ndarray, has: np.ndarray, lam: float) -> np.ndarray:
    """−log(λ p_kNN + (1 − λ) p_LM) per token (nats), the LM's own NLL where no entry survived. In
    log space: no underflow of p_LM, and λ = 0 gives the LM's NLL exactly."""
    lm_nll = lm_nll.astype(np.float64)
    with np.errstate(divide="ignore"):   # log 0 = -inf is meant: λ = 0, or p_kNN = 0
        mixed = -np.logaddexp(np.log(lam) + np.log(p_knn), np.log1p(-lam) - lm_nll)
    return np.where(has, mixed, lm_nll)


@dataclass
class PairedBatch:
    """One batch's targets: what the LM term predicts them from, and the kNN query for each."""
    chunk: np.ndarray       # (t,) int64
    lm: ScoredBatch         # the model's hidden states (RETRO: reading its neighbours)
    query: torch.Tensor     # (t, d) the datastore's kind of hidden state (RETRO: its trunk's)


def paired_batches(model, chunks, window: int, stride: int, neighbours=None, k: int = 0, **kw):
    """PairedBatches of scored_batches: without neighbours the one forward serves both; with them
    (RETRO + kNN-LM) the LM reads them and the query is the trunk's, a second forward."""
    lm = scored_batches(model, chunks, window, stride, neighbours, k, **kw)
    if neighbours is None:
        yield from (PairedBatch(b.chunk, b, b.hidden) for b in lm)
        return
    trunk = scored_batches(model, chunks, window, stride, **{**kw, "progress": None})
    for b, q in zip(lm, trunk):
        if not np.array_equal(b.chunk, q.chunk):  # the same windows keep the same targets
            raise RuntimeError("RETRO + kNN-LM: the LM's and the query's forwards scored different targets")
        yield PairedBatch(b.chunk, b, q.hidden)


def tune(model, chunks, hashes: np.ndarray, store: Datastore, window: int, stride: int, tune_chunks: int,
         batch_size: int = 4, device=None, neighbours=None, k: int = 0) -> KnnSettings:
    """λ, k and T minimising the mean NLL of the first tune_chunks chunks of `chunks` (training
    text, hashes (c,) its documents' text hashes): every grid point, from one search. neighbours,
    k: what a RETRO model reads for its LM term (paired_batches)."""
    head = head_nll(model)
    lm, dist, vals, targets = [], [], [], []
    for b in paired_batches(model, chunks, window, stride, neighbours, k, batch_size=batch_size, device=device,
                            max_chunks=tune_chunks):
        lm.append(head(b.lm))
        d, v = store.neighbours(b.query, hashes[b.chunk])
        dist.append(d), vals.append(v), targets.append(b.lm.target.cpu().numpy())
    lm, dist, vals, targets = (np.concatenate(a) for a in (lm, dist, vals, targets))
    nearest = dist[:, 0][np.isfinite(dist[:, 0]) & (dist[:, 0] > 0)]
    scale = float(np.median(nearest)) if len(nearest) else 1.0
    best = (float("inf"), KnnSettings(0.0, K_GRID[0], scale))
    for k in K_GRID:
        for t in TEMPERATURE_GRID:
            p, has = knn_probability(dist, vals, targets, k, t * scale)
            for lam in LAMBDA_GRID:
                loss = float(mixed_nll(lm, p, has, lam).mean())
                if loss < best[0]:
                    best = (loss, KnnSettings(lam, k, t * scale))
    return best[1]


def score_knn_lm(model, chunks, byte_lengths: np.ndarray, hashes: np.ndarray, store: Datastore,
                 settings: KnnSettings, window: int, stride: int, batch_size: int = 4, device=None,
                 progress=None, max_chunks: int = 0, neighbours=None, k: int = 0):
    """ChunkScores of the kNN-LM on `chunks` (hashes (c,): each chunk's document text hash);
    neighbours, k: what a RETRO model reads for its LM term (paired_batches)."""
    head = head_nll(model)

    def nll_of(b: PairedBatch):
        d, v = store.neighbours(b.query, hashes[b.chunk], settings.k)
        p, has = knn_probability(d, v, b.lm.target.cpu().numpy(), settings.k, settings.temperature)
        return mixed_nll(head(b.lm), p, has, settings.lam)

    c = min(len(chunks), max_chunks or len(chunks))
    batches = paired_batches(model, chunks, window, stride, neighbours, k, batch_size=batch_size, device=device,
                             progress=progress, max_chunks=max_chunks)
    return accumulate(batches, nll_of, chunks, byte_lengths, c)
