"""bf16 training's gradient accumulation: each micro-batch's bf16 gradients added to their fp32 copies
in one call after its backward, instead of DeepSpeed's one Python hook per parameter during it.

    add_grads_in_one_call(engine) -> bool   # after deepspeed.initialize; False: DeepSpeed's own way stays

DeepSpeed's BF16_Optimizer keeps fp32 gradients beside the bf16 model's. With `immediate_grad_update`
it adds each parameter's bf16 gradient into its fp32 one from a hook that autograd calls as the
gradient is made: one Python call per parameter per micro-batch (148 for GPT-2 small), each a cast
to a new fp32 tensor and an add. On a GPU the host must queue a backward's thousands of kernels ahead
of the GPU, and these calls cost it as much as the rest of the backward's host work: one GPU step of
GPT-2 small went 0.66x the plain loop's speed through the engine, 0.95x without them
(docs/benchmarks.md, "DeepSpeed's engine on an H200"). Without `immediate_grad_update`, DeepSpeed
zeroes every bf16 gradient before each micro-batch (a pass over the tied (vocab, d) matrix) and adds
them after its backward, again one parameter at a time. Here, after each backward: one
`torch._foreach_add_` of every bf16 gradient into its fp32 one (fp32 += bf16 computed in fp32, as
DeepSpeed's cast and add), and the bf16 gradients let go, so the next backward writes its gradients
instead of adding into zeros.

The sums are DeepSpeed's bit for bit (tests/launch/test_recipes.py): every stage runs one backward
a micro-batch, RETRO's too, whose hidden states and neighbours cross a cut as one tensor
(stage_boundary.py). The cost: a stage's bf16 gradients are all alive at the end of its backward
(2 bytes a parameter at the peak), where the hooks let each go as it came.
"""
from __future__ import annotations

import torch

from retropipe.training.pipeline import deepspeed_private as private


def add_grads_in_one_call(engine) -> bool:
    """Replace the engine's bf16 optimizer's `update_hp_grads` (the call DeepSpeed makes after each
    micro-batch's backward when `bf16.immediate_grad_update` is off) with one foreach add.

    Returns False, leaving DeepSpeed's own accumulation, where there is no bf16 optimizer or
    `immediate_grad_update` is on (train.deepspeed may ask for it); and, with a warning, where the
    optimizer lacks what the replacement uses (another DeepSpeed) or does more per parameter than
    add (CUDA graph harvesting, expert-parallel folding). DeepSpeed's optimizer is reached through
    deepspeed_private.py.
    """
    optimizer = private.bf16_optimizer_adding_after_backward(engine)
    if optimizer is None:
        return False

    @torch.no_grad()
    def update_hp_grads(clear_lp_grads: bool = False) -> None:
        fp32, bf16 = private.take_bf16_grads(optimizer)
        if fp32:
            torch._foreach_add_(fp32, bf16)  # one add kernel a parameter, launched from C++

    private.replace_update_hp_grads(optimizer, update_hp_grads)
    return True
