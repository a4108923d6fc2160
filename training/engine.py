"""The training loop over a DeepSpeed pipeline: data, steps, validation, checkpoints, logging.

Run on every rank by launch/train.py (`deepspeed --num_gpus N launch/train.py ...`).

A run directory `<workdir>/runs/<name>/` holds:
    config.yaml          the resolved config (a rerun with another config is refused)
    partition.json       the stage boundaries and the layers of each stage
    metrics.jsonl        one line per step (loss, lr, grad_norm, tokens_per_s, mfu) and per validation
    tensorboard/         the same scalars for TensorBoard
    checkpoints/stepNNNNNN/   DeepSpeed's per-layer checkpoint + rng_rankNNN.pt + state.json
    checkpoints/latest.json   the newest complete checkpoint (written last, atomically)
    model/               the exported model (config.json + model.safetensors), when done
    summary.json         written last: the run is complete
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from training.data import SequenceBatches, micro_batches
from training.flops import flops_per_token, mfu
from training.retro import is_retrieval_parameter
from training.rng import rng_state, set_rng_state

STATE_FILE, LATEST = "state.json", "latest.json"


class TrainingError(RuntimeError):
    """A problem found before or during training, with a message meant for the user."""


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_tied_weights(engine, when: str) -> None:
    """Fail loudly when the stages' copies of the tied embedding differ (every rank raises)."""
    from training.pipeline import tied_weights_max_diff

    diff = tied_weights_max_diff(engine)
    if diff != 0.0:
        raise TrainingError(f"the pipeline stages' copies of the tied token embedding differ {when} (max |Δ| "
                            f"{diff:.3g}): the output head would not be the input embedding")


# --- the loop -------------------------------------------------------------------------------

def _to_pipe(batch: dict, retro: bool):
    """A micro-batch as DeepSpeed pipe wants it: (inputs for stage 0, labels for the last stage)."""
    tokens = torch.from_numpy(batch["tokens"])
    inputs = (tokens, torch.from_numpy(batch["neighbours"])) if retro and "neighbours" in batch else tokens
    return inputs, torch.from_numpy(batch["labels"])


class Trainer:
    def __init__(self, cfg, store, neighbours, run_dir: Path, log=print):
        from training.pipeline import build_pipeline, deepspeed_config
        import deepspeed

        self.cfg, self.store, self.run_dir, self.log = cfg, store, Path(run_dir), log
        self.t = cfg.train
        self.retro = cfg.model.kind == "retro"
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        module, self.descs, self.parts = build_pipeline(cfg.model, self.t)
        if self.t.init_from:
            self._retrofit(module)
        if cfg.model.freeze_trunk:
            from training.retro import freeze_trunk
            freeze_trunk(module)
        params = [p for p in module.parameters() if p.requires_grad]
        self.engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=deepspeed_config(self.t))
        check_tied_weights(self.engine, "at the start of training")
        grid = self.engine.grid
        self.dp_rank, self.dp_world = grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
        self.first, self.last = self.engine.is_first_stage(), self.engine.is_last_stage()
        # Only the first stage reads neighbours; the last stage needs just the labels.
        nbrs = neighbours if (self.retro and self.first) else None
        k = self.t.neighbours
        self.train_data = SequenceBatches(store, "train", self.t.seq_len, nbrs, k)
        self.val_data = SequenceBatches(store, "validation", self.t.seq_len, nbrs, k)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.tokens_per_step = self.t.seq_len * self.t.micro_batch_size * self.t.micro_batches * self.dp_world

    def _retrofit(self, module) -> None:
        """Start from a GPT-2 checkpoint (ours or Hugging Face): copy its trunk into this stage's layers.

        With model.freeze_trunk (RETRO-fit, paper §4.2) only CCA and encoder train afterwards.
        """
        from training.model_io import load_pretrained

        source = load_pretrained(self.t.init_from).state_dict()
        layers = [(self.descs[module._local_start + j].name, layer) for j, layer in enumerate(module.forward_funcs)
                  if isinstance(layer, torch.nn.Module)]
        # Tied modules too: a stage that holds only a later use of the embedding (the output head
        # on the last stage) sees it as a function in forward_funcs, not as a module.
        tie_names = {d.tie_key: d.name for d in self.descs if d.tie_key}
        layers += [(tie_names[key], tied) for key, tied in module.tied_modules.items()]
        for name, layer in layers:
            own = {k[len(name) + 1:]: v for k, v in source.items() if k.startswith(name + ".")}
            missing, unexpected = layer.load_state_dict(own, strict=False)
            trunk_missing = [m for m in missing if not is_retrieval_parameter(m)]
            if trunk_missing or unexpected:
                raise TrainingError(f"train.init_from={self.t.init_from}: layer {name} does not match "
                                    f"(missing {trunk_missing}, unexpected {unexpected})")
        # DeepSpeed broadcast the tied weights when it built the module, before this copy: do it again.
        module._synchronize_tied_weights()

    # -- checkpoints --
    def _latest(self) -> dict | None:
        path = self.ckpt_dir / LATEST
        return json.loads(path.read_text()) if path.exists() else None

    def resume(self) -> int:
        latest = self._latest()
        if latest is None:
            return 0
        tag = latest["tag"]
        load_path, _ = self.engine.load_checkpoint(str(self.ckpt_dir), tag=tag)
        if load_path is None:
            raise TrainingError(f"checkpoint {self.ckpt_dir / tag} could not be loaded")
        set_rng_state(torch.load(self.ckpt_dir / tag / f"rng_rank{self.rank:03d}.pt", weights_only=True))
        return int(latest["step"])

    def save(self, step: int) -> None:
        tag = f"step{step:06d}"
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
        torch.save(rng_state(), self.ckpt_dir / tag / f"rng_rank{self.rank:03d}.pt")
        dist.barrier()  # every rank's files are on disk before the checkpoint is declared complete
        if self.rank == 0:
            atomic_write_text(self.ckpt_dir / tag / STATE_FILE, json.dumps({"step": step}))
            atomic_write_text(self.ckpt_dir / LATEST, json.dumps({"tag": tag, "step": step}))
            tags = sorted(p.name for p in self.ckpt_dir.glob("step*") if p.is_dir())
            for old in tags[:-self.t.keep_checkpoints]:
                shutil.rmtree(self.ckpt_dir / old, ignore_errors=True)
        dist.barrier()

    # -- validation --
    def validate(self) -> float | None:
        per_step = self.t.micro_batch_size * self.dp_world
        n = min(self.t.eval_batches, len(self.val_data) // per_step)
        if n == 0:
            return None

        def batches():
            for j in range(n):
                start = (j * self.dp_world + self.dp_rank) * self.t.micro_batch_size
                yield _to_pipe(self.val_data.batch(np.arange(start, start + self.t.micro_batch_size)), self.retro)

        it = batches() if (self.first or self.last) else None
        return float(self.engine.eval_batch(it, num_micro_batches=n))

    # -- the loop --
    def fit(self) -> dict:
        start = self.resume()
        metrics_path = self.run_dir / "metrics.jsonl"
        writer = bar = None
        if self.rank == 0:
            _truncate_metrics(metrics_path, start)
            from torch.utils.tensorboard import SummaryWriter
            from tqdm import tqdm
            writer = SummaryWriter(str(self.run_dir / "tensorboard"))
            bar = tqdm(total=self.t.steps, initial=start, desc=f"train {self.run_dir.name}", dynamic_ncols=True)
            if start:
                self.log(f"resumed from step {start}")
        it = None
        if self.first or self.last:
            batches = micro_batches(self.train_data, start * self.t.micro_batches, self.t.micro_batch_size,
                                    self.dp_rank, self.dp_world, self.t.seed)
            it = (_to_pipe(b, self.retro) for b in batches)

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.t.precision]
        from training.hardware import matmul_flops_per_s

        peak = torch.tensor(matmul_flops_per_s(dtype, device))
        dist.all_reduce(peak)  # the whole world's peak
        fpt = flops_per_token(self.cfg.model, self.t.seq_len)
        bytes_per_token = self.store.split_bytes("validation") / max(self.store.manifest["splits"]["validation"]["tokens"], 1)
        losses, val = {}, None
        for step in range(start + 1, self.t.steps + 1):
            t0 = time.perf_counter()
            loss = float(self.engine.train_batch(data_iter=it))
            dt = time.perf_counter() - t0
            losses[step] = loss
            record = {"step": step, "loss": loss, "lr": self.engine.get_lr()[0],
                      "grad_norm": _float(self.engine.get_global_grad_norm()),
                      "tokens_per_s": self.tokens_per_step / dt, "mfu": mfu(fpt, self.tokens_per_step / dt, float(peak))}
            if (self.t.eval_every and step % self.t.eval_every == 0) or step == self.t.steps:
                val = self.validate()
                if val is not None:
                    record.update(val_loss=val, val_bpb=val / math.log(2) / bytes_per_token)
            if self.rank == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                for key, value in record.items():
                    if key != "step" and value is not None:
                        writer.add_scalar(key, value, step)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{record['mfu']:.2f}")
                bar.update(1)
            if step % self.t.checkpoint_every == 0 or step == self.t.steps:
                self.save(step)
        if self.rank == 0:
            bar.close()
            writer.close()
        return {"losses": losses, "val_loss": val, "start_step": start}


def _float(x) -> float | None:
    return None if x is None else float(x)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop lines logged after the checkpoint we resume from: they will be logged again."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))


# Settings that change how, not what, a stage computes: a run is the same run without them.
NOT_THE_RUN = {"data": {"num_workers"}, "retrieval": {"embed_batch_size", "embed_actors", "embed_device",
                                                     "recall_queries"},
               "train": {"name", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints"}}


def run_identity(cfg_dict: dict) -> dict:
    """The parts of a resolved config that decide a training run's trajectory."""
    cfg_dict = cfg_dict if isinstance(cfg_dict, dict) else {}
    retro = (cfg_dict.get("model") or {}).get("kind") == "retro"
    sections = ["data", "model", "train"] + (["retrieval"] if retro else [])
    return {f"{section}.{key}": value for section in sections for key, value in (cfg_dict.get(section) or {}).items()
            if key not in NOT_THE_RUN.get(section, ())}


def claim_run_dir(cfg, run_dir: Path, write: bool) -> None:
    """Claim run_dir for this config (write on one rank only); a run of another config is refused.

    Only what decides the run counts (`run_identity`): evaluation settings, worker counts or
    batch sizes of other stages may change between a run and its resume.
    """
    mine = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    path = run_dir / "config.yaml"
    if path.exists():
        theirs, ours = run_identity(yaml.safe_load(path.read_text())), run_identity(yaml.safe_load(mine))
        changed = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
        if changed:
            raise TrainingError(f"{run_dir} holds a run with a different config ({path}: "
                                + ", ".join(f"{k} {theirs.get(k)!r} → {ours.get(k)!r}" for k in changed[:5])
                                + "); set train.name or workdir to start another run")
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, mine)
