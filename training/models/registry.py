"""Which class a model config builds, and its layer list.

    model = build_model(cfg)                     # GPT2 or Retro, per cfg.kind
    descs = layer_list(cfg, fused_head=True)     # what pipeline stages are cut from

A new model variant is a class (usually a subclass of GPT2 or Retro) added to MODEL_CLASSES and to
ModelConfig.kind's values; nothing outside training/models/ names the classes.
"""

from __future__ import annotations

import torch.nn as nn

from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2
from retropipe.training.models.layers import LayerDesc
from retropipe.training.models.retro import Retro

MODEL_CLASSES: dict[str, type[GPT2]] = {"gpt2": GPT2, "retro": Retro}


def model_class(cfg: ModelConfig) -> type[GPT2]:
    return MODEL_CLASSES[cfg.kind]


def build_model(cfg: ModelConfig, layer_seed: int | None = None, fused_head: bool = False) -> nn.Module:
    """The model of cfg.kind (see GPT2 for layer_seed and fused_head)."""
    return model_class(cfg)(cfg, layer_seed=layer_seed, fused_head=fused_head)


def layer_list(cfg: ModelConfig, fused_head: bool = False) -> list[LayerDesc]:
    """The model's layers in order (training/models/layers.py)."""
    return model_class(cfg).layer_list(cfg, fused_head)
