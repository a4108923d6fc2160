"""The training loop: data, steps, validation, checkpoints, logging, on every rank.

Run by launch/train.py (`deepspeed --num_gpus N launch/train.py ...`), which builds this rank's
stage of the pipeline (training/pipeline/deepspeed_engine.py `Pipeline`, the DeepSpeed adapter) and hands it here.
The loop never touches DeepSpeed itself: it feeds micro-batches to `pipe.train_batch`, asks
`pipe.save` / `pipe.load` for the engine's share of a checkpoint and adds its own (the RNG state
of every rank, `state.json`, `latest.json`: training/run/run_dir.py describes the run directory).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from retropipe.data.stage import fault_point
from retropipe.training.models.flops import flops_per_token, mfu, step_flops_per_token
from retropipe.training.models.lm_head import IGNORE_INDEX
from retropipe.training.run import TrainingError
from retropipe.training.run.batches import SequenceBatches, micro_batches
from retropipe.training.run.hardware import (host_matmul_flops_per_s, matmul_flops_per_s, peak_dtype, peak_memory_mb,
                                             share_of_peak)
from retropipe.training.run.metrics_log import MetricsLog
from retropipe.training.run.rng import rng_state, set_rng_state
from retropipe.training.run.run_dir import checkpoint_tag, declare_checkpoint


def rounding_tolerance(scale: float, dtype: torch.dtype) -> float:
    """How far the stages' copies of the tied embedding may drift by rounding alone. Data-parallel
    replicas all-reduce each copy's gradient over their own group, and with three or more replicas
    the two groups add in different orders: the copies then differ in their last bits (2 ulps of
    the weights' dtype at the largest weight; at least 1e-5 of it in fp32). A broken tie differs by
    whole learning-rate steps."""
    return max(2 * torch.finfo(dtype).eps, 1e-5) * scale


def check_tied_weights(pipe, when: str, dtype: torch.dtype, log=print) -> float:
    """The stages' copies of the tied embedding agree up to rounding (a TrainingError otherwise, on
    every rank); the drift, which rank 0 reports when there is one. The first stage's copy is the
    one exported."""
    diff, scale = pipe.tied_weights_drift()
    tolerance = rounding_tolerance(scale, dtype)
    if diff > tolerance:
        raise TrainingError(f"the pipeline stages' copies of the tied token embedding differ {when} (max |Δ| "
                            f"{diff:.3g}, above rounding's {tolerance:.3g}): the output head would not be the input "
                            "embedding")
    if diff > 0 and dist.get_rank() == 0:
        log(f"train: warning: the stages' copies of the tied token embedding differ by rounding {when} "
            f"(max |Δ| {diff:.3g}, within {tolerance:.3g}: data-parallel replicas sum in different orders); "
            "the first stage's copy is the one exported")
    return diff


def _to_pipe(batch: dict, retro: bool):
    """A micro-batch as the pipeline wants it: (inputs for stage 0, labels for the last stage)."""
    tokens = torch.from_numpy(batch["tokens"])
    inputs = (tokens, torch.from_numpy(batch["neighbours"])) if retro and "neighbours" in batch else tokens
    return inputs, torch.from_numpy(batch["labels"])


def onto_device(micro_batch, device: torch.device):
    """A micro-batch on the stage's GPU, its copy queued behind the GPU's work instead of waited for.

    DeepSpeed's pipe engine moves a micro-batch it is handed on the host with a blocking `.to()`,
    which first waits for every kernel queued before it: the host could then not queue the next
    forward while the GPU still ran the last backward, and a step of small kernels waits on its
    host. From pinned memory a non-blocking copy is queued like a kernel, and DeepSpeed's `.to()`
    of a tensor already there does nothing. On a CPU the micro-batch is returned as it is."""
    if device.type != "cuda":
        return micro_batch

    def move(x: torch.Tensor) -> torch.Tensor:
        return x.pin_memory().to(device, non_blocking=True)

    inputs, labels = micro_batch
    return (tuple(map(move, inputs)) if isinstance(inputs, tuple) else move(inputs)), move(labels)


class Trainer:
    """start: where the run begins (training/run/start.py `plan_start`: fresh, resume or branch)."""

    def __init__(self, cfg, pipe, store, neighbours, run_dir: Path, start, log=print, progress: bool = True,
                 preemption=None):
        self.cfg, self.pipe, self.store, self.run_dir, self.log = cfg, pipe, store, Path(run_dir), log
        self.start, self.progress = start, progress
        self.preemption = preemption  # training/run/preemption.py: stop at a step's end on a signal
        self.t = cfg.train
        self.retro = cfg.model.retrieves
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.t.precision]
        check_tied_weights(pipe, "at the start of training", self.dtype, log)
        # Only RETRO's first stage reads neighbours, its last stage needs just the labels; a GPT-2
        # with its neighbours in context (model.in_context) places its labels after them: every stage.
        in_context = cfg.model.in_context
        nbrs = neighbours if (self.retro and pipe.first) or in_context else None
        k = self.t.neighbours
        self.train_data = SequenceBatches(store, "train", self.t.seq_len, nbrs, k, self.t.lessons, self.t.seed,
                                          in_context)
        self.val_data = SequenceBatches(store, "validation", self.t.seq_len, nbrs, k, in_context=in_context)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.tokens_per_step = self.t.seq_len * self.t.micro_batch_size * self.t.micro_batches * pipe.dp_world
        self.targets_read = 0

    # -- checkpoints --
    def resume(self) -> int:
        """Load the checkpoint the run starts from (its own, or a branch's source); the step."""
        start = self.start
        if start.kind not in ("resume", "branch"):
            return 0
        rank = self.rank
        if start.elastic:  # written by another cluster shape: its RNG files are other ranks' (dropout only)
            self.pipe.load_elastic(start.ckpt_dir, start.tag, start.step)
            rank %= len(list((start.ckpt_dir / start.tag).glob("rng_rank*.pt")))
        else:
            self.pipe.load(start.ckpt_dir, start.tag)
        set_rng_state(torch.load(start.ckpt_dir / start.tag / f"rng_rank{rank:03d}.pt", weights_only=True))
        return start.step

    def save(self, step: int) -> None:
        """Every rank's share of the checkpoint of `step`, declared complete (latest.json) only once
        all are on disk: a run killed while writing resumes from the checkpoint before."""
        tag = checkpoint_tag(step)
        self.pipe.save(self.ckpt_dir, tag, step)
        # Tests: RETROPIPE_KILL_AFTER=checkpoint:N kills a rank with its share of step N written.
        fault_point("checkpoint", step)
        torch.save(rng_state(), self.ckpt_dir / tag / f"rng_rank{self.rank:03d}.pt")
        dist.barrier()  # every rank's files are on disk before the checkpoint is declared complete
        if self.rank == 0:
            declare_checkpoint(self.ckpt_dir, step, self.t.keep_checkpoints,
                               {"processes": self.world, "pipeline_stages": self.t.pipeline_stages,
                                "global_batch": self.t.micro_batch_size * self.t.micro_batches * self.pipe.dp_world})
        dist.barrier()

    # -- validation --
    def validate(self) -> float | None:
        mbs, dp_rank, dp_world = self.t.micro_batch_size, self.pipe.dp_rank, self.pipe.dp_world
        n = min(self.t.eval_batches, len(self.val_data) // (mbs * dp_world))
        if n == 0:
            return None

        def batches():
            for j in range(n):
                start = (j * dp_world + dp_rank) * mbs
                yield onto_device(_to_pipe(self.val_data.batch(np.arange(start, start + mbs)), self.retro),
                                  self.pipe.device)

        it = batches() if (self.pipe.first or self.pipe.last) else None
        return self.pipe.eval_batch(it, n)

    # -- the loop --
    def fit(self) -> dict:
        """Train from where the run starts to train.steps; the losses, last validation loss and peak memory."""
        start = self.resume()
        metrics, bar = self._open_log(start)
        batches = self._train_batches(start)
        peak, fpt = self._peak_flops(), flops_per_token(self.cfg.model, self.t.seq_len)
        bytes_per_token = self.store.split_bytes("validation") / max(self.store.manifest["splits"]["validation"]["tokens"], 1)
        losses, val, stop, step = {}, None, False, start
        for step in range(start + 1, self.t.steps + 1):
            t0, targets_before = time.perf_counter(), self.targets_read
            loss = losses[step] = self.pipe.train_batch(batches)
            tokens_per_s = self.tokens_per_step / (time.perf_counter() - t0)
            # This rank's micro-batches stand for the world's (rank 0, which logs, reads data).
            share = (self.targets_read - targets_before) / (self.tokens_per_step / self.pipe.dp_world)
            step_fpt = step_flops_per_token(fpt, self.cfg.model, share, self.t.fused_head)
            record = {"step": step, "loss": loss, "lr": self.pipe.lr(), "grad_norm": self.pipe.grad_norm(),
                      "tokens_per_s": tokens_per_s, "mfu": mfu(step_fpt, tokens_per_s, peak)}
            if (self.t.eval_every and step % self.t.eval_every == 0) or step == self.t.steps:
                val = self.validate()
                if val is not None:
                    record.update(val_loss=val, val_bpb=val / math.log(2) / bytes_per_token)
            if self.rank == 0:
                metrics.write(record)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}", mfu=f"{record['mfu']:.2f}")
                bar.update(1)
            stop = self.preemption is not None and step < self.t.steps and self.preemption.agreed(self.pipe.device)
            if step % self.t.checkpoint_every == 0 or step == self.t.steps or stop:
                self.save(step)
            # Tests of resumption: RETROPIPE_KILL_AFTER=train:N kills every rank right here, after
            # step N has finished and, if N is a checkpoint step, been checkpointed.
            fault_point("train", step)
            if stop:
                break
        if self.rank == 0:
            bar.close()
            metrics.close()
        return {"losses": losses, "val_loss": val, "start_step": start, "peak_memory_mb": self._peak_memory(),
                "preempted_at": step if stop else None}

    def _open_log(self, start: int):
        """(metrics log, progress bar) on rank 0, (None, None) elsewhere; says where a resumed run starts."""
        if self.rank != 0:
            return None, None
        from tqdm import tqdm

        metrics = MetricsLog(self.run_dir, start, self.cfg.to_dict())
        if start:
            how = (f"resumed from step {start}" if self.start.kind == "resume"
                   else f"branched from {self.start.ckpt_dir / self.start.tag} at step {start}")
            self.log(f"{how}; lr {self.pipe.lr():.6g} next, on a schedule of {self.t.steps} steps")
        bar = tqdm(total=self.t.steps, initial=start, desc=f"train {self.run_dir.name}", dynamic_ncols=True,
                   disable=not self.progress)
        return metrics, bar

    def _train_batches(self, start: int):
        """This rank's micro-batches from step `start` on (the first and last stage read data; None elsewhere)."""
        if not (self.pipe.first or self.pipe.last):
            return None
        batches = micro_batches(self.train_data, start * self.t.micro_batches, self.t.micro_batch_size,
                                self.pipe.dp_rank, self.pipe.dp_world, self.t.seed)
        return (onto_device(self._count_targets(_to_pipe(b, self.retro)), self.pipe.device) for b in batches)

    def _count_targets(self, micro_batch):
        """Counts the tokens with a target that this rank reads (`targets_read`), for MFU."""
        self.targets_read += int((micro_batch[1] != IGNORE_INDEX).sum())
        return micro_batch

    def _device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _peak_flops(self) -> float:
        """The whole world's matmul peak in the run's precision (`peak_dtype`), which MFU is measured
        against: the sum of its GPUs', or of its hosts' CPUs' (`share_of_peak`)."""
        device = self._device()
        share = share_of_peak(device, self.t.cpu_threads, int(os.environ.get("LOCAL_RANK", 0)))
        # Measured under a forked RNG (its random matrices must not shift a resumed run's stream),
        # and reduced on the device: NCCL takes no CPU tensors.
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
            dtype = peak_dtype(self.dtype, device)
            if share == "own":
                mine = matmul_flops_per_s(dtype, device)
            elif share == "host":
                mine = host_matmul_flops_per_s(dtype)
            else:
                mine = 0.0
        peak = torch.tensor(mine, device=device)
        dist.all_reduce(peak)
        return float(peak)

    def _peak_memory(self) -> dict:
        """Every rank's peak memory, gathered on the device (NCCL takes no CPU tensors)."""
        device = self._device()
        mine = torch.tensor(peak_memory_mb(device), dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        memory = {"host_rss_mb": [round(float(m[0])) for m in every]}
        if device == "cuda":
            memory["cuda_allocated_mb"] = [round(float(m[1])) for m in every]
        return memory
