"""A training run's directory: which run it holds, its checkpoints' bookkeeping, its metrics file.

A run directory `<workdir>/runs/<name>/` holds:
    config.yaml          the resolved config (a rerun with another config is refused)
    rules.json           the rules training follows beside its config: the neighbour alignment rule
    partition.json       the stage boundaries and the layers of each stage
    metrics.jsonl        one line per step (loss, lr, grad_norm, tokens_per_s, mfu) and per validation
    deepspeed_config.json  the DeepSpeed config as DeepSpeed got it (generated + train.deepspeed)
    tensorboard/         the same scalars, and the config as text and hyperparameters (metrics_log.py)
    checkpoints/stepNNNNNN/   DeepSpeed's per-layer checkpoint + rng_rankNNN.pt + state.json (the step,
                         and the shape and global batch that wrote it) + elastic/ (any shape's)
    checkpoints/latest.json   the newest complete checkpoint (written last, atomically)
    model/               the exported model (config.json + model.safetensors), when done
    summary.json         written last: the run is complete

Plain files and YAML, no DeepSpeed: launch/train.py decides here, before any process group
exists, whether a run starts, resumes or is already complete.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import yaml

from retropipe.data.reading import Reading
from retropipe.data.stage import atomic_write_text, read_json, write_json
from retropipe.training.models.config import BEFORE_THE_FIELD, RETRIEVING_KINDS
from retropipe.training.run import TrainingError

STATE_FILE, LATEST, RULES_FILE = "state.json", "latest.json", "rules.json"
# In a checkpoint: the state whole by parameter, which any cluster shape resumes from
# (training/pipeline/elastic_state.py).
ELASTIC_DIR = "elastic"


# --- which run a directory holds ---------------------------------------------------------------

# Keys of other sections that training reads although they do not change those sections' files
# (alignment is applied when neighbours are read): they do change the run.
TRAINING_READS = {"retrieval": ("align_neighbours",)}
# train keys whose default is not what a run had before the key existed (a resolved config holds
# a share; "auto" came later, and a run without the key had none).
TRAIN_BEFORE_THE_FIELD = {"distractor_neighbours": 0.0}
# A run with more steps is the same run extended (training/run/start.py), not another run.
EXTENDS_THE_RUN = ("train.steps",)


def section_defaults(section) -> dict:
    """A config section's default values, as a config.yaml holds them (tuples as lists)."""
    out = {}
    for f in dataclasses.fields(section):
        if f.default is not dataclasses.MISSING:
            out[f.name] = list(f.default) if isinstance(f.default, tuple) else f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def run_identity(cfg, cfg_dict: dict) -> dict:
    """The parts of a resolved config (as a dict, e.g. a run's config.yaml) that decide a training
    run's trajectory: every key of data, model, train (and retrieval for RETRO) except each
    section's own RUNTIME_KEYS, the keys that do not change what its stage computes."""
    cfg_dict = cfg_dict if isinstance(cfg_dict, dict) else {}
    retro = (cfg_dict.get("model") or {}).get("kind") in RETRIEVING_KINDS
    identity = {}
    for section in ["data", "model", "train"] + (["retrieval"] if retro else []):
        runtime = set(getattr(type(getattr(cfg, section)), "RUNTIME_KEYS", ())) - set(TRAINING_READS.get(section, ()))
        # A key added to RetroPipe after the run was made counts as its default, which is what
        # the run had: a run directory of an older version still resumes (or is still complete).
        # (BEFORE_THE_FIELD: where the default is not what a run had before the key existed.)
        before = {"model": BEFORE_THE_FIELD, "train": TRAIN_BEFORE_THE_FIELD}.get(section, {})
        values = {**section_defaults(getattr(cfg, section)), **before, **(cfg_dict.get(section) or {})}
        identity.update({f"{section}.{key}": value for key, value in values.items()
                         if key not in runtime and f"{section}.{key}" not in EXTENDS_THE_RUN})
    return identity


def read_run_config(run_dir: Path) -> dict | None:
    """A run directory's config.yaml as a dict; None where it is missing, unreadable or not a
    mapping. Never raises: for callers that only describe a run (reports, hints)."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: not UTF-8
        return None
    return cfg if isinstance(cfg, dict) else None


def rules_beside_config(cfg) -> dict:
    """What a run's trajectory depends on beside its config: the rule that lines up a RETRO run's
    neighbours (data/reading.py), which a newer RetroPipe may change under the same config."""
    reads = cfg.model.retrieves or cfg.model.in_context
    rule = Reading.for_training(cfg.retrieval).alignment_rule if reads else None
    return {"alignment_rule": rule}


def run_dir_conflict(cfg, run_dir: Path) -> str | None:
    """Why run_dir cannot hold a run of cfg (it holds a run of another config, or one trained
    under another rule), or None: empty, or this config's own run (resumed or complete)."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    theirs = run_identity(cfg, yaml.safe_load(path.read_text()))
    ours = run_identity(cfg, yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False)))
    changed = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if changed:
        return (f"{run_dir} holds a run with a different config ({path}: "
                + ", ".join(f"{k} {theirs.get(k)!r} → {ours.get(k)!r}" for k in changed[:5]) + ")")
    # A run directory of a version before rules.json says nothing: it is not refused.
    theirs = read_json(run_dir / RULES_FILE, rerun="delete it to resume the run unchecked") or {}
    ours = rules_beside_config(cfg)
    changed = sorted(k for k in theirs if theirs[k] != ours.get(k))
    if changed:
        return (f"{run_dir} holds a run trained under another rule ({run_dir / RULES_FILE}: "
                + ", ".join(f"{k} {theirs[k]!r} → {ours.get(k)!r}" for k in changed) + ")")
    return None


def claim_run_dir(cfg, run_dir: Path, write: bool) -> None:
    """Claim run_dir for this config (write on one rank only); a run of another config is refused.

    Only what decides the run counts (`run_identity`): evaluation settings, worker counts or
    batch sizes of other stages may change between a run and its resume, and train.steps may grow.
    """
    mine = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    path = run_dir / "config.yaml"
    conflict = run_dir_conflict(cfg, run_dir)
    if conflict:
        raise TrainingError(f"{conflict}; set train.name or workdir to start another run")
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not path.exists():  # a new run reads what this version reads; an older one is not relabelled
            write_json(run_dir / RULES_FILE, rules_beside_config(cfg))
        atomic_write_text(path, mine)


# --- checkpoints ----------------------------------------------------------------------------------

def checkpoint_tag(step: int) -> str:
    return f"step{step:06d}"


def latest_checkpoint(ckpt_dir: Path) -> dict | None:
    """{"tag", "step"} of the newest complete checkpoint under ckpt_dir, or None."""
    return read_json(Path(ckpt_dir) / LATEST, rerun="rerun training without it (it restarts the run)")


def declare_checkpoint(ckpt_dir: Path, step: int, keep: int, shape: dict | None = None) -> None:
    """Mark the checkpoint of `step` complete (every rank's files are on disk); keep the newest
    `keep` complete ones, and drop the incomplete ones a killed run left before this step. shape:
    {"processes", "pipeline_stages"} of the world that wrote it, which a resume must have."""
    tag = checkpoint_tag(step)
    write_json(ckpt_dir / tag / STATE_FILE, {"step": step, **(shape or {})})
    write_json(ckpt_dir / LATEST, {"tag": tag, "step": step})
    tags = sorted(p.name for p in ckpt_dir.glob("step*") if p.is_dir())
    complete = [t for t in tags if (ckpt_dir / t / STATE_FILE).is_file()]
    stale = [t for t in tags if t < tag and t not in complete]
    for old in complete[:-keep] + stale:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)


# --- metrics.jsonl ---------------------------------------------------------------------------------

def truncate_metrics(path: Path, step: int) -> None:
    """Drop lines logged after the checkpoint we resume from: they will be logged again."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))
