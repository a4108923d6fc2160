"""How a training run starts: fresh, resumed (or extended), branched, or already complete.

    start = plan_start(cfg, run_dir, world_size)    # before any process group exists
    start.kind   # "fresh" | "resume" | "branch" | "complete"

- **resume**: the run directory has a complete checkpoint (`checkpoints/latest.json`). Raising
  `train.steps` on a finished run is a resume too (an *extension*): training continues from its
  last checkpoint and the cosine schedule decays to the new total from there (the schedule is
  rebuilt from the config; a checkpoint keeps only its position). Lowering `train.steps` below the
  run's newest checkpoint is refused.
- **complete**: `summary.json` says the run finished `train.steps` steps: nothing to do.
- **branch** (`train.branch_from`: another run's directory, for its newest checkpoint, or one of
  its `checkpoints/stepNNNNNN` directories): a new run that starts from that checkpoint: weights,
  AdamW moments, the schedule's position, the step counter and every rank's RNG state carry over;
  the data order continues at that step (under this run's `train.seed`). Hyperparameters come from
  this run's config (learning rates and schedule, weight decay, betas, clipping). The model, the
  pipeline cut and the number of processes must be the source's: its optimizer state is
  partitioned by them. Once the branch has a checkpoint of its own, it resumes from that.
- **fresh**: step 0, from `train.init_from`'s weights when set (checked here: a model directory
  whose GPT-2 trunk has this model's shape).

Every problem is a ConfigError naming `train.init_from`, `train.branch_from` or `train.steps`,
raised on every rank alike, before any work.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from retropipe.data.errors import ConfigError
from retropipe.data.stage import read_json
from retropipe.training.run import TrainingError
from retropipe.training.run.run_dir import ELASTIC_DIR, LATEST, STATE_FILE, checkpoint_tag, latest_checkpoint


@dataclass
class Start:
    kind: str                    # "fresh", "resume", "branch" or "complete"
    step: int = 0                # the step the loaded checkpoint finished
    ckpt_dir: Path | None = None  # its checkpoints directory and tag (resume, branch)
    tag: str = ""
    elastic: bool = False        # written by another cluster shape: resumed from its elastic/ state
    global_batch: int = 0        # sequences a step, as the checkpoint trained (0: not recorded)


def check_init_from(path: str, model) -> None:
    """train.init_from names a GPT-2 model directory (ours or Hugging Face) of this trunk's shape."""
    from retropipe.training.models.hf_interop import config_from_hf
    from retropipe.training.models.io import ModelFormatError, read_config

    where = Path(path)
    if not where.is_dir():
        raise ConfigError("train.init_from", f"{path}: no such directory (a GPT-2 model directory: a run's "
                          "model/, or a Hugging Face one from launch/convert_gpt2.py)")
    config = where / "config.json"
    try:
        raw = json.loads(config.read_text()) if config.is_file() else None
        if raw is None:
            raise ModelFormatError(f"{path}: no config.json (not a model directory)")
        source = config_from_hf(raw) if raw.get("model_type") == "gpt2" else read_config(where)
    except (ValueError, TypeError) as e:  # ModelFormatError, HFFormatError, JSONDecodeError are ValueErrors
        raise ConfigError("train.init_from", str(e)) from None
    if source.kind != "gpt2":
        raise ConfigError("train.init_from", f"{path}: a {source.kind!r} model; a warm start reads a GPT-2")
    differ = model.trunk_differences(source)
    if differ:
        raise ConfigError("train.init_from", f"{path}: its GPT-2 has another shape than this model ("
                          + ", ".join(differ) + ")")


def resolve_checkpoint(path: str) -> tuple[Path, str, int]:
    """(checkpoints directory, tag, step) of a run directory's newest checkpoint or of a checkpoint."""
    where = Path(path)
    if (where / "checkpoints" / LATEST).is_file():
        latest = latest_checkpoint(where / "checkpoints")
        return where / "checkpoints", latest["tag"], int(latest["step"])
    if (where / STATE_FILE).is_file():
        return where.parent, where.name, int(read_json(where / STATE_FILE)["step"])
    what = "holds no complete checkpoint" if where.is_dir() else "does not exist"
    raise ConfigError("train.branch_from", f"{path} {what} (give a run directory with "
                      f"checkpoints/{LATEST}, or a checkpoint directory with {STATE_FILE})")


def check_branch(cfg, run_dir: Path, world_size: int, parts: list[int]) -> Start:
    """The checkpoint train.branch_from names, checked against this run's model, cut and world."""
    ckpt_dir, tag, step = resolve_checkpoint(cfg.train.branch_from)
    source_run = ckpt_dir.parent
    if source_run.resolve() == Path(run_dir).resolve():
        raise ConfigError("train.branch_from", f"{cfg.train.branch_from} is this run's own checkpoint; "
                          "a run resumes from its own checkpoints by itself")
    source_cfg = yaml.safe_load((source_run / "config.yaml").read_text()) if (source_run / "config.yaml").is_file() \
        else None
    if not isinstance(source_cfg, dict):
        raise ConfigError("train.branch_from", f"{source_run} has no config.yaml: not a training run directory")
    ours = cfg.to_dict()
    differ = [f"model.{k} {v!r} vs {ours['model'].get(k)!r}" for k, v in (source_cfg.get("model") or {}).items()
              if ours["model"].get(k) != v]
    source_train = source_cfg.get("train") or {}
    differ += [f"train.{k} {source_train.get(k)!r} vs {ours['train'][k]!r}" for k in ("pipeline_stages", "precision")
               if source_train.get(k) != ours["train"][k]]
    source_parts = (read_json(source_run / "partition.json") or {}).get("parts")
    if source_parts is not None and source_parts != parts:
        differ.append(f"pipeline cut {source_parts} vs {parts} (train.partition)")
    writers = len(list((ckpt_dir / tag).glob("rng_rank*.pt")))
    if writers != world_size:
        differ.append(f"{writers} processes vs {world_size}")
    if differ:
        raise ConfigError("train.branch_from", f"{ckpt_dir / tag} continues only the same model on the same "
                          "pipeline; it differs in " + ", ".join(differ[:5]))
    if step >= cfg.train.steps:
        raise ConfigError("train.steps", f"{cfg.train.steps}, but the checkpoint train.branch_from names "
                          f"({ckpt_dir / tag}) is at step {step}: nothing to train")
    return Start("branch", step, ckpt_dir, tag)


def resume_from(checkpoint: Path, step: int, stored_parts: list[int] | None, world_size: int,
                parts: list[int]) -> Start:
    """A resume from `checkpoint`: DeepSpeed's own load where this job has the shape that wrote it
    (processes and stages; DeepSpeed partitions the optimizer state by them), else the checkpoint's
    elastic/ state (training/pipeline/elastic_state.py); a TrainingError where it has none."""
    state = read_json(checkpoint / STATE_FILE) or {}
    # Checkpoints written before state.json recorded the shape: one RNG file per process.
    processes = state.get("processes") or len(list(checkpoint.glob("rng_rank*.pt")))
    stages = state.get("pipeline_stages") or (len(stored_parts) - 1 if stored_parts else len(parts) - 1)
    start = Start("resume", step, checkpoint.parent, checkpoint.name, global_batch=state.get("global_batch", 0))
    if (processes, stages) == (world_size, len(parts) - 1):
        return start
    if (checkpoint / ELASTIC_DIR).is_dir():
        start.elastic = True
        return start

    def shape(world: int, s: int) -> str:
        return f"{world} processes ({s} pipeline stages × {world // max(s, 1)} data-parallel replicas)"
    raise TrainingError(f"{checkpoint} was written by {shape(processes, stages)} and holds no {ELASTIC_DIR}/ state "
                        f"(an older RetroPipe's checkpoint); this job has {shape(world_size, len(parts) - 1)}. "
                        f"Resume it on {processes} processes with train.pipeline_stages={stages} once; its next "
                        "checkpoint resumes on any shape")


def keep_global_batch(train, world_size: int, start: Start):
    """train with the micro-batches that make a step train on the global batch: train.global_batch,
    or on a resume the checkpoint's (then train.global_batch, if set, must be the same); unchanged
    where neither is set (micro_batch_size × micro_batches × replicas). A ConfigError where the
    replicas cannot split it into micro-batches of train.micro_batch_size."""
    if start.global_batch and train.global_batch and start.global_batch != train.global_batch:
        raise ConfigError("train.global_batch", f"{train.global_batch}, but the run being resumed trains on "
                          f"{start.global_batch} sequences a step ({start.ckpt_dir / start.tag})")
    wanted = train.global_batch or start.global_batch
    if not wanted:
        return train
    replicas = world_size // train.pipeline_stages
    per_micro_batch = train.micro_batch_size * replicas
    if wanted % per_micro_batch:
        raise ConfigError("train.global_batch", f"{wanted} sequences a step do not split into micro-batches of "
                          f"{train.micro_batch_size} (train.micro_batch_size) over {replicas} data-parallel "
                          f"replicas; run on a number of replicas that divides {wanted // train.micro_batch_size}")
    return dataclasses.replace(train, micro_batches=wanted // per_micro_batch, global_batch=wanted)


def plan_start(cfg, run_dir: Path, world_size: int, parts: list[int]) -> Start:
    """Where this run starts (see the module docstring); reads files only."""
    t, run_dir = cfg.train, Path(run_dir)
    summary = read_json(run_dir / "summary.json", rerun="rerun training without it")
    latest = latest_checkpoint(run_dir / "checkpoints")
    if summary is not None and summary.get("steps") == t.steps:
        return Start("complete", t.steps)
    if latest is not None:
        step = int(latest["step"])
        if step > t.steps:
            raise ConfigError("train.steps", f"{t.steps}, but {run_dir} has trained {step} steps already (newest "
                              f"checkpoint {checkpoint_tag(step)}); to continue from an earlier step, start a new "
                              "run with train.branch_from set to one of its checkpoints")
        stored = (read_json(run_dir / "partition.json") or {}).get("parts")
        if stored and stored[-1] != parts[-1]:  # another cut of the same layers resumes; other layers do not
            raise TrainingError(f"{run_dir}'s checkpoints hold a model of {stored[-1]} pipeline layers, but this "
                                f"RetroPipe builds {parts[-1]} for the same config (its layer list changed since): "
                                "they cannot be resumed; start a new run (train.name)")
        return resume_from(run_dir / "checkpoints" / latest["tag"], step, stored, world_size, parts)
    if summary is not None:
        raise TrainingError(f"{run_dir} finished {summary.get('steps')} steps but holds no checkpoint to continue "
                            "from; start a new run (train.name) instead")
    if t.branch_from:
        return check_branch(cfg, run_dir, world_size, parts)
    if t.init_from:
        check_init_from(t.init_from, cfg.model)
    return Start("fresh")
