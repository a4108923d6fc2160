"""Model FLOPs per token and MFU: the one estimate the training log and the benchmarks share.

    fpt = flops_per_token(model_cfg, seq_len)
    fpt = step_flops_per_token(fpt, model_cfg, target_share, fused_head)   # a batch with padding
    mfu(fpt, tokens_per_s, peak_flops_per_s)     # peak: training/run/hardware.py matmul_flops_per_s
"""

from __future__ import annotations

import torch


def flops_per_token(model_cfg, seq_len: int) -> float:
    """nanoGPT's estimate for a forward + backward: 6·N + 12·L·H·Q·T.

    N: parameters without the position embedding (a lookup, no matmul); the tied embedding counts
    once, as the output head's matmul. 12·L·H·Q·T: attention scores and values (H·Q = n_embd),
    forward and backward. RETRO's CCA and encoder enter through N only (their attention over
    neighbours is not counted), so a RETRO MFU slightly understates the work done.
    """
    from retropipe.training.models.registry import build_model

    with torch.device("meta"):  # shapes only: no memory, no random numbers drawn
        model = build_model(model_cfg)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("wpe"))
    return 6 * n + 12 * model_cfg.n_layer * model_cfg.n_embd * seq_len


def step_flops_per_token(flops_per_token: float, model_cfg, target_share: float, fused_head: bool) -> float:
    """FLOPs per token of a batch in which only `target_share` of the tokens have a target: the
    fused head (training/models/lm_head.py) skips the others, so their 6·V·d of the head's
    products are not done (the demo's batches: 21% padding, the head 86% of the tiny model's
    FLOPs, so counting them made MFU read 1.2× high). The plain head computes every token's."""
    head = 6 * model_cfg.vocab_size * model_cfg.n_embd
    return flops_per_token - (head * (1.0 - target_share) if fused_head else 0.0)


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: the FLOP/s the model's arithmetic needs at this throughput, over
    the peak of the hardware it ran on (all of it: the whole world's peak for a distributed run)."""
    return flops_per_token * tokens_per_s / peak_flops_per_s
