"""AdamW parameter groups: what decays, and what learns at its own rate.

Weight decay shrinks matrices (linear and embedding weights), not biases, layer-norm gains or
the CCA's relative position bias (nanoGPT's rule: decay parameters with >= 2 dimensions).
The CCA position bias (training/cca.py) is a handful of scalars per head that must move by
whole logits for a layer to attend "same position in the neighbour": at the trunk's learning
rate it takes thousands of steps, at `train.position_bias_lr` a few dozen (docs/results.md).
The schedule (warmup, cosine decay) scales every group's rate alike.
"""

from __future__ import annotations

from torch import nn


def parameter_groups(module: nn.Module, position_bias_lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups of module's trainable parameters; empty groups are left out."""
    decay, no_decay, position = [], [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("position_bias"):
            position.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": position, "weight_decay": 0.0, "lr": position_bias_lr}]
    return [g for g in groups if g["params"]]
