"""Model FLOPs per token and MFU: the one estimate the training log and the benchmarks share.

    fpt = flops_per_token(model_cfg, seq_len)
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
    from retropipe.training.models.build import build_model

    with torch.device("meta"):  # shapes only: no memory, no random numbers drawn
        model = build_model(model_cfg)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("wpe"))
    return 6 * n + 12 * model_cfg.n_layer * model_cfg.n_embd * seq_len


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: the FLOP/s the model's arithmetic needs at this throughput, over
    the peak of the hardware it ran on (all of it: the whole world's peak for a distributed run)."""
    return flops_per_token * tokens_per_s / peak_flops_per_s
