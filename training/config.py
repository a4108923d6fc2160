"""Config of the models, training and evaluation (sections `model`, `train`, `eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from data.config import require


# Named model sizes: `--set` a preset's fields, or `ModelConfig.preset("gpt2-124m", kind="retro")`.
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
    # neighbours' token embeddings through to the CCA's output, training/retro.py
    # init_identity_path: learns to copy in tens of steps) or "normal" (GPT-2's N(0, 0.02)).
    retrieval_init: str = "identity"
    # RETRO only. The CCA's relative position bias is this constant times its parameter, so that
    # Adam moves it ~scale × lr per step: it must shift by whole logits for a layer to attend
    # "same position in the neighbour", which at the trunk's rate takes thousands of steps. (A
    # multiplier, not an optimizer group with its own rate: every stage keeps the same two groups,
    # training/param_groups.py.) 0 turns the bias off.
    position_bias_scale: float = 100.0

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


@dataclass
class TrainConfig:
    # Keys that change how a run is watched and kept, not what it computes: a rerun with other
    # values resumes the same run (training/run_dir.py; data/stage.py output_settings).
    RUNTIME_KEYS: ClassVar[tuple[str, ...]] = ("name", "eval_every", "eval_batches", "checkpoint_every",
                                               "keep_checkpoints")

    # Run name: the directory <workdir>/runs/<name>; "" = model.kind ("gpt2" or "retro").
    name: str = ""
    # Tokens per training sequence: a run of seq_len / data.chunk_len consecutive chunks.
    seq_len: int = 256
    # Sequences per micro-batch per data-parallel rank, and micro-batches per optimizer step
    # (gradient accumulation; the pipeline's schedule needs several to fill its stages).
    micro_batch_size: int = 4
    micro_batches: int = 4
    # Pipeline stages; the data-parallel degree is world size / pipeline_stages.
    pipeline_stages: int = 2
    # How layers are cut into stages: "cost" (estimated FLOPs; RETRO layers weigh more),
    # "uniform" (layer count) or "parameters".
    partition: str = "cost"
    # Optimizer steps; AdamW with linear warmup then cosine decay to min_lr. weight_decay applies
    # to matrices (>= 2 dims) only, not to biases and LayerNorm weights (training/param_groups.py).
    steps: int = 200
    lr: float = 1.0e-3
    min_lr: float = 1.0e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # "bf16", "fp16" (GPU only), "fp32", or "auto": bf16 where the hardware has bf16 matmuls
    # (GPUs that support it, CPUs with AVX512-BF16/AMX), else fp16 on older GPUs and fp32 on other CPUs
    # (CPU bf16 emulation is several times slower).
    precision: str = "auto"
    # CPU threads per process (training/hardware.py): "shared" = every process may use all cores
    # (a waiting pipeline stage lends its cores to the busy one), "split" = cores / processes each.
    # OMP_NUM_THREADS, when set, wins.
    cpu_threads: str = "shared"
    # Recompute activations every N layers in backward (0 = off): trades compute for memory.
    activation_checkpoint_interval: int = 0
    # The output head and cross-entropy fused, over slices of tokens (training/lm_head.py): the
    # logits of a whole micro-batch are never held at once. false = the plain path (all logits).
    fused_head: bool = True
    # Checkpoint every N steps and at the end; keep the newest K.
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    # Validation loss every N steps (0 = only at the end) over at most eval_batches micro-batches.
    eval_every: int = 50
    eval_batches: int = 8
    # Neighbours per chunk fed to RETRO during training (<= retrieval.k).
    neighbours: int = 2
    # Share of training chunks whose first neighbour is the chunk itself and its continuation
    # (RETRO only; never at evaluation): lessons in copying for text that offers few near-
    # duplicates, so the CCA learns to read a neighbour that holds the text (docs/results.md).
    self_neighbours: float = 0.0
    # Start from this GPT-2 checkpoint (ours or a Hugging Face directory); with
    # model.freeze_trunk it is a RETRO-fit: only chunked cross-attention and encoder train.
    init_from: str = ""
    # Start this run from another run's checkpoint: its run directory (newest checkpoint) or one
    # of its checkpoints/stepNNNNNN directories. Weights, optimizer state, step and RNG carry
    # over; the model, pipeline cut and process count must match (training/start.py).
    branch_from: str = ""
    seed: int = 1234
    # Deep-merged over the DeepSpeed JSON generated from this section (training/pipeline.py
    # deepspeed_config, saved as <run>/deepspeed_config.json), e.g.
    # {zero_optimization: {reduce_bucket_size: 50000000}}. Keys a train.* key sets are refused
    # (the error names the train.* key), as is ZeRO stage 2 or 3 (the pipeline engine's limit).
    deepspeed: dict = field(default_factory=dict)

    def __post_init__(self):
        require(self.seq_len >= 1, "train.seq_len", "must be >= 1")
        for key in ("micro_batch_size", "micro_batches", "pipeline_stages", "steps", "keep_checkpoints",
                    "checkpoint_every", "neighbours"):
            require(getattr(self, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(self.partition in ("cost", "uniform", "parameters"), "train.partition",
                f"must be 'cost', 'uniform' or 'parameters', got {self.partition!r}")
        require(self.cpu_threads in ("shared", "split"), "train.cpu_threads",
                f"must be 'shared' or 'split', got {self.cpu_threads!r}")
        require(self.precision in ("auto", "bf16", "fp16", "fp32"), "train.precision",
                f"must be 'auto', 'bf16', 'fp16' or 'fp32', got {self.precision!r}")
        require(0 < self.lr and 0 <= self.min_lr <= self.lr, "train.min_lr", "need 0 <= min_lr <= lr, lr > 0")
        require(0.0 <= self.self_neighbours <= 1.0, "train.self_neighbours", f"must lie in [0, 1], got {self.self_neighbours}")
        require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        require(self.eval_every >= 0 and self.eval_batches >= 1, "train.eval_every", "eval_every >= 0, eval_batches >= 1")
        require(self.activation_checkpoint_interval >= 0, "train.activation_checkpoint_interval", "must be >= 0")
        require(not (self.init_from and self.branch_from), "train.branch_from",
                "set train.init_from (weights only, from step 0) or train.branch_from (a whole training state), not both")
        require(isinstance(self.deepspeed, dict), "train.deepspeed",
                f"must be a mapping of DeepSpeed config keys, got {self.deepspeed!r}")


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

    def __post_init__(self):
        require(self.window >= 1 and 1 <= self.stride <= self.window, "eval.stride",
                f"need 1 <= stride <= window, got stride {self.stride}, window {self.window}")
        require(self.neighbours >= 1, "eval.neighbours", "must be >= 1")
        require(self.more_neighbours >= 0, "eval.more_neighbours", "must be >= 0")
        require(self.batch_size >= 1 and self.max_chunks >= 0, "eval.batch_size", "batch_size >= 1, max_chunks >= 0")
        require(all(0.0 <= f <= 1.0 for f in self.database_curve), "eval.database_curve",
                f"fractions must lie in [0, 1], got {self.database_curve}")


def resolve_precision(precision: str) -> str:
    """The precision "auto" stands for on this machine (training/hardware.py); others as they are."""
    from training.hardware import resolve_precision as resolve

    return resolve(precision)
