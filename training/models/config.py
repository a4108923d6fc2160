"""The `model` config section: the shape and options of GPT-2 and RETRO (training/models/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from retropipe.data.config import require

MODEL_PRESETS: dict[str, dict] = {
    # A few-minute CPU model: 4 layers of width 128 (CCA at layers 2 and 4 for RETRO).
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, n_positions=1024, encoder_layers=2,
                 encoder_embd=64, encoder_head=2),
    # The released GPT-2 small (124,439,808 parameters); RETRO adds CCA at layers 6, 9, 12.
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, encoder_layers=2,
                      encoder_embd=384, encoder_head=6),
    # GPT-2 medium; RETRO adds CCA at layers 9, 12, ..., 24.
    "gpt2-355m": dict(n_layer=24, n_head=16, n_embd=1024, n_positions=1024, encoder_layers=2,
                      encoder_embd=512, encoder_head=8),
}


# Model kinds that read retrieved neighbours.
RETRIEVING_KINDS = ("retro",)
# The shape a warm start (train.init_from, a RETRO-fit) must share with the model it starts: the trunk's.
TRUNK_FIELDS = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")


# Fields whose default is not what a model had before the field existed: a config.json or a run's
# config.yaml written then, which lacks the field, means this value.
BEFORE_THE_FIELD = {"copy_gate": False}


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
    # Standard deviation of the token embedding's N(0, std) start (GPT-2: 0.02). The embedding is
    # also the output head, and AdamW moves every row of it each step, rarely seen tokens' rows
    # all the same way; a row's own direction is what lets RETRO copy the token from a neighbour.
    # At narrow widths 0.02 leaves too little of it (std · sqrt(n_embd) = 0.23 at 128), so the
    # tiny configs start at 0.1 (docs/results.md, "Rare tokens").
    embedding_init_std: float = 0.02
    # RETRO only. Layers (1-indexed) holding chunked cross-attention; [] = default, see cca_layers().
    retro_layers: list[int] = field(default_factory=list)
    # Retrieval encoder: bidirectional layers over each neighbour, and their width/heads.
    encoder_layers: int = 2
    encoder_embd: int = 384
    encoder_head: int = 6
    # Tokens per chunk; copied from data.chunk_len by launch/config.py (one source of truth).
    chunk_len: int = 64
    # RETRO only. Base of the rotary position encoding in the encoder and the CCA.
    rotary_base: float = 10000.0
    # RETRO-fit (paper section 4.2): the GPT-2 trunk is frozen; only CCA and encoder train.
    freeze_trunk: bool = False
    # RETRO only. How the retrieval parameters start: "identity" (the encoder carries the
    # neighbours' token embeddings through to the CCA's output, training/models/retro.py
    # init_identity_path: learns to copy in tens of steps) or "normal" (GPT-2's N(0, 0.02)).
    retrieval_init: str = "identity"
    # RETRO only. The CCA's relative position bias is this constant times its parameter, so that
    # Adam moves it ~scale × lr per step: it must shift by whole logits for a layer to attend
    # "same position in the neighbour", which at the trunk's rate takes thousands of steps. (A
    # multiplier, not an optimizer group with its own rate: every stage keeps the same two groups,
    # training/pipeline/param_groups.py.) 0 turns the bias off.
    position_bias_scale: float = 100.0
    # RETRO only. The copy gate (training/models/cca.py): the CCA sees where a neighbour's
    # previous tokens are the query's last ones and may attend to a null slot instead, so it copies
    # a neighbour where the neighbour keeps matching the text, not where it diverges or never
    # belonged: without it, neighbours that do not hold the text make RETRO worse than reading none
    # (docs/results.md, "Doing no harm").
    copy_gate: bool = True
    # GPT-2 only. Neighbours (each with its continuation) the model reads before its text, at
    # training and at evaluation, as the in-context rival does (data/reading.py in_context_tokens):
    # the in-context-trained rival; 0 = a plain GPT-2.
    in_context: int = 0

    def __post_init__(self):
        require(self.kind in ("gpt2", "retro"), "model.kind", f"must be 'gpt2' or 'retro', got {self.kind!r}")
        require(self.n_embd % self.n_head == 0, "model.n_embd",
                f"{self.n_embd} is not divisible by model.n_head ({self.n_head})")
        require(self.encoder_embd % self.encoder_head == 0, "model.encoder_embd",
                f"{self.encoder_embd} is not divisible by model.encoder_head ({self.encoder_head})")
        require(self.n_layer >= 1, "model.n_layer", "must be >= 1")
        require(self.vocab_size >= 1 and self.n_positions >= 1, "model.vocab_size", "vocab_size and n_positions must be >= 1")
        require(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")
        require(self.embedding_init_std > 0, "model.embedding_init_std", "must be > 0")
        require(self.chunk_len >= 1, "model.chunk_len", "must be >= 1")
        for layer in self.retro_layers:
            require(1 <= layer <= self.n_layer, "model.retro_layers",
                    f"layer {layer} is outside 1..model.n_layer ({self.n_layer})")
        require(len(set(self.retro_layers)) == len(self.retro_layers), "model.retro_layers", "has duplicates")
        if self.kind == "retro":
            # Rotary encodings rotate pairs of features, so heads need an even width.
            require((self.n_embd // self.n_head) % 2 == 0, "model.n_head", "RETRO needs an even head width n_embd / n_head")
            require((self.encoder_embd // self.encoder_head) % 2 == 0, "model.encoder_head",
                    "RETRO needs an even encoder head width encoder_embd / encoder_head")
            require(self.encoder_layers >= 1, "model.encoder_layers", "must be >= 1 for RETRO")
        require(not self.freeze_trunk or self.kind == "retro", "model.freeze_trunk", "only applies to kind 'retro'")
        require(self.in_context >= 0 and (self.in_context == 0 or self.kind == "gpt2"), "model.in_context",
                f"must be >= 0, and only a GPT-2 reads neighbours in its context, got {self.in_context} for {self.kind!r}")
        require(self.position_bias_scale >= 0, "model.position_bias_scale", "must be >= 0")
        require(self.retrieval_init in ("identity", "normal"), "model.retrieval_init",
                f"must be 'identity' or 'normal', got {self.retrieval_init!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        require(name in MODEL_PRESETS, "model.preset", f"unknown preset {name!r} (known: {', '.join(MODEL_PRESETS)})")
        return cls(**{**MODEL_PRESETS[name], **overrides})

    def cca_layers(self) -> list[int]:
        """RETRO layers (1-indexed, sorted) holding chunked cross-attention.

        Paper default: every third layer from 6 for 12 layers ({6, 9, 12}), from 9 for deeper
        models. Below 12 layers: every other layer counting back from the last, down to the
        middle (n_layer // 2), e.g. {2, 4} for 4 layers, so the first half stays plain decoder.
        """
        if self.retro_layers:
            return sorted(self.retro_layers)
        if self.n_layer >= 12:
            return list(range(6 if self.n_layer == 12 else 9, self.n_layer + 1, 3))
        floor = max(self.n_layer // 2, 1)
        return sorted(range(self.n_layer, floor - 1, -2))

    def cca_blocks(self) -> list[int]:
        """The same layers as indices (0-based, sorted) into the model's blocks."""
        return [i - 1 for i in self.cca_layers()]

    @property
    def retrieves(self) -> bool:
        """Whether the model reads retrieved neighbours (RETRO): evaluation adds its ON / OFF /
        SHUFFLED rows, training and generation hand it neighbours."""
        return self.kind in RETRIEVING_KINDS

    def trunk_differences(self, other: "ModelConfig") -> list[str]:
        """The trunk fields (TRUNK_FIELDS) where other differs: "model.n_layer 4 vs 2", ..."""
        return [f"model.{k} {getattr(self, k)} vs {getattr(other, k)}" for k in TRUNK_FIELDS
                if getattr(self, k) != getattr(other, k)]
