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

from retropipe.training.evaluation.leakage import alpha_buckets, alpha_slices, leakage
from retropipe.training.evaluation.scoring import ChunkScores, score_split


@dataclass
class Row:
    name: str
    model: object
    neighbours: object   # None, or a source of neighbour_tokens
    k: int


def report_rows(models: list[tuple[str, object]], eval_cfg, neighbours) -> list[Row]:
    """The rows the rules above give for these models (neighbours: the split's NeighbourStore)."""
    k, more = eval_cfg.neighbours, eval_cfg.more_neighbours
    rows = []
    for label, model in models:
        if not model.cfg.retrieves:
            rows.append(Row(f"{label} (baseline)", model, None, 0))
            continue
        if neighbours is None:
            raise ValueError(f"{label} is a RETRO model: evaluating it needs neighbours")
        rows += [Row(f"{label} RETRO[ON] k={k}", model, neighbours, k),
                 Row(f"{label} RETRO[OFF]", model, None, 0),
                 Row(f"{label} RETRO[SHUFFLED]", model, neighbours.read_as(neighbours.reading.but(shuffled=True)), k)]
        if more > k:
            rows.append(Row(f"{label} RETRO[ON] k={more}", model, neighbours, more))
    return rows


def evaluate_models(models: list[tuple[str, object]], chunks, byte_lengths: np.ndarray, eval_cfg, neighbours=None,
                    curve: list[tuple[str, int, object]] | None = None, progress=None, device=None) -> dict:
    """Score every row on `chunks` (data.store.SplitChunks); the report as a JSON-able dict.

    curve: [(label, database tokens, neighbour source)] for the database-size curve (RETRO only).
    device: where the batches go (None = each model's own device). eval_cfg.precision: "bf16" or "fp32".
    """
    e = eval_cfg
    count = min(len(chunks), e.max_chunks or len(chunks))
    scores: dict[str, ChunkScores] = {}
    autocast = scoring_precision(e.precision)

    def score(name, model, source, k):
        bar = progress(name) if progress else None
        with autocast(device or next(model.parameters()).device):
            scores[name] = score_split(model, chunks, byte_lengths, e.window, e.stride, source, k, e.batch_size,
                                       device=device, progress=bar, max_chunks=e.max_chunks)
        return scores[name]

    rows = []
    for row in report_rows(models, e, neighbours):
        s = score(row.name, row.model, row.neighbours, row.k)
        rows.append({"model": row.name, "bits_per_byte": s.bits_per_byte(), "perplexity": s.perplexity(),
                     "tokens": int(s.tokens.sum()), "bytes": int(s.bytes.sum())})
    report = {"window": e.window, "stride": e.stride, "chunks": count, "precision": e.precision, "rows": rows,
              "alpha": None, "database_curve": None}
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
        points = []
        for size_label, tokens, source in curve:
            point = {"database": size_label, "tokens": int(tokens)}
            # The whole database reads what RETRO[ON] read (the build's own neighbours, searched
            # again): the same inputs to a deterministic model, so its scores are reused, not recomputed.
            same = neighbours is not None and same_neighbour_tokens(source, neighbours, chunks.split, count, e.neighbours)
            for label, model in retro:
                on = f"{label} RETRO[ON] k={e.neighbours}"
                point[label] = (scores[on] if same else
                                score(f"{on} ({size_label})", model, source, e.neighbours)).bits_per_byte()
            points.append(point)
        report["database_curve"] = {"models": [label for label, _ in retro], "points": points}
    return report


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
