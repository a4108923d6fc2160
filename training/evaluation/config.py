"""The `eval` config section: how trained models are scored (training/evaluation/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from retropipe.data.config import require


# The rivals a report can hold: each reads RETRO's neighbours with the baseline GPT-2, untrained.
# in_context_trained: a GPT-2 trained with its neighbours in context (model.in_context), which
# launch/demo.py trains when asked; launch/evaluate.py scores any such checkpoint given to it.
RIVALS = ("in_context", "knn_lm", "in_context_trained")


@dataclass
class EvalConfig:
    # Sliding window and stride in tokens, multiples of data.chunk_len (RETRO paper: 2048 / 1024).
    window: int = 256
    stride: int = 128
    # Neighbours per chunk for RETRO[ON]; a second RETRO row uses eval.more_neighbours (0 = skip).
    neighbours: int = 2
    more_neighbours: int = 0
    batch_size: int = 4
    # Evaluate at most this many chunks of the split (0 = all): for quick looks at big corpora.
    max_chunks: int = 0
    # The database-size curve: RETRO[ON] against the training split plus these fractions of the
    # further corpora's documents (retrieval.corpora), e.g. [0, 0.125, 0.25, 0.5, 1]; [] = none.
    database_curve: list[float] = field(default_factory=list)
    # Scoring precision: "bf16" (autocast, the head's softmax too), "fp32", or "auto": bf16 where
    # the device scored on computes it in hardware (AVX512-BF16 / AMX CPUs, Ampere and newer
    # GPUs), else fp32; launch/evaluate.py resolves it. The demo's figures agree within 0.0002
    # bits per byte.
    precision: str = "auto"
    # Rivals that read the same neighbours, as rows beside RETRO's: "in_context" and "knn_lm", the
    # baseline GPT-2 with no training (training/evaluation/in_context.py, knn_lm.py), and
    # "in_context_trained" (RIVALS above); [] = none.
    rivals: list[str] = field(default_factory=list)
    # Neighbours (each with its continuation) the in-context rival puts before its text; the rest
    # of eval.window holds the text, in whole chunks.
    in_context_neighbours: int = 1
    # Chunks of the training split on which the kNN-LM's λ, k and temperature are chosen.
    knn_lm_tune_chunks: int = 256
    # A row per RETRO model: RETRO[ON] interpolated with a kNN-LM over its own trunk's datastore
    # (training/evaluation/knn_lm.py); the build's own database only (its training split tunes it).
    retro_knn_lm: bool = False

    def __post_init__(self):
        require(self.window >= 1 and 1 <= self.stride <= self.window, "eval.stride",
                f"need 1 <= stride <= window, got stride {self.stride}, window {self.window}")
        require(self.neighbours >= 1, "eval.neighbours", "must be >= 1")
        require(self.more_neighbours >= 0, "eval.more_neighbours", "must be >= 0")
        require(self.batch_size >= 1 and self.max_chunks >= 0, "eval.batch_size", "batch_size >= 1, max_chunks >= 0")
        require(all(0.0 <= f <= 1.0 for f in self.database_curve), "eval.database_curve",
                f"fractions must lie in [0, 1], got {self.database_curve}")
        require(self.precision in ("auto", "bf16", "fp32"), "eval.precision",
                f"must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        unknown = [r for r in self.rivals if r not in RIVALS]
        require(not unknown, "eval.rivals", f"unknown rival(s) {unknown}; the rivals are {list(RIVALS)}")
        require(self.in_context_neighbours >= 1, "eval.in_context_neighbours", "must be >= 1")
        require(self.knn_lm_tune_chunks >= 1, "eval.knn_lm_tune_chunks", "must be >= 1")
