"""The evaluation rules: which rows a report holds, what each feeds the model, leakage, the database curve.

    report = evaluate_models([("gpt2", gpt2), ("retro", retro)], chunks, byte_lengths, cfg.eval, neighbours)

Rows, per model (bits per byte on the same chunks, training/evaluation/scoring.py):
    GPT-2:  "<label> (baseline)"          no neighbours
    RETRO:  "<label> RETRO[ON] k=K"       each chunk's own neighbours, K = eval.neighbours
            "<label> RETRO[OFF]"          none: every CCA adds an exact zero, the trunk alone
            "<label> RETRO[SHUFFLED]"     each chunk gets the K neighbours retrieved for a chunk of
                                          another document, as retrieved: neither lined up with this
                                          chunk nor filtered (data/reading.py, `shuffled`). Same count
                                          and shape, text that does not belong: a model that reads its
                                          neighbours well stays near OFF; ON below SHUFFLED is use of
                                          the neighbours' content.
            "<label> RETRO[ON] k=K2"      K2 = eval.more_neighbours, when larger than K
            "<label> RETRO[ON] k=K + kNN-LM"   with eval.retro_knn_lm: RETRO[ON] interpolated with a
                                          kNN over its own trunk's states of the database's tokens
Rivals (eval.rivals), per GPT-2 model, reading the same neighbours with no training:
            "<label> in-context k=K"      K = eval.in_context_neighbours, before the text (in_context.py)
            "<label> kNN-LM"              interpolated with a kNN over the database's tokens (knn_lm.py)
A GPT-2 trained with its neighbours in context (model.in_context = K, the in_context_trained rival):
            "<label> in-context trained k=K"   read as the in-context rival reads
Leakage: α per chunk against the neighbours it is predicted with (training/evaluation/leakage.py), and every
row's bits per byte per α bucket (cumulative, as the paper plots them) and per disjoint α slice. The database-size curve: RETRO[ON] of each RETRO model against
growing databases (`curve`: one neighbour source per database size).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from retropipe.training.evaluation.in_context import score_in_context
from retropipe.training.evaluation.knn_lm import build_datastore, score_knn_lm, tune
from retropipe.training.evaluation.leakage import alpha_buckets, alpha_slices, leakage
from retropipe.training.evaluation.scoring import ChunkScores, score_split


@dataclass
class Row:
    name: str
    model: object
    neighbours: object   # None, or a source of neighbour_tokens
    k: int
    rival: str | None = None   # "in_context", "knn_lm": how a GPT-2 reads the neighbours


@dataclass
class RivalInputs:
    """What the kNN-LM needs beyond the rows: the evaluated chunks' document text hashes (c,) and
    a FAISS index over keys (launch/evaluate.py: training never imports retrieval)."""
    chunk_hashes: np.ndarray
    index_builder: Callable


def report_rows(models: list[tuple[str, object]], eval_cfg, neighbours) -> list[Row]:
    """The rows the rules above give for these models (neighbours: the split's NeighbourStore)."""
    k, more = eval_cfg.neighbours, eval_cfg.more_neighbours
    rows = []
    for label, model in models:
        if model.cfg.in_context:  # a GPT-2 trained with its neighbours in context reads them so
            if neighbours is None:
                raise ValueError(f"{label} reads neighbours in its context (model.in_context): evaluating it needs them")
            rows.append(Row(f"{label} in-context trained k={model.cfg.in_context}", model, neighbours,
                            model.cfg.in_context, "in_context"))
            continue
        if not model.cfg.retrieves:
            rows.append(Row(f"{label} (baseline)", model, None, 0))
            if neighbours is not None and "in_context" in eval_cfg.rivals:
                kc = eval_cfg.in_context_neighbours
                rows.append(Row(f"{label} in-context k={kc}", model, neighbours, kc, "in_context"))
            if neighbours is not None and "knn_lm" in eval_cfg.rivals:
                rows.append(Row(f"{label} kNN-LM", model, neighbours, 0, "knn_lm"))
            continue
        if neighbours is None:
            raise ValueError(f"{label} is a RETRO model: evaluating it needs neighbours")
        rows += [Row(f"{label} RETRO[ON] k={k}", model, neighbours, k),
                 Row(f"{label} RETRO[OFF]", model, None, 0),
                 Row(f"{label} RETRO[SHUFFLED]", model, neighbours.read_as(neighbours.reading.but(shuffled=True)), k)]
        if more > k:
            rows.append(Row(f"{label} RETRO[ON] k={more}", model, neighbours, more))
        if eval_cfg.retro_knn_lm:
            rows.append(Row(f"{label} RETRO[ON] k={k} + kNN-LM", model, neighbours, k, "knn_lm"))
    return rows


def evaluate_models(models: list[tuple[str, object]], chunks, byte_lengths: np.ndarray, eval_cfg, neighbours=None,
                    curve: list[tuple[str, int, object]] | None = None, progress=None, device=None,
                    rivals: RivalInputs | None = None) -> dict:
    """Score every row on `chunks` (data.store.SplitChunks); the report as a JSON-able dict.

    curve: [(label, database tokens, neighbour source)] for the database-size curve (RETRO only).
    device: where the batches go (None = each model's own device). eval_cfg.precision: "bf16" or "fp32".
    rivals: needed for a kNN-LM row.
    """
    e = eval_cfg
    count = min(len(chunks), e.max_chunks or len(chunks))
    score = RowScorer(chunks, byte_lengths, e, progress, device, rivals)
    rows = []
    for row in report_rows(models, e, neighbours):
        s = score(row)
        rows.append({"model": row.name, "bits_per_byte": s.bits_per_byte(), "perplexity": s.perplexity(),
                     "tokens": int(s.tokens.sum()), "bytes": int(s.bytes.sum())})
    report = {"window": e.window, "stride": e.stride, "chunks": count, "precision": e.precision, "rows": rows,
              "alpha": None, "database_curve": None, "knn_lm": score.knn_settings or None}
    scores = score.scores
    if neighbours is not None:
        alpha = leakage(chunks, neighbours, e.neighbours, count)

        def per(groups, key):
            return [{key: label, "chunks": int(sel.sum()),
                     **{name: (s.bits_per_byte(sel) if sel.any() else None) for name, s in scores.items()}}
                    for label, sel in groups]
        report["alpha"] = {"buckets": per(alpha_buckets(alpha), "bucket"), "slices": per(alpha_slices(alpha), "slice"),
                           "mean": float(alpha.mean()) if count else 0.0}
    retro = [(label, model) for label, model in models if model.cfg.retrieves]
    if curve and retro:
        report["database_curve"] = database_curve(curve, retro, score, neighbours, chunks.split, count, e.neighbours)
    return report


class RowScorer:
    """row -> its ChunkScores, kept by name in .scores (the α tables read them all)."""

    def __init__(self, chunks, byte_lengths, eval_cfg, progress, device, rivals: RivalInputs | None):
        self.chunks, self.byte_lengths, self.e, self.progress, self.device = chunks, byte_lengths, eval_cfg, progress, device
        self.rivals = rivals
        self.autocast = scoring_precision(eval_cfg.precision)
        self.scores: dict[str, ChunkScores] = {}
        self.knn_settings: dict[str, dict] = {}

    def __call__(self, row: Row) -> ChunkScores:
        e, model = self.e, row.model
        bar = self.progress(row.name) if self.progress else None
        common = dict(batch_size=e.batch_size, device=self.device, progress=bar, max_chunks=e.max_chunks)
        with self.autocast(self.device or next(model.parameters()).device):
            if row.rival == "in_context":
                s = score_in_context(model, self.chunks, self.byte_lengths, e.window, row.neighbours, row.k, **common)
            elif row.rival == "knn_lm":
                s = self.knn_lm(row, common)
            else:
                s = score_split(model, self.chunks, self.byte_lengths, e.window, e.stride, row.neighbours, row.k,
                                **common)
        self.scores[row.name] = s
        return s

    def knn_lm(self, row: Row, common: dict) -> ChunkScores:
        """The kNN-LM row: its datastore over the neighbours' database, tuned on the training split."""
        if self.rivals is None:
            raise ValueError("eval.rivals: the kNN-LM row needs the evaluated chunks' document hashes and a "
                             "FAISS index builder (RivalInputs)")
        e, model, database = self.e, row.model, row.neighbours.database
        train = database.parts[0]
        # RETRO's LM term reads its neighbours, on the tuning chunks too: the training split's own.
        reads = dict(neighbours=row.neighbours, k=row.k) if model.cfg.retrieves else {}
        if reads and row.neighbours.chunk_store.root.resolve() != train.store.root.resolve():
            raise ValueError(f"{row.name}: λ, k and T are tuned on the database's training split with RETRO "
                             f"reading its neighbours, which only the build's own database holds "
                             f"(eval.retro_knn_lm: evaluate against it, without --database or --corpus)")
        bar = self.progress(f"{row.name} datastore") if self.progress else None
        store = build_datastore(model, database, e.window, e.stride, self.rivals.index_builder, e.batch_size,
                                self.device, bar)
        settings = tune(model, train.split, database.text_hashes[:train.chunks], store, e.window, e.stride,
                        e.knn_lm_tune_chunks, e.batch_size, self.device, **reads)
        self.knn_settings[row.name] = {**settings.as_dict(), "datastore_entries": len(store)}
        return score_knn_lm(model, self.chunks, self.byte_lengths, self.rivals.chunk_hashes, store, settings,
                            e.window, e.stride, **common, **reads)


def database_curve(curve, retro, score: RowScorer, neighbours, split: str, count: int, k: int) -> dict:
    """RETRO[ON] of each RETRO model against each database size of `curve`."""
    points = []
    for size_label, tokens, source in curve:
        point = {"database": size_label, "tokens": int(tokens)}
        # The whole database reads what RETRO[ON] read (the build's own neighbours, searched
        # again): the same inputs to a deterministic model, so its scores are reused, not recomputed.
        same = neighbours is not None and same_neighbour_tokens(source, neighbours, split, count, k)
        for label, model in retro:
            on = f"{label} RETRO[ON] k={k}"
            point[label] = (score.scores[on] if same else
                            score(Row(f"{on} ({size_label})", model, source, k))).bits_per_byte()
        points.append(point)
    return {"models": [label for label, _ in retro], "points": points}


def scoring_precision(precision: str) -> Callable[[object], contextlib.AbstractContextManager]:
    """device -> the context scoring runs in: autocast to bf16 on that device for "bf16", nothing
    for "fp32". "auto" is resolved for the device first (launch/evaluate.py scoring_precision_on)."""
    if precision == "fp32":
        return lambda device: contextlib.nullcontext()
    if precision == "bf16":
        return lambda device: torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"eval.precision {precision!r}: scoring runs in 'bf16' or 'fp32'; 'auto' is resolved "
                     f"for the device first (launch/evaluate.py scoring_precision_on)")


def same_neighbour_tokens(source, other, split: str, count: int, k: int, block: int = 4096) -> bool:
    """Whether two neighbour sources hand the first `count` chunks of `split` the same k
    neighbours' tokens (compared a block of chunks at a time: a big split's would not fit at once)."""
    for start in range(0, count, block):
        ids = np.arange(start, min(start + block, count))[None]                       # (1, c)
        if not np.array_equal(source.neighbour_tokens(split, ids, k), other.neighbour_tokens(split, ids, k)):
            return False
    return True
