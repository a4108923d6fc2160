"""The `train` config section: how a training run goes (steps, optimizer, pipeline, precision, checkpoints)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from retropipe.data.config import require
from retropipe.training.run.lessons import Lessons


@dataclass
class TrainConfig:
    # Keys that change how a run is watched and kept, not what it computes: a rerun with other
    # values resumes the same run (training/run/run_dir.py; data/stage.py output_settings).
    RUNTIME_KEYS: ClassVar[tuple[str, ...]] = ("name", "eval_every", "eval_batches", "checkpoint_every",
                                               "keep_checkpoints", "dist_timeout", "preempt_grace",
                                               # how the model is cut and spread: a checkpoint resumes
                                               # on any of them (training/run/start.py)
                                               "pipeline_stages", "partition")
    # What dist_timeout 0 stands for. GPU: torch's own NCCL default, room for a large model's
    # checkpoint write on network storage. CPU: the models a CPU trains write a checkpoint in
    # seconds and send a micro-batch in well under a minute.
    AUTO_DIST_TIMEOUT: ClassVar[dict[str, float]] = {"cuda": 600.0, "cpu": 300.0}

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
    # to matrices (>= 2 dims) only, not to biases and LayerNorm weights (training/pipeline/param_groups.py).
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
    # CPU threads per process (training/run/hardware.py): "shared" = every process may use all cores
    # (a waiting pipeline stage lends its cores to the busy one), "split" = cores / processes each.
    # OMP_NUM_THREADS, when set, wins.
    cpu_threads: str = "shared"
    # Recompute activations every N layers in backward (0 = off): trades compute for memory.
    activation_checkpoint_interval: int = 0
    # The output head and cross-entropy fused, over slices of tokens (training/models/lm_head.py): the
    # logits of a whole micro-batch are never held at once. false = the plain path (all logits).
    fused_head: bool = True
    # torch.compile each transformer block of a stage, in place, as DeepSpeed's
    # PipelineModule.compile does each layer (the other layers, lookups and the fused head, stay
    # eager): it fuses the elementwise work around the matmuls, most of RETRO's encoder on a GPU.
    # The first step compiles (on a CPU a minute or more, with a C++ compiler). Off by default: on a
    # CPU it gains nothing measurable. On a GPU try it for RETRO: through the engine on an H200,
    # RETRO small 1.19x the tokens/s (docs/benchmarks.md).
    compile: bool = False
    # Checkpoint every N steps and at the end; keep the newest K.
    # Sequences an optimizer step trains on. 0: micro_batch_size × micro_batches × the data-parallel
    # replicas of the job; set, micro_batches follows from the replicas (it must divide). A resumed
    # run keeps its checkpoint's global batch on any number of replicas (training/run/start.py).
    global_batch: int = 0
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
    # Shares of training chunks whose first neighbour is the chunk itself diverging, from a random
    # token of its continuation on, into another document's text; and another document's chunk
    # (RETRO only): lessons in not copying what stops matching, or never matched
    # (training/run/lessons.py). The three shares add up to at most 1. distractor_neighbours
    # "auto": LEXICAL_DISTRACTORS for a model trained on bm25 or hybrid neighbours (RETRO, or a
    # GPT-2 with them in context), else 0 (resolved by `resolve_auto_lessons` as the config loads).
    diverging_neighbours: float = 0.0
    distractor_neighbours: float | str = "auto"
    # Start from this GPT-2 checkpoint (ours or a Hugging Face directory); with
    # model.freeze_trunk it is a RETRO-fit: only chunked cross-attention and encoder train.
    init_from: str = ""
    # Start this run from another run's checkpoint: its run directory (newest checkpoint) or one
    # of its checkpoints/stepNNNNNN directories. Weights, optimizer state, step and RNG carry
    # over; the model, pipeline cut and process count must match (training/run/start.py).
    branch_from: str = ""
    seed: int = 1234
    # Seconds a rank may go without a sign of another before the whole job ends (every process
    # exits non-zero, naming the lost rank: training/run/cluster.py); collectives time out after
    # about twice it (collective_timeout). Longer than any wait of a healthy run: a checkpoint write, a validation
    # pass, the slowest stage's micro-batches. 0 = AUTO_DIST_TIMEOUT (GPU 600 s, CPU 300 s).
    dist_timeout: float = 0.0
    # Seconds from a scheduler's SIGTERM or SIGUSR1 until every process is gone: the ranks finish
    # their step, write its checkpoint and exit 75 (training/run/preemption.py). DeepSpeed's launcher
    # kills its ranks 30 s after it is itself sent SIGTERM, whatever this says.
    preempt_grace: float = 60.0
    # Deep-merged over the DeepSpeed JSON generated from this section (training/pipeline/deepspeed_engine.py
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
        self._check_lessons()
        require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        require(self.global_batch >= 0, "train.global_batch", f"must be >= 0 (0: micro-batches × replicas), "
                f"got {self.global_batch}")
        require(self.eval_every >= 0 and self.eval_batches >= 1, "train.eval_every", "eval_every >= 0, eval_batches >= 1")
        require(self.activation_checkpoint_interval >= 0, "train.activation_checkpoint_interval", "must be >= 0")
        require(not (self.init_from and self.branch_from), "train.branch_from",
                "set train.init_from (weights only, from step 0) or train.branch_from (a whole training state), not both")
        require(self.dist_timeout == 0 or self.dist_timeout >= 10, "train.dist_timeout",
                f"must be 0 (auto) or at least 10 seconds, got {self.dist_timeout}")
        require(self.preempt_grace >= 1, "train.preempt_grace", f"must be at least 1 second, got {self.preempt_grace}")
        require(isinstance(self.deepspeed, dict), "train.deepspeed",
                f"must be a mapping of DeepSpeed config keys, got {self.deepspeed!r}")

    def _check_lessons(self) -> None:
        require(self.distractor_neighbours == "auto" or not isinstance(self.distractor_neighbours, str),
                "train.distractor_neighbours", f"must be a share in [0, 1] or 'auto', got {self.distractor_neighbours!r}")
        shares = {key: getattr(self, key) for key in ("self_neighbours", "diverging_neighbours", "distractor_neighbours")}
        shares = {key: share for key, share in shares.items() if share != "auto"}
        for key, share in shares.items():
            require(0.0 <= share <= 1.0, f"train.{key}", f"must lie in [0, 1], got {share}")
        require(sum(shares.values()) <= 1.0 + 1e-9, "train.distractor_neighbours", "train.self_neighbours, "
                "diverging_neighbours and distractor_neighbours add up to more than 1")

    @property
    def lessons(self) -> Lessons:
        """The lessons' shares (training/run/lessons.py); "auto" must have been resolved."""
        if self.distractor_neighbours == "auto":
            raise ValueError("train.distractor_neighbours 'auto' is resolved as the config loads (resolve_auto_lessons)")
        return Lessons(self.self_neighbours, self.diverging_neighbours, self.distractor_neighbours)

    def resolved_dist_timeout(self, device: str) -> float:
        """dist_timeout in seconds on this device ("cuda" or "cpu")."""
        return self.dist_timeout or self.AUTO_DIST_TIMEOUT[device]


# The share of distractor lessons that "auto" gives RETRO reading lexical neighbours. BM25 finds
# chunks that share words with the query but not its text (the same identifiers in other code);
# without lessons RETRO leaned on them: SHUFFLED cost +2.0-2.1% over OFF. A tenth brought it to
# +1.4-1.7% and lowered RETRO[ON] on both seeds (docs/results.md, "Design decisions"); dense
# neighbours gained nothing from them (at 0.25 they cost gain on the demo).
LEXICAL_DISTRACTORS = 0.1


def resolve_auto_lessons(train: TrainConfig, reads_neighbours: bool, lexical: bool) -> TrainConfig:
    """The train section with distractor_neighbours "auto" made a share (validated again).
    reads_neighbours: the model trains on neighbours (RETRO, or a GPT-2 with them in context);
    lexical: they are found by BM25 (retrieval/methods lexical: bm25, hybrid)."""
    if train.distractor_neighbours != "auto":
        return train
    share = LEXICAL_DISTRACTORS if reads_neighbours and lexical else 0.0
    room = max(1.0 - train.self_neighbours - train.diverging_neighbours, 0.0)  # the shares add up to at most 1
    return dataclasses.replace(train, distractor_neighbours=round(min(share, room), 6))
