"""The `eval` config section: how trained models are scored (training/evaluation/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from retropipe.data.config import require


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
