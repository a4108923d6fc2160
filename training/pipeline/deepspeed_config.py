"""DeepSpeed's JSON config: generated from the `train` section, with `train.deepspeed` merged over it.

    deepspeed_config(train) -> dict      # what training/pipeline/deepspeed_engine.py hands deepspeed.initialize

Plain dicts, no DeepSpeed import: launch/train.py checks it before any process starts, and a
ConfigError names the key. What is checked, and why:
- ZeRO stage 2 or 3: DeepSpeed's pipeline engine supports stage 0 and 1 only. Stage 2 reduces and
  partitions gradients by hooks as backward produces them, stage 3 also partitions parameters and
  re-gathers them around every forward; the pipeline engine runs its own per-micro-batch schedule
  and reduces gradients once per step, and asserts stage < 2. The pipeline already splits the
  weights across stages; ZeRO-1 splits the optimizer state across data-parallel replicas.
- Stage 0 with clipping on several stages (DeepSpeed then clips by the first stage's gradient norm
  only) and stage 0 with bf16 (DeepSpeed accumulates bf16 gradients in fp32 only under ZeRO-1).
- Keys that a train.* key sets (batch sizes, accumulation, clipping, precision, lr, betas, weight
  decay, the schedule's length and warmup): the error names the train.* key to set instead.
"""

from __future__ import annotations

from retropipe.data.errors import ConfigError
from retropipe.training.run.config import TrainConfig


def generated_config(train: TrainConfig) -> dict:
    """DeepSpeed's JSON config, generated from ours (never kept by hand beside it)."""
    precision = train.precision
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.micro_batches,
        # immediate_grad_update off: each micro-batch's bf16 gradients are added to the fp32 ones in one
        # call after its backward and let go (training/pipeline/bf16_grads.py), not from a Python hook
        # per parameter during it, which a GPU's host pays for (docs/benchmarks.md).
        "bf16": {"enabled": precision == "bf16", "immediate_grad_update": False},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 16},
        # bf16: fp32 master weights *and* fp32 gradient accumulation (BF16_Optimizer).
        **({"data_types": {"grad_accum_dtype": "fp32"}} if precision == "bf16" else {}),
        "zero_optimization": {"stage": 1},
        "gradient_clipping": train.grad_clip,
        # torch_adam: torch.optim.AdamW, no C++ op to build on a fresh machine; fused: its one-kernel
        # step (CPU and CUDA), 7-9x faster than the per-tensor step on a 40M-parameter stage here,
        # which allocates a temporary the size of the parameters (docs/benchmarks.md).
        "optimizer": {"type": "AdamW", "params": {"lr": train.lr, "betas": [train.beta1, train.beta2],
                                                  "eps": 1e-8, "weight_decay": train.weight_decay,
                                                  "torch_adam": True, "fused": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": train.steps, "warmup_num_steps": max(train.warmup_steps, 1),
            "warmup_min_ratio": 0.0, "cos_min_ratio": train.min_lr / train.lr, "warmup_type": "linear"}},
        # Non-reentrant recomputation: a checkpointed range of layers inside a stage passes RETRO's
        # two float tensors (hidden states, neighbour states), which reentrant checkpointing cannot.
        "pipeline": {"use_reentrant": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


# DeepSpeed keys that a train.* key already sets: train.deepspeed may not say otherwise.
OWNED_KEYS = {
    "train_batch_size": "train.micro_batch_size and train.micro_batches (the global batch is their product "
                        "× the data-parallel degree)",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.micro_batches",
    "gradient_clipping": "train.grad_clip",
    "bf16.enabled": "train.precision", "fp16.enabled": "train.precision",
    "optimizer.params.lr": "train.lr", "optimizer.params.weight_decay": "train.weight_decay",
    "optimizer.params.betas": "train.beta1 and train.beta2",
    "scheduler.params.total_num_steps": "train.steps", "scheduler.params.warmup_num_steps": "train.warmup_steps",
    "scheduler.params.cos_min_ratio": "train.min_lr (as a fraction of train.lr)",
}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.update(_flatten(value, path + ".") if isinstance(value, dict) and value else {path: value})
    return out


def _merge(base: dict, over: dict) -> dict:
    """`over` deep-merged into a copy of `base` (mappings merge, anything else replaces)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(train: TrainConfig) -> dict:
    """The generated config with train.deepspeed deep-merged over it, checked against what the
    pipeline engine supports and what train.* keys already set (a ConfigError naming the key).

    An optimizer or scheduler of another `type` takes its own `params`: ours apply to AdamW and
    WarmupCosineLR only (the optimizer keeps train.lr and train.weight_decay).
    """
    over, ours = train.deepspeed, generated_config(train)
    for section in ("optimizer", "scheduler"):
        if isinstance(over.get(section), dict) and over[section].get("type", ours[section]["type"]) != ours[section]["type"]:
            params = {"lr": train.lr, "weight_decay": train.weight_decay} if section == "optimizer" else {}
            ours[section] = {"type": over[section]["type"], "params": params}
    generated = _flatten(ours)
    for key, value in _flatten(over).items():
        if not isinstance(value, dict) and any(g.startswith(key + ".") for g in generated):
            raise ConfigError(f"train.deepspeed.{key}", f"{value!r} would replace a whole section of the generated "
                              f"config; give the keys inside it")
        for owned, instead in OWNED_KEYS.items():
            # train_batch_size is never generated (DeepSpeed derives it); the rest only where generated.
            if key == owned and (owned == "train_batch_size" or (owned in generated and generated[owned] != value)):
                raise ConfigError(f"train.deepspeed.{owned}", f"is set by {instead}; set that instead "
                                  f"(generated: {generated.get(owned)!r}, given: {value!r})")
    merged = _merge(ours, over)
    opt = merged.get("optimizer", {}).get("params", {}) if isinstance(merged.get("optimizer"), dict) else {}
    if isinstance(opt, dict) and not opt.get("torch_adam") and "optimizer.params.fused" not in _flatten(over):
        opt.pop("fused", None)  # ours is torch's argument: DeepSpeed's own Adam classes take none
    stage = merged.get("zero_optimization", {}).get("stage") if isinstance(merged.get("zero_optimization"), dict) \
        else None
    if stage not in (0, 1):
        raise ConfigError("train.deepspeed.zero_optimization.stage", f"{stage!r}: DeepSpeed's pipeline engine "
                          "supports ZeRO stage 0 or 1 only. Stage 2 reduces and partitions gradients by hooks "
                          "as backward produces them, stage 3 also partitions (and re-gathers) parameters around "
                          "every forward; the pipeline engine runs its own per-micro-batch schedule and reduces "
                          "gradients once per step, and refuses both. The pipeline already splits the weights "
                          "across stages; ZeRO-1 splits the optimizer state across data-parallel replicas")
    if stage == 0 and train.grad_clip > 0 and train.pipeline_stages > 1:
        raise ConfigError("train.deepspeed.zero_optimization.stage", "0 with train.grad_clip > 0 on more than "
                          "one pipeline stage: without ZeRO, DeepSpeed clips by the gradient norm of the first "
                          "stage only (it counts model-parallel rank 0's gradients), so every stage would be "
                          "clipped by a wrong norm; keep stage 1 or set train.grad_clip=0")
    if stage == 0 and train.precision == "bf16" and merged.get("data_types", {}).get("grad_accum_dtype") == "fp32":
        raise ConfigError("train.deepspeed.zero_optimization.stage", "0 with train.precision=bf16: DeepSpeed "
                          "accumulates bf16 gradients in fp32 only in its ZeRO-1 optimizer; keep stage 1, use "
                          "train.precision=fp32, or also set data_types.grad_accum_dtype=bf16")
    return merged
