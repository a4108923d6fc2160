"""Config of the models, training and evaluation (sections `model`, `train`, `eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from data.config import require


@dataclass
class ModelConfig:
    # "gpt2" (baseline decoder) or "retro" (decoder + chunked cross-attention over neighbours).
    kind: str = "gpt2"
    vocab_size: int = 50257
    n_positions: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    # RETRO only. Layers (1-indexed) holding chunked cross-attention; [] = paper default
    # (every third layer from 6 for 12-layer models, from 9 for deeper ones).
    retro_layers: list[int] = field(default_factory=list)
    # Retrieval encoder: bidirectional layers over each neighbour, and their width/heads.
    encoder_layers: int = 2
    encoder_embd: int = 384
    encoder_head: int = 6
    # Tokens per chunk; copied from data.chunk_len by launch/config.py (one source of truth).
    chunk_len: int = 64

    def __post_init__(self):
        require(self.kind in ("gpt2", "retro"), "model.kind", f"must be 'gpt2' or 'retro', got {self.kind!r}")
        require(self.n_embd % self.n_head == 0, "model.n_embd",
                f"{self.n_embd} is not divisible by model.n_head ({self.n_head})")
        require(self.encoder_embd % self.encoder_head == 0, "model.encoder_embd",
                f"{self.encoder_embd} is not divisible by model.encoder_head ({self.encoder_head})")
        require(self.n_layer >= 1, "model.n_layer", "must be >= 1")
        require(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")
        for layer in self.retro_layers:
            require(1 <= layer <= self.n_layer, "model.retro_layers",
                    f"layer {layer} is outside 1..model.n_layer ({self.n_layer})")


@dataclass
class TrainConfig:
    # Tokens per training sequence: a run of seq_len / data.chunk_len consecutive chunks.
    seq_len: int = 256
    seed: int = 1234

    def __post_init__(self):
        require(self.seq_len >= 1, "train.seq_len", "must be >= 1")


@dataclass
class EvalConfig:
    # Sliding-window stride for evaluation, in tokens (RETRO paper: 2048 window, 1024 stride).
    stride: int = 128

    def __post_init__(self):
        require(self.stride >= 1, "eval.stride", "must be >= 1")
