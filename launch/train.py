"""Train the GPT-2 baseline or RETRO with DeepSpeed pipeline parallelism.

    deepspeed --num_gpus 2 launch/train.py --config configs/tiny-retro.yaml [--set train.steps=50]

On CPU DeepSpeed runs the processes over gloo; on GPUs over NCCL, multi-node with a hostfile.
World size = train.pipeline_stages × data-parallel degree. A run resumes from its newest
checkpoint when rerun, and is skipped once complete (training/run/run_dir.py describes the run directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
import time
from pathlib import Path

# CPU pipeline stages take turns: a waiting stage's OpenMP threads must sleep, not spin, for the
# busy stage to use their cores (train.cpu_threads). libgomp reads this once, when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from retropipe.data.cpu import emulated_bf16
from retropipe.data.errors import ConfigError, DataError
from retropipe.data.neighbour_store import NeighbourStore
from retropipe.data.reading import Reading
from retropipe.data.stage import write_json
from retropipe.data.store import ChunkStore
from retropipe.launch.cli import config_from_args, entry_parser, quiet_engines
from retropipe.training.models.io import save_model
from retropipe.training.models.registry import build_model, layer_list
from retropipe.training.pipeline.deepspeed_config import deepspeed_config
from retropipe.training.pipeline.partition import partition
from retropipe.training.pipeline.stage_plan import StagePlan
from retropipe.training.run import TrainingError
from retropipe.training.run.cluster import Watchdog, check_shared_run_dir
from retropipe.training.run.hardware import (cpu_threads, gpu_has_bf16, inductor_cxx, local_gpu, local_processes,
                                             resolve_precision, too_few_gpus)
from retropipe.training.run.preemption import PREEMPTED, Preemption
from retropipe.training.run.run_dir import claim_run_dir, latest_checkpoint
from retropipe.training.run.start import keep_global_batch, plan_start
from retropipe.training.run.trainer import Trainer, check_tied_weights


# Seconds the ranks of all nodes have to meet at the start (at least train.dist_timeout): a
# scheduler may start one node minutes after another.
JOIN_TIMEOUT = 600.0
# Seconds a rank other than 0 waits before it reports a start error and exits (report_start_error).
ERROR_GRACE = 3.0


def report_start_error(rank: int, message: str) -> None:
    """Say why this rank stops before the process group forms, once for the whole job. Every rank
    checks the same things, and the launcher stops every rank as soon as the first one exits: were
    the others to exit at once, one could end the job before rank 0 had printed, and the user would
    read nothing. So rank 0 prints at once; another rank prints (naming itself) only if it is still
    running ERROR_GRACE seconds later, i.e. when it failed where rank 0 did not (a file missing on
    its node, say). Not after the group forms: the watchdog then keeps a rank alive through the
    launcher's SIGTERM and would report rank 0 lost; errors there are rank 0's to print."""
    if rank != 0:
        time.sleep(ERROR_GRACE)
    print(f"train: error{f' (rank {rank})' if rank else ''}: {message}", file=sys.stderr, flush=True)


def run_dir_of(cfg) -> Path:
    return cfg.runs_dir / (cfg.train.name or cfg.model.kind)


def as_run(cfg):
    """cfg as a training run records it: train.precision "auto" replaced by what it stands for on
    this machine, through the constructor so the section is validated again. The run directory's
    config.yaml holds this, so whoever checks a run directory against a config resolves it too."""
    cfg.train = dataclasses.replace(cfg.train, precision=resolve_precision(cfg.train.precision))
    return cfg


def preflight(cfg, world_size: int):
    """Every check of the config and the data that can fail before any process group or model
    exists; returns the chunk store, the neighbours (RETRO) and the run's one computation of the
    layer list, the cut and the DeepSpeed JSON (training/pipeline/stage_plan.py), which the
    Pipeline builds from."""
    t = as_run(cfg).train
    if world_size % t.pipeline_stages:
        raise ConfigError("train.pipeline_stages", f"world size {world_size} is not divisible by "
                          f"{t.pipeline_stages} pipeline stages")
    descs = layer_list(cfg.model, fused_head=t.fused_head)  # the head the Pipeline builds
    if t.pipeline_stages > len(descs):
        raise ConfigError("train.pipeline_stages", f"{t.pipeline_stages} stages for a model of "
                          f"{len(descs)} pipeline layers")
    try:  # a cut where every stage trains (frozen trunk: a CCA layer per stage) must exist
        parts = partition(descs, t.pipeline_stages, t.partition, frozen_trunk=cfg.model.freeze_trunk)
    except ValueError as e:
        raise ConfigError("train.pipeline_stages", str(e).split(": ", 1)[-1]) from None
    # deepspeed_config: train.deepspeed within the pipeline engine's limits, no contradiction with train.*
    plan = StagePlan(descs, parts, deepspeed_config(t))
    check_hardware(t, world_size)
    store = ChunkStore(cfg.data_dir)
    if store.chunk_len != cfg.data.chunk_len:
        raise ConfigError("data.chunk_len", f"{cfg.data.chunk_len}, but the chunk store {cfg.data_dir} "
                          f"was prepared with chunk_len {store.chunk_len}")
    n_train = len(store.split("train")) // (t.seq_len // store.chunk_len)
    if n_train < t.micro_batch_size:
        raise TrainingError(f"the training split holds {n_train} sequences of {t.seq_len} tokens, fewer than "
                            f"train.micro_batch_size ({t.micro_batch_size})")
    neighbours = None
    if cfg.model.retrieves or cfg.model.in_context:
        neighbours = NeighbourStore.of(cfg.retrieval_dir, store, chunks_per_seq=t.seq_len // store.chunk_len,
                                        reading=Reading.for_training(cfg.retrieval))
        built = neighbours.manifest.get("method", "dense")
        if built != cfg.retrieval.method:  # a run's config must say which neighbours it trained on
            raise ConfigError("retrieval.method", f"{cfg.retrieval.method!r}, but the neighbours in "
                              f"{cfg.retrieval_dir} were found by {built!r}; build them: python "
                              f"launch/build_index.py --config ... --set retrieval.method={cfg.retrieval.method}")
    return store, neighbours, plan


def check_hardware(t, world_size: int) -> None:
    """This machine can run train.* as set: enough GPUs, a compiler for train.compile, the precision."""
    cuda = torch.cuda.is_available()
    if cuda:
        crowded = too_few_gpus(local_processes(os.environ, world_size), torch.cuda.device_count())
        if crowded:
            raise TrainingError(crowded)
    if t.compile and not cuda and os.environ.get("TORCHDYNAMO_DISABLE") != "1" and inductor_cxx() is None:
        raise ConfigError("train.compile", "torch.compile on a CPU builds C++ with $CXX or g++, and neither is "
                          "on PATH (install g++, set CXX, or leave train.compile false)")
    if t.precision == "fp16" and not cuda:
        raise ConfigError("train.precision", "fp16 needs a GPU; this machine has none (use bf16 or fp32)")
    if t.precision == "bf16" and cuda and not gpu_has_bf16(torch.cuda.get_device_capability(local_gpu())):
        raise ConfigError("train.precision", "this GPU has no bf16 matmuls (compute capability below 8.0; "
                          "use fp16 or fp32)")


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(__doc__)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # from the launcher
    args = parser.parse_args(argv)
    quiet_engines(args.verbose)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("LOCAL_RANK", str(args.local_rank or 0))

    try:
        cfg = config_from_args(args)
        run_dir = run_dir_of(cfg)
        preemption = Preemption(cfg.train.preempt_grace, lambda: resume_point(run_dir)).install()
        store, neighbours, plan = preflight(cfg, world)
        claim_run_dir(cfg, run_dir, write=False)  # every rank checks, so all exit together
        start = plan_start(cfg, run_dir, world, plan.parts)  # fresh, resume (or extend), branch, complete
        claim_run_dir(cfg, run_dir, write=rank == 0)
        # On a resume, the checkpoint's global batch (config.yaml keeps the micro-batches as set).
        train = keep_global_batch(cfg.train, world, start)
        if train != cfg.train:  # other micro-batches: DeepSpeed's accumulation steps follow
            cfg.train, plan = train, dataclasses.replace(plan, deepspeed=deepspeed_config(train))
    except (ConfigError, DataError, TrainingError) as e:
        report_start_error(rank, str(e))
        return 2
    if start.kind == "complete":
        if rank == 0:
            print(f"train: {run_dir} is complete ({cfg.train.steps} steps, summary.json); nothing to do")
        return 0
    device = prepare_rank(cfg, plan, run_dir, rank, world)
    return run_distributed(cfg, (store, neighbours, run_dir, start, plan), rank, world, device, preemption,
                           progress=not args.no_progress)


def resume_point(run_dir: Path) -> str:
    """Where a rerun of this run resumes, in words (for the line a preempted rank prints)."""
    latest = latest_checkpoint(run_dir / "checkpoints")
    return f"step {latest['step']} ({run_dir / 'checkpoints' / latest['tag']})" if latest else "step 0 (no checkpoint)"


def prepare_rank(cfg, plan, run_dir: Path, rank: int, world: int) -> str:
    """This rank's device, its CPU threads, and (rank 0) the run directory's records; the device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if rank == 0:  # an extended run is not complete again until its new last step
        (run_dir / "summary.json").unlink(missing_ok=True)
        slow = emulated_bf16("train.precision", cfg.train.precision, device)
        if slow:
            print(f"train: warning: {slow}", file=sys.stderr, flush=True)
        write_json(run_dir / "deepspeed_config.json", plan.deepspeed)  # exactly what DeepSpeed gets
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = local_processes(os.environ, world)
        torch.set_num_threads(cpu_threads(cfg.train.cpu_threads, local, cfg.train.pipeline_stages))
    return device


def run_distributed(cfg, work, rank: int, world: int, device: str, preemption, progress: bool) -> int:
    """Join the process group, guard it (watchdog, shared run directory), train; the exit code."""
    # DeepSpeed loads here, once the config and the data are checked: a refused config exits at once.
    from retropipe.training.pipeline.deepspeed_engine import init_distributed, shutdown

    # What is loaded now (torch, DeepSpeed: ~200k objects) lives as long as the process, so full
    # collections may skip it: Python's own as start-up allocates, and in bf16 six that DeepSpeed's
    # optimizer forces on rank 0; 0.7-1.4 s of a short run (docs/benchmarks.md, "Design decisions").
    gc.freeze()
    timeout = cfg.train.resolved_dist_timeout(device)
    init_distributed(max(timeout, JOIN_TIMEOUT))
    watchdog = Watchdog(rank, world, timeout, on_signal=preemption.request).start() if world > 1 else None
    try:
        check_shared_run_dir(work[2], device)
        return train(cfg, *work, rank, preemption, progress=progress)
    except TrainingError as e:
        if rank == 0:
            print(f"train: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError:  # a collective failed: a peer's socket reset, or the collective timed out
        if watchdog:
            watchdog.end("it dropped out of a collective and stopped beating")  # exits if a peer is lost
        raise
    finally:
        if watchdog:
            watchdog.stop()
        shutdown()


def train(cfg, store, neighbours, run_dir: Path, start, plan, rank: int, preemption, progress: bool = True) -> int:
    """Build this rank's stage, train, export the model and mark the run complete; the exit code."""
    from retropipe.training.pipeline.deepspeed_engine import Pipeline  # DeepSpeed: see run_distributed

    try:
        pipe = Pipeline(cfg.model, cfg.train, warm_start=start.kind == "fresh", plan=plan)
        trainer = Trainer(cfg, pipe, store, neighbours, run_dir, start, progress=progress, preemption=preemption)
    except TrainingError as e:
        if rank == 0:
            print(f"train: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        describe_pipeline(cfg, pipe, run_dir)
    if cfg.train.compile and pipe.dp_rank == 0:  # a line per stage: what compiles at its first step
        off = os.environ.get("TORCHDYNAMO_DISABLE") == "1"
        eager = "; TORCHDYNAMO_DISABLE=1 is set, so they run eager" if off else ""
        print(f"compile: stage {pipe.stage}: {', '.join(pipe.compiled) or 'no block'} through torch.compile{eager}",
              flush=True)
    result = trainer.fit()
    if result["preempted_at"] is not None:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line per node
            print(f"train: preempted ({preemption.signal_name}) after step {result['preempted_at']}; checkpoint "
                  f"written; rerun the same command to resume from {resume_point(run_dir)}", file=sys.stderr,
                  flush=True)
        return PREEMPTED
    try:
        drift = check_tied_weights(pipe, "at the end of training", trainer.dtype)
    except TrainingError as e:
        if rank == 0:
            print(f"train: error: {e}; the run is not marked complete", file=sys.stderr)
        return 1
    state = pipe.gather_state_dict()
    if rank == 0:
        export(cfg, state, run_dir, start, result, drift, pipe.parts)
    return 0


def describe_pipeline(cfg, pipe, run_dir: Path) -> None:
    """partition.json, and the lines saying how the world is split and what a step trains on."""
    t, parts, descs = cfg.train, pipe.parts, pipe.descs
    layers = [[d.name for d in descs[a:b]] for a, b in zip(parts, parts[1:])]
    costs = [round(sum(d.cost for d in descs[a:b]), 3) for a, b in zip(parts, parts[1:])]
    write_json(run_dir / "partition.json", {"parts": parts, "layers": layers, "gflops": costs})
    print(f"pipeline: {t.pipeline_stages} stages × {pipe.dp_world} data parallel, {t.precision}; "
          f"partition {parts} (GFLOPs per stage {costs})")
    sequences = t.micro_batch_size * t.micro_batches * pipe.dp_world
    print(f"  global batch: {sequences} sequences of {t.seq_len} tokens a step (train.micro_batch_size "
          f"{t.micro_batch_size} × train.micro_batches {t.micro_batches} × {pipe.dp_world} replicas)")
    for s, names in enumerate(layers):
        print(f"  stage {s}: {', '.join(names)}")


def export(cfg, state: dict, run_dir: Path, start, result: dict, drift: float, parts: list[int]) -> None:
    """The trained model (model/) and summary.json, which marks the run complete (rank 0)."""
    model = build_model(cfg.model)
    model.load_state_dict(state, strict=True)
    save_model(model, run_dir / "model")
    summary = {"complete": True, "steps": cfg.train.steps, "resumed_from": result["start_step"],
               "branched_from": str(start.ckpt_dir / start.tag) if start.kind == "branch" else None,
               "final_loss": result["losses"].get(cfg.train.steps), "val_loss": result["val_loss"],
               "tied_embedding_max_diff": drift, "partition": parts,
               "peak_memory_mb": result["peak_memory_mb"], "model_dir": str(run_dir / "model")}
    write_json(run_dir / "summary.json", summary)
    final = summary["final_loss"]  # None when a rerun found the last step already trained
    print(f"train: done; model in {run_dir / 'model'}" + (f"; final loss {final:.4f}" if final is not None else "")
          + (f", validation loss {result['val_loss']:.4f}" if result["val_loss"] is not None else ""))
    memory = result["peak_memory_mb"]
    print("train: peak memory per rank: " + ", ".join(f"{mb:,} MB" for mb in memory["host_rss_mb"]) + " resident"
          + ("; " + ", ".join(f"{mb:,} MB" for mb in memory["cuda_allocated_mb"]) + " CUDA allocated"
             if "cuda_allocated_mb" in memory else ""))


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown. gloo's worker threads can outlive the destroyed
    process group, and tearing them down at finalization still aborted a finished rank now and
    then ('terminate called without an active exception', exit code -6, seen under load). Every
    file of the run is closed by the time main returns; the logs are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
