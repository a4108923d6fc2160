"""The small toolkit every stage's files share: atomic writes, manifests, fingerprints, the skip/redo rule.

Every stage (prepared data, embeddings, index, neighbours, a training run, an evaluation) follows
the same rules:
  - a file is written to `<name>.tmp` and moved into place with `os.replace`, so a killed process
    leaves it whole or absent, never half-written (`atomic_write`, `write_json`, `save_npy`);
  - a stage directory records what it is built from (`inputs.json`: fingerprints of what it reads
    and the settings that change its bytes); a rerun with other inputs wipes it, a rerun with the
    same inputs keeps its finished work units and resumes (`open_stage`);
  - `manifest.json`, written last, marks the stage complete; with the same inputs it is skipped.
Which config keys change a stage's output is declared once, on the config section
(`RUNTIME_KEYS`: the keys that do not), and read through `output_settings`.

The toolkit is data's because data is the one package every other imports: retrieval's stages,
training's run and the entry points use it too. So is `fault_point`, the tests' crash at a chosen
work unit: data's prepare stage and the training loop (training/run/trainer.py) both call it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from retropipe.data.errors import StageError

# The exit code of a stage a scheduler's signal stopped (SIGTERM, SIGUSR1): EX_TEMPFAIL of
# sysexits.h, "try again later". Distinct from a failure (1) and a refused config (2), so a requeue
# policy can tell them apart; the same command run again resumes (training's checkpoint, or the
# finished work units of a data or retrieval stage).
PREEMPTED = 75
# What schedulers send before they kill: Slurm (scancel, preemption, --signal=USR1@T), Kubernetes
# evictions, spot reclaims. Training (training/run/preemption.py) and the entry points
# (launch/cli.py) stop on them.
SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def tmp_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".tmp")


def atomic_write(path: Path, data: bytes) -> str:
    """Write bytes via a temp file and os.replace; return their sha256.

    (No fsync: it would cost more than the work on small shards, and only guards against power loss.)
    """
    tmp = tmp_path(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, text.encode())


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=1).encode())


def read_json(path: Path, rerun: str = "rerun the stage that writes it") -> dict | None:
    """The JSON at path, None if it does not exist, a StageError if it is corrupt."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: corrupt JSON ({e}); delete it and {rerun}") from None


def save_npy(path: Path, array: np.ndarray) -> str:
    """np.save via a temp file (np.save would append .npy to a .tmp name); returns the sha256."""
    tmp = tmp_path(path)
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
    os.replace(tmp, path)
    return sha256_file(path)


def load_npy(path: Path, mmap: bool = True, rerun: str = "rerun the stage that writes it") -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: unreadable array ({e}); delete it and {rerun}") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(obj) -> str:
    """A stable 16-hex-digit hash of a JSON-able object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def path_tag(path: str | Path) -> str:
    """A readable, unique directory name for a file or directory: its stem and a hash of its resolved
    path ("second_edition-1a2b3c4d"; a database's `<workdir>/retrieval` is named by its workdir)."""
    resolved = Path(path).expanduser().resolve()
    digest = hashlib.blake2b(str(resolved).encode(), digest_size=4).hexdigest()
    parts = [p for p in resolved.parts if p not in ("/", "retrieval")]
    name = re.sub(r"[^\w-]+", "_", (parts[-1] if parts else "db").split(".")[0]).strip("_") or "corpus"
    return f"{name}-{digest}"


def output_settings(section) -> dict:
    """The settings of a config section that change what its stage writes (all but its RUNTIME_KEYS)."""
    runtime = getattr(type(section), "RUNTIME_KEYS", ())
    return {k: v for k, v in dataclasses.asdict(section).items() if k not in runtime}


def open_stage(stage_dir: Path, inputs: dict) -> dict | None:
    """Return the stage's manifest if it is complete for these inputs; else prepare to (re)build.

    A directory built from other inputs is wiped (its partial work would be wrong); one built
    from the same inputs keeps its finished work units, so the rerun resumes.
    """
    stage_dir = Path(stage_dir)
    manifest = read_json(stage_dir / "manifest.json")
    if manifest is not None and manifest.get("inputs") == inputs:
        return manifest
    claimed = read_json(stage_dir / "inputs.json")
    if (claimed is not None and claimed != inputs) or manifest is not None:
        shutil.rmtree(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    write_json(stage_dir / "inputs.json", inputs)
    return None


# Fault injection, for tests of resumption: with RETROPIPE_KILL_AFTER=<stage>:<n> in its environment
# a process kills itself (SIGKILL: no cleanup, no flush, as `kill -9` or the OOM killer would) right
# after its n-th work unit of <stage> is on disk. A crash at a known point, instead of a test racing
# the clock to kill the process mid-run.
KILL_AFTER_ENV = "RETROPIPE_KILL_AFTER"
# The same for a whole Ray node (its raylet), read by the Ray adapters: RETROPIPE_KILL_NODE_AFTER=<unit>:<n>.
KILL_NODE_ENV = "RETROPIPE_KILL_NODE_AFTER"


def fault_point(stage: str, units_done: int) -> None:
    """Die here (SIGKILL) if RETROPIPE_KILL_AFTER names this stage and this many finished units;
    `stage:units:SIGTERM` sends that signal instead, as a scheduler would, at a known point."""
    parts = os.environ.get(KILL_AFTER_ENV, "").split(":")
    if parts[:2] == [stage, str(units_done)]:
        os.kill(os.getpid(), signal.Signals[parts[2]] if len(parts) > 2 else signal.SIGKILL)


# executor(fn, iterable of argument tuples, max_in_flight) -> iterator of fn(*args), in any order.
# launch/ray_utils.RayExecutor runs them as Ray tasks; serial_executor in this process.
Executor = Callable[[Callable, Iterable[tuple], int], Iterator]


def serial_executor(fn: Callable, jobs: Iterable[tuple], max_in_flight: int) -> Iterator:
    for args in jobs:
        yield fn(*args)
