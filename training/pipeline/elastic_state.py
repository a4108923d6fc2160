"""The training state in a form every cluster shape can read: each parameter whole, by its pipeline name.

    save_elastic(engine, checkpoint_dir, dp_rank, stage)     # every rank, at every checkpoint
    load_elastic(engine, checkpoint_dir, step)               # every rank of a job of another shape

DeepSpeed's own checkpoint partitions the optimizer state (ZeRO-1) over a stage's data-parallel
replicas and names its files by stage: it loads only on the shape that wrote it. Beside it, the
first replica of each stage writes `elastic/stage-SS.safetensors`: for every trainable parameter
of the stage, by the name the pipeline gives it (its global layer index, `3.attn.c_attn.weight`,
or `tied_modules.embed.weight`, which two stages hold alike), its fp32 master weights and AdamW's
two moments, whole, gathered from the replicas' partitions by DeepSpeed's public
`safe_get_full_*`. A job of another shape (more or fewer replicas, more or fewer stages) loads the
module's weights from DeepSpeed's per-layer files (they name layers, not stages), then sets its
own partitions from these files with `safe_set_full_*`; Adam's step count, the schedule's position
and the engine's counters follow from the checkpoint's step (no step is skipped in fp32 or bf16).

The private DeepSpeed names this needs (the wrapped torch optimizer, the link of its state to the
parameters) are reached through training/pipeline/deepspeed_private.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_optimizer_state)
from safetensors.torch import load_file, save_file

from retropipe.training.pipeline import deepspeed_private as private
from retropipe.training.pipeline.param_groups import GROUPS, placeholder_name
from retropipe.training.run import TrainingError
from retropipe.training.run.run_dir import ELASTIC_DIR as FOLDER
MOMENTS = ("exp_avg", "exp_avg_sq")


def trainable(engine) -> list[tuple[str, torch.nn.Parameter]]:
    """This stage's trained parameters by name (an empty group's placeholder is no model parameter)."""
    placeholders = {placeholder_name(group) for group in GROUPS}
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad and name not in placeholders]


def save_elastic(engine, checkpoint_dir: Path, dp_rank: int, stage: int) -> None:
    """This stage's trainable parameters, whole, into checkpoint_dir/elastic/ (a collective over the
    stage's replicas: every rank of the stage calls it; its first replica writes)."""
    tensors = {}
    private.link_optimizer_state(engine.optimizer)
    for name, param in trainable(engine):
        whole = {key: get_whole(engine, param, key) for key in ("fp32", *MOMENTS)}
        if dp_rank == 0:
            tensors.update({f"{name}/{key}": t.detach().float().cpu().contiguous() for key, t in whole.items()})
    if dp_rank == 0:
        folder = Path(checkpoint_dir) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"stage-{stage:02d}.safetensors"
        save_file(tensors, str(path) + ".tmp")
        Path(str(path) + ".tmp").replace(path)


def get_whole(engine, param, key: str) -> torch.Tensor:
    """The fp32 master ("fp32") or an AdamW moment of `param`, whole. Without ZeRO (stage 0, fp32)
    the parameter is its own master and torch's optimizer holds its moments whole."""
    whole = safe_get_full_fp32_param(param) if key == "fp32" else safe_get_full_optimizer_state(param, key)
    if whole is None:
        whole = param if key == "fp32" else private.torch_optimizer(engine).state[param][key]
    return whole


def set_whole(engine, param, key: str, value: torch.Tensor) -> None:
    """get_whole's inverse, on this rank's partition of it."""
    if private.torch_optimizer(engine) is engine.optimizer:  # no ZeRO: the tensors themselves
        target = param if key == "fp32" else private.torch_optimizer(engine).state[param][key]
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
    elif key == "fp32":
        safe_set_full_fp32_param(param, value)
    else:
        safe_set_full_optimizer_state(param, value, key)


def read_elastic(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Every stage's tensors in one mapping (a tied weight, written by two stages alike, once)."""
    tensors = {}
    for path in sorted((Path(checkpoint_dir) / FOLDER).glob("stage-*.safetensors")):
        for key, value in load_file(str(path)).items():
            tensors.setdefault(key, value)
    return tensors


def load_elastic(engine, checkpoint_dir: Path, step: int) -> None:
    """Continue a checkpoint written by another cluster shape: weights, fp32 masters, AdamW's
    moments and step count, the schedule's position, the engine's counters."""
    engine.module.load_state_dir(str(checkpoint_dir), checkpoint_engine=engine.checkpoint_engine, strict=True)
    tensors = read_elastic(checkpoint_dir)
    params = trainable(engine)
    missing = [f"{name}/{key}" for name, _ in params for key in ("fp32", *MOMENTS) if f"{name}/{key}" not in tensors]
    if missing:
        raise TrainingError(f"{checkpoint_dir / FOLDER} lacks {missing[0]} (and {len(missing) - 1} more): it was "
                            "written for another model; resume on the shape that wrote the checkpoint")
    create_optimizer_state(engine, step)
    for name, param in params:
        for key in ("fp32", *MOMENTS):
            set_whole(engine, param, key, tensors[f"{name}/{key}"].to(param.device))
    engine.lr_scheduler.step(last_batch_iteration=step - 1)   # the lr of step + 1, as a resumed run has it
    engine.global_steps, engine.global_samples = step, step * engine.train_batch_size()


def create_optimizer_state(engine, step: int) -> None:
    """AdamW's state exists only after its first step: one step with zero gradients and a zero
    learning rate creates it as torch lays it out and changes no weight; its step count is then set
    to the checkpoint's, and DeepSpeed links its partitions to the parameters."""
    base = private.torch_optimizer(engine)  # the torch AdamW that DeepSpeed's ZeRO-1 / bf16 optimizer wraps
    saved = [group["lr"] for group in base.param_groups]
    for group in base.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    base.step()
    for group, lr in zip(base.param_groups, saved):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = None
            base.state[p]["step"].fill_(float(step))
    private.link_optimizer_state(engine.optimizer)
