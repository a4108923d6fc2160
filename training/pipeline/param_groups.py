"""AdamW's parameter groups: weight decay on matrices, none on biases and LayerNorm weights.

    groups = parameter_groups(stage_module, weight_decay=0.1)
    # [{"name": "decay", "params": [...], "weight_decay": 0.1},
    #  {"name": "no_decay", "params": [...], "weight_decay": 0.0}]

nanoGPT's rule: a parameter with two or more dimensions (the linear layers' weights, the token
and position embeddings) decays; vectors (biases, LayerNorm gains and shifts) do not: shrinking
them towards zero is no useful prior. The CCA's relative position bias is a table (heads ×
offsets) but a bias all the same: it must grow to whole logits for a layer to attend "the same
position in the neighbour" (ModelConfig.position_bias_scale), and decay would pull it back.

Why the same two groups, in the same order, on every pipeline stage: DeepSpeed's pipelined ZeRO-1
optimizer all-reduces one gradient norm *per group* across the pipeline stages (a collective per
group index), so a stage with fewer groups leaves the others waiting forever. A stage whose
layers hold no parameter of a group (e.g. a stage of only the token and position embeddings has
no vector) would give DeepSpeed an empty group, which its ZeRO optimizer cannot flatten; such a
stage gets a one-element placeholder parameter in that group, registered on the stage's module
(so DeepSpeed can name it in its checkpoints), zero, and never used by the forward: its gradient
is zero, so it neither moves nor adds to the gradient norm.
"""

from __future__ import annotations

import torch
import torch.nn as nn

GROUPS = ("decay", "no_decay")


def placeholder_name(group: str) -> str:
    """The parameter registered for a group that would be empty: always zero, never trained."""
    return f"empty_{group}_group"


def decays(name: str, param: torch.Tensor) -> bool:
    return param.dim() >= 2 and not name.endswith("position_bias")


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters of `module` in the two groups of GROUPS, in that order, each
    non-empty (a placeholder parameter is registered on `module` for an empty one)."""
    members = {name: [] for name in GROUPS}
    for name, p in module.named_parameters():  # each parameter once, even if tied
        if p.requires_grad:
            members["decay" if decays(name, p) else "no_decay"].append(p)
    groups = []
    for name in GROUPS:
        if not members[name]:
            placeholder = nn.Parameter(torch.zeros(1))
            module.register_parameter(placeholder_name(name), placeholder)
            members[name] = [placeholder]
        groups.append({"name": name, "params": members[name], "weight_decay": weight_decay if name == "decay" else 0.0})
    return groups



def restore_group_settings(optimizer: torch.optim.Optimizer, weight_decay: float, betas: tuple[float, float],
                           fused: bool | None) -> None:
    """After a checkpoint's optimizer state is loaded: this run's settings, not the saved ones.

    torch's `load_state_dict` replaces every group's settings with the checkpoint's, so a run
    resumed or branched from a checkpoint saved with another weight decay, betas or step kind
    would keep those. `fused` (torch's one-kernel AdamW step; None where the optimizer has no such
    setting) also needs each parameter's `step` counter as a float32 tensor on the parameter's
    device, which torch arranges only when the *saved* group was fused.
    """
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay if group.get("name", "decay") == "decay" else 0.0
        if "betas" in group:
            group["betas"] = betas
        if "fused" in group and fused is not None:
            group["fused"] = fused
            for p in group["params"] if fused else ():
                state = optimizer.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
