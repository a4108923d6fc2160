"""Our model directory: config.json (the ModelConfig fields plus "format") + model.safetensors.

    save_model(model, dir)          load_model(dir) -> GPT2 | Retro (eval mode)
    load_pretrained(dir) -> GPT2    # ours or a Hugging Face GPT-2 directory
    retrofit(dir or GPT2) -> Retro  # RETRO around a trained GPT-2, its trunk frozen (paper §4.2)

Training exports this directory; evaluation, generation and RETRO-fit read it. Writes go to a
temporary sibling directory first and are moved into place with os.replace, so a reader never
sees half a model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from retropipe.training.models import ModelFormatError
from retropipe.training.models.registry import build_model
from retropipe.training.models.config import BEFORE_THE_FIELD, ModelConfig
from retropipe.training.models.gpt2 import GPT2
from retropipe.training.models.retro import Retro, is_retrieval_parameter


FORMAT = "retropipe-model/1"


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished tmp directory to out, replacing an older out if there is one."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_dir_atomically(out_dir: str | os.PathLike, write) -> Path:
    """Call write(tmp_dir) on a fresh sibling of out_dir, then move it into place."""
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save_model(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write model.cfg and the weights (in their current dtype) to out_dir."""
    cfg: ModelConfig = model.cfg
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}

    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps({"format": FORMAT, **dataclasses.asdict(cfg)}, indent=2) + "\n")
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "retropipe": FORMAT})

    return write_dir_atomically(out_dir, write)


def read_config(model_dir: str | os.PathLike) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{model_dir}: no config.json (not a model directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}: not JSON ({e})") from None
    if not isinstance(raw, dict) or raw.pop("format", None) != FORMAT:
        raise ModelFormatError(f"{path}: not a RetroPipe model (expected \"format\": \"{FORMAT}\"; "
                               "for a Hugging Face directory use launch/convert_gpt2.py --from-hf)")
    raw = {**BEFORE_THE_FIELD, **raw}
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ModelFormatError(f"{path}: unknown model config keys {unknown}")
    return ModelConfig(**raw)


def load_model(model_dir: str | os.PathLike, device: str | torch.device = "cpu") -> nn.Module:
    """GPT2 or Retro (per config.json "kind") with its weights, in eval mode on `device`."""
    cfg = read_config(model_dir)
    weights = Path(model_dir) / "model.safetensors"
    if not weights.is_file():
        raise ModelFormatError(f"{model_dir}: no model.safetensors")
    model = build_model(cfg)
    try:
        model.load_state_dict(load_file(weights), strict=True)
    except (RuntimeError, SafetensorError) as e:
        raise ModelFormatError(f"{weights}: does not match its config.json ({e})") from None
    return model.to(device).eval()


def load_pretrained(model_dir: str | os.PathLike) -> GPT2:
    """A GPT-2 from our directory or from a Hugging Face one (told apart by config.json)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{model_dir}: no config.json (not a model directory)")
    if json.loads(path.read_text()).get("model_type") == "gpt2":
        from retropipe.training.models.hf_interop import gpt2_from_hf
        return gpt2_from_hf(model_dir)
    model = load_model(model_dir)
    if model.cfg.kind != "gpt2":
        raise ModelFormatError(f"{model_dir}: expected a GPT-2 model, found kind {model.cfg.kind!r}")
    return model


def retrofit(source: GPT2 | str | os.PathLike, retro_cfg: ModelConfig | None = None) -> Retro:
    """RETRO-fit (paper §4.2): RETRO around a trained GPT-2 whose trunk is frozen.

    `source`: a GPT2 model, or a directory (ours, or a Hugging Face GPT-2 one). `retro_cfg`: the
    RETRO config (kind 'retro'; its trunk fields must match the checkpoint's); None = the
    checkpoint's config with kind 'retro' and the default CCA layers and encoder. Returns a
    model in train mode with freeze_trunk=True: only CCA and encoder parameters require grad.
    """
    if isinstance(source, (str, os.PathLike)):
        source = load_pretrained(source)
    if not isinstance(source, GPT2) or source.cfg.kind != "gpt2":
        raise ValueError(f"retrofit needs a GPT-2 model or checkpoint, got {type(source).__name__}")
    if retro_cfg is None:
        retro_cfg = dataclasses.replace(source.cfg, kind="retro")
    differ = retro_cfg.trunk_differences(source.cfg)
    if differ:
        raise ValueError(f"retrofit: the RETRO config and the GPT-2 checkpoint differ in {', '.join(differ)}")
    retro_cfg = dataclasses.replace(retro_cfg, kind="retro", freeze_trunk=True)
    model = Retro(retro_cfg)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    trunk_missing = [k for k in missing if not is_retrieval_parameter(k)]
    if unexpected or trunk_missing:
        raise ValueError(f"retrofit: state dict mismatch, unexpected {unexpected}, missing {trunk_missing}")
    return model.train()
