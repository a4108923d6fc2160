"""The DeepSpeed adapter: with deepspeed_private.py, the only modules of training/ that import `deepspeed`.

The models (training/models/), the partition search (training/pipeline/partition.py) and the
training loop (training/run/trainer.py) are plain torch; launch/train.py builds a `Pipeline` here
and hands it to the loop, which trains through its methods (train_batch, eval_batch, save, load,
...) without knowing DeepSpeed. What lives here:

- The layer list as a `PipelineModule`: each `LayerDesc` becomes a `LayerSpec`, the token
  embedding's uses a `TiedLayerSpec("embed", ...)`. DeepSpeed saves a tied module only through its
  use *without* forward_fn, so the first use gets a subclass whose own forward is that use (same
  parameter names); later uses pass their forward_fn.
- Layers are built under a per-layer seed (training/models/layers.py `seeded`), so a stage builds exactly
  the weights the same layer has in a 1-stage run or in `build_model(cfg, layer_seed=...)`.
- Stages are cut at the boundaries training/pipeline/partition.py computes; the layers either side of a
  cut send RETRO's (h, ids, z) as one float tensor (training/pipeline/stage_boundary.py says why).
- Warm starts into a stage's layers; checkpoints; the full model gathered from the stages onto
  rank 0; the tied embedding's copies compared on the device; DeepSpeed's logs. (The JSON DeepSpeed is given is plain dicts, generated
  and checked in training/pipeline/deepspeed_config.py.)

Only DeepSpeed's public API is used here; whatever reaches its internals (cutting the stages where
we say, the index of a stage's first layer, the tied weights' broadcast, the bf16 optimizer's
gradients) is a function of training/pipeline/deepspeed_private.py, which lists every such name.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import io
import logging
import os
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():  # skip DeepSpeed's accelerator probing (and its warning)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402

from retropipe.training.models.config import ModelConfig  # noqa: E402
from retropipe.training.models.gpt2 import FusedLoss, loss_fn  # noqa: E402
from retropipe.training.models.io import load_pretrained  # noqa: E402
from retropipe.training.models.layers import LayerDesc, seeded  # noqa: E402
from retropipe.training.models.retro import freeze_trunk, is_retrieval_parameter  # noqa: E402
from retropipe.training.run import TrainingError  # noqa: E402
from retropipe.training.pipeline.bf16_grads import add_grads_in_one_call  # noqa: E402
from retropipe.training.pipeline import deepspeed_private as private  # noqa: E402
from retropipe.training.pipeline.elastic_state import load_elastic, save_elastic  # noqa: E402
from retropipe.training.pipeline.param_groups import parameter_groups, restore_group_settings  # noqa: E402
from retropipe.training.pipeline.stage_boundary import at_boundary, class_at_boundary, unpack_boundary  # noqa: E402
from retropipe.training.pipeline.stage_plan import StagePlan, stage_plan  # noqa: E402
from retropipe.training.run.cluster import collective_timeout, set_collective_timeout  # noqa: E402
from retropipe.training.run.config import TrainConfig  # noqa: E402
from retropipe.training.run.hardware import local_gpu  # noqa: E402

private.skip_shm_comm_build()  # gloo's allreduce on CPU, not a C++ build of DeepSpeed's (~90 s)


class _SeededSpec:
    """Build a layer under its own seed: the weights do not depend on which stage builds them."""

    def build(self, log=False):
        with seeded(self.seed):
            return super().build(log=log)


class SeededLayerSpec(_SeededSpec, LayerSpec):
    def __init__(self, seed, typename, *args, **kwargs):
        super().__init__(typename, *args, **kwargs)
        self.seed = seed


class SeededTiedLayerSpec(_SeededSpec, TiedLayerSpec):
    def __init__(self, seed, key, typename, *args, **kwargs):
        super().__init__(key, typename, *args, **kwargs)
        self.seed = seed


class _AsBase:
    """`module` seen as its base class: calling it runs the base forward (no recursion)."""

    def __init__(self, module, cls):
        self._module, self._cls = module, cls

    def __call__(self, *args):
        return self._cls.forward(self._module, *args)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _first_use(cls: type, forward_fn) -> type:
    """`cls` whose forward is `forward_fn(module, x)`: DeepSpeed checkpoints it as a module."""
    return type(cls.__name__, (cls,), {"forward": lambda self, x: forward_fn(_AsBase(self, cls), x)})


class RetroPipeModule(private.StagesCutAt, PipelineModule):
    """PipelineModule cut at explicit boundaries: RetroPipeModule(specs, parts=[0, 4, 6], ...)."""


def _no_leaf_outputs(forward_fn):
    """forward_fn whose outputs are never a parameter itself, but a view of it.

    The fused head hands the tied embedding matrix to the loss (`head_inputs`: (h, W)). DeepSpeed
    hooks a stage's outputs for its backward bookkeeping, and under its bf16 optimizer the gradient
    that the loss gives a parameter handed on as an output is dropped on the last stage: the head's
    whole contribution to the tied embedding. A view of the parameter carries the same gradient to
    it without being the parameter (tests/launch/test_training.py, bf16 on two stages).
    """
    def fn(module, x):
        out = forward_fn(module, x)
        if isinstance(out, tuple):
            return tuple(t.view_as(t) if isinstance(t, torch.nn.Parameter) else t for t in out)
        return out.view_as(out) if isinstance(out, torch.nn.Parameter) else out
    return fn


def layer_specs(descs: list[LayerDesc], seed: int, parts: list[int] | None = None,
                model: ModelConfig | None = None) -> list:
    """DeepSpeed layer specs; with parts (stage bounds) and model, the layers either side of each
    cut pack and unpack RETRO's tuple (pack_boundary)."""
    if parts and model is None:
        raise ValueError("layer_specs: a cut (parts) needs the model config to unpack RETRO's tuple")
    starts = set(parts[1:-1]) if parts else set()
    unpack = functools.partial(unpack_boundary, n_embd=model.n_embd, chunk_len=model.chunk_len) if parts else None
    specs, tied = [], set()
    for i, d in enumerate(descs):
        forward_fn = _no_leaf_outputs(d.forward_fn) if d.forward_fn else None
        cls = d.cls
        cut_after, cut_before = i + 1 in starts, i in starts
        if cut_after or cut_before:
            if forward_fn:
                forward_fn = at_boundary(forward_fn, cut_after, cut_before and unpack)
            else:
                cls = class_at_boundary(cls, cut_after, cut_before and unpack)
        if d.tie_key is None:
            specs.append(SeededLayerSpec(seed + i, cls, **d.kwargs))
        elif d.tie_key not in tied:
            tied.add(d.tie_key)
            first = _first_use(cls, forward_fn) if forward_fn else cls
            specs.append(SeededTiedLayerSpec(seed + i, d.tie_key, first, **d.kwargs))
        else:
            specs.append(SeededTiedLayerSpec(seed + i, d.tie_key, cls, forward_fn=forward_fn, **d.kwargs))
    return specs


def build_pipeline(model: ModelConfig, train: TrainConfig,
                   plan: StagePlan | None = None) -> tuple[RetroPipeModule, list[LayerDesc], list[int]]:
    """This rank's stage of the plan's layer list and cut (training/pipeline/stage_plan.py; computed
    here without one): (module, descs, parts)."""
    plan = plan or stage_plan(model, train)
    descs, parts = plan.descs, plan.parts
    module = RetroPipeModule(layer_specs(descs, train.seed, parts, model), parts=parts, num_stages=train.pipeline_stages,
                             loss_fn=FusedLoss() if train.fused_head else loss_fn,
                             activation_checkpoint_interval=train.activation_checkpoint_interval,
                             checkpointable_layers=["Block", "RetroBlock"])
    return module, descs, parts


def verbose() -> bool:
    """DeepSpeed's own logs in full (launch/ --verbose sets RETROPIPE_VERBOSE=1 for every rank)."""
    return os.environ.get("RETROPIPE_VERBOSE") == "1"


def quiet_logs() -> None:
    """Unless verbose: DeepSpeed's logger at WARNING, without warnings every rank repeats that say
    nothing about the run (the scheduler read before its first step, at construction; an autograd
    note on the broadcast of tied weights; torch's deprecation of a collective ZeRO-1 calls)."""
    from deepspeed.utils import logger

    logger.setLevel(logging.INFO if verbose() else logging.WARNING)
    if not verbose():
        logger.addFilter(lambda record: "before it has started" not in record.getMessage())
        warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated")


def _quiet_prints():
    """DeepSpeed prints its pipeline topology and layer seeding on building a module: swallowed
    unless verbose (its logger keeps its own stream, so warnings still show)."""
    return contextlib.nullcontext() if verbose() else contextlib.redirect_stdout(io.StringIO())


def init_distributed(join_timeout: float) -> None:
    """The process group: gloo on CPU, NCCL on GPUs (ranks from the launcher's environment). The
    ranks of every node have `join_timeout` seconds to meet (nodes start when their scheduler
    starts them); collectives get train.dist_timeout once DeepSpeed made its groups (Pipeline)."""
    quiet_logs()
    if torch.cuda.is_available():  # this rank's own GPU before any collective (NCCL uses the current one)
        torch.cuda.set_device(local_gpu())
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=datetime.timedelta(seconds=join_timeout))


def device_args():
    """deepspeed.initialize's `args` on GPUs: this rank's GPU as `device_rank`. DeepSpeed takes
    cuda:LOCAL_RANK otherwise, which does not exist where a scheduler shows each process only its
    own GPU (Slurm's --gpus-per-task, Kubernetes): LOCAL_RANK 3 of a node, one GPU visible."""
    return argparse.Namespace(device_rank=local_gpu()) if torch.cuda.is_available() else None


def shutdown() -> None:
    """Take the process group down before the interpreter exits: left to interpreter teardown,
    gloo's threads occasionally aborted a finished rank ('terminate called without an active
    exception', exit code -6). launch/train.py then leaves without that teardown (`exit_now`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def compile_blocks(module: RetroPipeModule, descs: list[LayerDesc]) -> list[str]:
    """torch.compile this stage's transformer blocks in place (train.compile); their names.

    The blocks only, not every layer as `PipelineModule.compile` would: the others are lookups of
    the tied embedding, a view of it handed to the loss and the fused head's autograd.Function,
    around which dynamo would break its graph for nothing to fuse. (launch/train.py refuses a CPU
    without the C++ compiler inductor needs before any of this.)"""
    names = []
    for name, layer in private.stage_layers(module, descs):
        if isinstance(layer, torch.nn.Module) and name.startswith("blocks."):
            layer.compile()  # in place: the state dict keeps its names
            names.append(name)
    return names


class Pipeline:
    """This rank's stage of the DeepSpeed pipeline engine, seen through what the loop needs.

    warm_start: copy train.init_from's weights in (False when a checkpoint is loaded next anyway).
    plan: the layer list, the cut and the DeepSpeed config launch/train.py's preflight checked and
    recorded (training/pipeline/stage_plan.py); computed here without one.
    """

    def __init__(self, model: ModelConfig, train: TrainConfig, warm_start: bool = True,
                 plan: StagePlan | None = None):
        private.check_private_names()  # a TrainingError naming what this DeepSpeed lacks, before any work
        self.train, self.plan = train, plan or stage_plan(model, train)
        with _quiet_prints():
            module, self.descs, self.parts = build_pipeline(model, train, self.plan)
        if train.init_from and warm_start:
            self._warm_start(module, train.init_from)
        if model.freeze_trunk:
            freeze_trunk(module)
        # The same two AdamW groups on every stage (training/pipeline/param_groups.py says why).
        groups = parameter_groups(module, train.weight_decay)
        with _quiet_prints():
            self.engine, *_ = deepspeed.initialize(model=module, model_parameters=groups, args=device_args(),
                                                   config=copy.deepcopy(self.plan.deepspeed))
        private.no_gradient_for_frozen_tied_weights(module)
        add_grads_in_one_call(self.engine)
        self.compiled = compile_blocks(module, self.descs) if train.compile else []
        set_collective_timeout(collective_timeout(train.resolved_dist_timeout("cuda" if torch.cuda.is_available()
                                                                              else "cpu")))
        self.dp_rank, self.dp_world, self.stage = private.parallel_ranks(self.engine)
        self.first, self.last = self.engine.is_first_stage(), self.engine.is_last_stage()
        self.device = torch.device(self.engine.device)  # where this stage computes (its GPU, or the CPU)

    def _warm_start(self, module: RetroPipeModule, source_dir: str) -> None:
        """Copy a GPT-2 checkpoint (ours or Hugging Face) into this stage's layers.

        With model.freeze_trunk (RETRO-fit, paper §4.2) only CCA and encoder train afterwards.
        """
        source = load_pretrained(source_dir).state_dict()
        layers = [(name, layer) for name, layer in private.stage_layers(module, self.descs)
                  if isinstance(layer, torch.nn.Module)]
        # Tied modules too: a stage that holds only a later use of the embedding (the output head
        # on the last stage) sees it as a function among its stage layers, not as a module.
        tie_names = {d.tie_key: d.name for d in self.descs if d.tie_key}
        layers += [(tie_names[key], tied) for key, tied in private.tied_modules(module).items()]
        for name, layer in layers:
            own = {k[len(name) + 1:]: v for k, v in source.items() if k.startswith(name + ".")}
            missing, unexpected = layer.load_state_dict(own, strict=False)
            trunk_missing = [m for m in missing if not is_retrieval_parameter(m)]
            if trunk_missing or unexpected:
                raise TrainingError(f"train.init_from={source_dir}: layer {name} does not match "
                                    f"(missing {trunk_missing}, unexpected {unexpected})")
        # DeepSpeed broadcast the tied weights when it built the module, before this copy: do it again.
        private.broadcast_tied_weights(module)

    # -- one optimizer step, one validation pass --
    def train_batch(self, batches) -> float:
        """One optimizer step over train.micro_batches micro-batches (an iterator of (inputs,
        labels) on the first and last stage, None elsewhere); the mean loss, on every rank."""
        return float(self.engine.train_batch(data_iter=batches))

    def eval_batch(self, batches, num_micro_batches: int) -> float:
        return float(self.engine.eval_batch(batches, num_micro_batches=num_micro_batches))

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    # -- checkpoints: DeepSpeed's per-layer weights and per-rank optimizer partitions --
    def save(self, ckpt_dir: Path, tag: str, step: int) -> None:
        """DeepSpeed's checkpoint (this shape's), and the same state whole by parameter (any shape's)."""
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
        save_elastic(self.engine, Path(ckpt_dir) / tag, self.dp_rank, self.stage)

    def load_elastic(self, ckpt_dir: Path, tag: str, step: int) -> None:
        """A checkpoint written by another number of replicas or stages (elastic_state.py)."""
        load_elastic(self.engine, Path(ckpt_dir) / tag, step)

    def load(self, ckpt_dir: Path, tag: str) -> None:
        """Weights, optimizer state and the schedule's position from a checkpoint (this run's or,
        for a branch, another's); the hyperparameters stay this run's config."""
        sched = self.engine.lr_scheduler
        # What the scheduler saves besides its position (nothing, for DeepSpeed's WarmupCosineLR;
        # other types may save their totals): keep this config's values, so a longer run decays
        # to its own train.steps.
        ours = {k: v for k, v in sched.state_dict().items()
                if k not in ("last_batch_iteration", "last_epoch", "_step_count")} if sched else {}
        load_path, _ = self.engine.load_checkpoint(str(ckpt_dir), tag=tag)
        if load_path is None:
            raise TrainingError(f"checkpoint {Path(ckpt_dir) / tag} could not be loaded")
        # The optimizer state brings the saved groups' settings: this config's decay, betas and
        # fused step win (DeepSpeed's ZeRO and bf16 optimizers wrap torch's as .optimizer).
        params = self.plan.deepspeed.get("optimizer", {}).get("params", {})
        restore_group_settings(private.torch_optimizer(self.engine), self.train.weight_decay,
                               (self.train.beta1, self.train.beta2),
                               params.get("fused") if params.get("torch_adam") else None)
        if sched is not None:
            for key, value in ours.items():
                setattr(sched, key, value)
            if hasattr(sched, "last_batch_iteration"):  # DeepSpeed's schedules: the lr of the next
                sched.step(sched.last_batch_iteration)  # step under this schedule, not the saved one

    # -- the model --
    def tied_weights_drift(self) -> tuple[float, float]:
        """(largest |Δ| between the stages' copies of the tied embedding, largest |w|): the same on
        every rank, (0.0, 0.0) without a tie across stages. Reduced on the device within each tie's
        group (the stages holding a copy): no rank ever receives another's copy."""
        found = torch.zeros(2, device=self.engine.device)                     # [max |Δ|, max |w|]
        for weight, group in private.tied_weights(self.engine.module):
            w = weight.detach().float()
            hi, lo = w.clone(), w.clone()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            found = torch.maximum(found, torch.stack([(hi - lo).max(), w.abs().max()]))
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return float(found[0]), float(found[1])

    def gather_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model's fp32 weights (from the optimizer's master copy) on global rank 0, None
        elsewhere. The tied embedding is the first stage's copy.

        Names are the monolithic model's (`LayerDesc.name` + parameter name), so the result loads
        into GPT2 / Retro and is saved with training.save_model.
        """
        from deepspeed.utils import safe_get_full_fp32_param

        local = {}
        for name, layer in private.stage_layers(self.engine.module, self.descs):
            if not isinstance(layer, torch.nn.Module):
                continue  # a tied layer's second use: its weights are saved with the first
            for pname, p in layer.named_parameters():
                # Every data-parallel rank takes part: under ZeRO-1 / the bf16 optimizer this
                # all-reduces the master copy's shards across the data-parallel group.
                full = safe_get_full_fp32_param(p)
                if self.dp_rank == 0:  # one copy per stage is enough
                    local[f"{name}.{pname}"] = (full if full is not None else p).detach().float().cpu()
            if self.dp_rank == 0:
                for bname, b in layer.named_buffers():
                    local[f"{name}.{bname}"] = b.detach().cpu()
        if self.dp_rank != 0:
            return None
        # The stages of replica 0 send their weights to global rank 0 (stage 0 of replica 0) alone.
        stages, group = private.pipe_group(self.engine)
        gathered = [None] * stages if dist.get_rank() == 0 else None
        dist.gather_object(local, gathered, dst=0, group=group)
        if dist.get_rank() != 0:
            return None
        merged = {}
        for part in gathered:
            merged.update(part)
        return merged
