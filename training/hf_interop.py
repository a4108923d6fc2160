"""Exact interchange with Hugging Face `transformers` GPT-2 (`GPT2LMHeadModel`).

    gpt2_from_hf(hf_model_or_dir) -> GPT2      save_hf(model, out_dir)      to_hf(model) -> GPT2LMHeadModel

The two models compute the same function: pre-LN blocks, tanh GELU ("gelu_new"), LayerNorm eps
1e-5, tied embeddings. Only the names and the layout differ: HF keeps `transformer.h.i.*`
where we keep `blocks.i.*`, and its Conv1D stores weights as (in, out) where nn.Linear stores
(out, in). A Hugging Face directory is config.json + model.safetensors (or a sharded index, or
pytorch_model.bin, read with torch.load(weights_only=True)); it is read without importing
transformers, which only `to_hf` needs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from training.config import ModelConfig
from training.model import GPT2

# HF Conv1D weights, stored transposed relative to nn.Linear.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class HFFormatError(ValueError):
    pass


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig of an HF GPT-2 config.json dict; rejects variants we do not compute the same."""
    if hf.get("model_type") != "gpt2":
        raise HFFormatError(f"not a GPT-2 config (model_type {hf.get('model_type')!r})")
    checks = {
        "activation_function": (hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": hf.get("n_inner") in (None, 4 * hf["n_embd"]),
        "layer_norm_epsilon": abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) < 1e-12,
        "scale_attn_weights": hf.get("scale_attn_weights", True) is True,
        "scale_attn_by_inverse_layer_idx": hf.get("scale_attn_by_inverse_layer_idx", False) is False,
        "tie_word_embeddings": hf.get("tie_word_embeddings", True) is True,
    }
    for key, ok in checks.items():
        if not ok:
            raise HFFormatError(f"unsupported GPT-2 variant: {key} = {hf.get(key)!r}")
    dropout = max(hf.get(key, 0.0) or 0.0 for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    return ModelConfig(kind="gpt2", vocab_size=hf["vocab_size"], n_positions=hf["n_positions"],
                       n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=dropout)


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.kind != "gpt2":
        raise HFFormatError(f"only GPT-2 models export to Hugging Face, this one is {cfg.kind!r}")
    eot = min(50256, cfg.vocab_size - 1)  # GPT-2's <|endoftext|>, kept inside small test vocabularies
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
            "n_positions": cfg.n_positions, "n_ctx": cfg.n_positions, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_embd": cfg.n_embd, "n_inner": None, "activation_function": "gelu_new",
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "bos_token_id": eot, "eos_token_id": eot,
            "torch_dtype": "float32"}


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd = {}
    for key, value in hf_sd.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers; the head is the tied wte
        if key.startswith("h."):
            key = "blocks." + key[2:]
            if key.endswith(CONV1D):
                value = value.t()
        elif key not in ("wte.weight", "wpe.weight") and not key.startswith("ln_f."):
            raise HFFormatError(f"unexpected tensor {key!r} in the Hugging Face state dict")
        sd[key] = value.contiguous()
    head = hf_sd.get("lm_head.weight")
    if head is not None and "wte.weight" in sd and not torch.equal(head, sd["wte.weight"]):
        raise HFFormatError("lm_head.weight differs from wte.weight: untied heads are not supported")
    return sd


def state_dict_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = {}
    for key, value in sd.items():
        if key.startswith("blocks."):
            if key.endswith(CONV1D):
                value = value.t()
            key = "h." + key[len("blocks."):]
        hf["transformer." + key] = value.detach().contiguous()
    return hf


def _read_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    if not (path / "config.json").is_file():
        raise HFFormatError(f"{path}: no config.json (not a Hugging Face model directory)")
    hf_cfg = json.loads((path / "config.json").read_text())
    if (path / "model.safetensors").is_file():
        return hf_cfg, load_file(path / "model.safetensors")
    if (path / "model.safetensors.index.json").is_file():
        shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
        return hf_cfg, {k: v for shard in sorted(shards) for k, v in load_file(path / shard).items()}
    if (path / "pytorch_model.bin").is_file():
        return hf_cfg, torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise HFFormatError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def gpt2_from_hf(source) -> GPT2:
    """Our GPT2 (eval mode, fp32) from a `GPT2LMHeadModel` or a Hugging Face model directory."""
    where = str(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__
    try:
        if isinstance(source, (str, os.PathLike)):
            hf_cfg, hf_sd = _read_hf_dir(Path(source))
        else:
            hf_cfg, hf_sd = source.config.to_dict(), source.state_dict()
        cfg = config_from_hf(hf_cfg)
        model = GPT2(cfg)
        sd = {k: v.float() for k, v in state_dict_from_hf(hf_sd, cfg).items()}
        model.load_state_dict(sd, strict=True)
    except HFFormatError as e:
        raise HFFormatError(f"{where}: {e}") from None
    except (KeyError, RuntimeError, SafetensorError, json.JSONDecodeError) as e:
        # A config key or tensor missing, a wrong shape, a corrupt file.
        raise HFFormatError(f"{where}: not a usable Hugging Face GPT-2 ({type(e).__name__}: {e})") from None
    return model.eval()


def save_hf(model: GPT2, out_dir: str | os.PathLike) -> None:
    """Write a directory that `GPT2LMHeadModel.from_pretrained(out_dir)` loads (fp32 safetensors)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_hf(model.cfg), indent=2) + "\n")
    hf_sd = {k: v.float() for k, v in state_dict_to_hf(model.state_dict()).items()}
    save_file(hf_sd, out / "model.safetensors", metadata={"format": "pt"})


def to_hf(model: GPT2):
    """An in-memory `transformers.GPT2LMHeadModel` (eval mode) with our weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(**config_to_hf(model.cfg)))
    missing, unexpected = hf.load_state_dict(state_dict_to_hf(model.state_dict()), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise HFFormatError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()
