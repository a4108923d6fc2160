"""Files of the retrieval database: atomic writes, manifests, and the skip/redo rule of a stage.

Every stage directory (`embeddings/`, `index/`, `neighbours/`) follows one rule:
  - `inputs.json` records the fingerprints of what the stage reads (and the settings that change
    its bytes). A rerun with other inputs wipes the directory: partial work of a different
    build must never be mixed in.
  - Work units (shards) are written with a temp file then `os.replace`, so a killed process
    leaves a unit whole or absent, and a rerun redoes only the absent ones.
  - `manifest.json`, written last, marks the stage complete; with matching inputs the stage is
    skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

MANIFEST_VERSION = 1


class RetrievalError(ValueError):
    """A bad retrieval input or a stale/corrupt retrieval file; the message names the file or key."""


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def save_npy(path: Path, array: np.ndarray) -> str:
    """np.save via a temp file (np.save would append .npy to a .tmp name); returns the sha256."""
    tmp = tmp_path(path)
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
    os.replace(tmp, path)
    return sha256_file(path)


def load_npy(path: Path, mmap: bool = True) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise RetrievalError(f"{path}: unreadable array ({e}); delete it and run build_index again") from None


def write_json(path: Path, obj: dict) -> None:
    tmp = tmp_path(path)
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RetrievalError(f"{path}: corrupt JSON ({e}); delete it and run build_index again") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def open_stage(stage_dir: Path, inputs: dict) -> dict | None:
    """Return the stage's manifest if it is complete for these inputs; else prepare to (re)build.

    A directory built from other inputs is wiped (its partial shards would be wrong); one built
    from the same inputs keeps its finished shards, so the rerun resumes.
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
