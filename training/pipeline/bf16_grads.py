"""bf16 training's gradient accumulation: each micro-batch's bf16 gradients added to their fp32 copies
in one call after its backward, instead of DeepSpeed's one Python hook per parameter during it.

    add_grads_in_one_call(engine) -> bool   # after deepspeed.initialize; False: DeepSpeed's own way stays

DeepSpeed's BF16_Optimizer keeps fp32 gradients beside the bf16 model's. With `immediate_grad_update`
it adds each parameter's bf16 gradient into its fp32 one from a hook that autograd calls as the
gradient is made: one Python call per parameter per micro-batch (148 for GPT-2 small), each a cast
to a new fp32 tensor and an add. On a GPU the host must queue a backward's thousands of kernels ahead
of the GPU, and these calls cost it as much as the rest of the backward's host work: one GPU step of
GPT-2 small went 0.80x the plain loop's speed through the engine (docs/benchmarks.md, "GPU: one
NVIDIA H200"). Without `immediate_grad_update`, DeepSpeed zeroes every bf16 gradient before each
micro-batch (a pass over the tied (vocab, d) matrix) and adds them after its backward, again one
parameter at a time. Here, after each backward: one `torch._foreach_add_` of every bf16 gradient
into its fp32 one (the fp32 sum of the same numbers, bit for bit), and the bf16 gradients let go as
the hooks let them go, so the next backward writes its gradients instead of adding into zeros.
"""
from __future__ import annotations

import torch

# What the replacement reads and writes on DeepSpeed's BF16_Optimizer (0.15 to 0.19 at least).
_NEEDS = ("bf16_groups", "fp32_groups_gradients", "fp32_groups_has_gradients", "immediate_grad_update",
          "update_hp_grads")


def add_grads_in_one_call(engine) -> bool:
    """Replace the engine's bf16 optimizer's `update_hp_grads` (the call DeepSpeed makes after each
    micro-batch's backward when `bf16.immediate_grad_update` is off) with one foreach add.

    Leaves DeepSpeed's own accumulation, and returns False, where there is no bf16 optimizer, where
    `immediate_grad_update` is on (train.deepspeed may ask for it) or where the optimizer lacks what
    the replacement uses (another DeepSpeed).
    """
    optimizer = engine.optimizer
    if not all(hasattr(optimizer, name) for name in _NEEDS) or optimizer.immediate_grad_update:
        return False
    if getattr(optimizer, "autoep_folding_tp_group", None) is not None:  # its per-parameter correction
        return False

    @torch.no_grad()
    def update_hp_grads(clear_lp_grads: bool = False) -> None:
        fp32, bf16 = [], []
        for i, group in enumerate(optimizer.bf16_groups):
            for j, param in enumerate(group):
                if param.grad is None:  # frozen, or on no path from this stage's loss
                    continue
                hp_grad = optimizer.fp32_groups_gradients[i][j]
                fp32.append(hp_grad)
                bf16.append(param.grad.view(hp_grad.shape))
                param._hp_grad = hp_grad  # what the pipe engine all-reduces for tied weights
                optimizer.fp32_groups_has_gradients[i][j] = True
                param.grad = None  # as immediate_grad_update does: nothing reads it before the step
        if fp32:
            torch._foreach_add_(fp32, bf16)  # fp32 += bf16, computed in fp32, as DeepSpeed's cast and add

    optimizer.update_hp_grads = update_hp_grads
    return True
