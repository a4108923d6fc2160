"""Multi-head attention with rotary relative positions: every attention of RETRO's retrieval path.

One `Attention` serves the encoder's self-attention over a neighbour, the encoder's
cross-attention to the retrieving chunk, and the chunked cross-attention (training/models/cca.py).
Queries and keys are rotated by their `Positions` (RoFormer's rotate-half), so q·k depends on the
positions only through their difference. What depends on the positions and nothing learned (the
rotary tables, the CCA's bias offsets) is built once per positions and kept (`kept_constant`).
Missing neighbour tokens (id -1) are masked out of the keys (`key_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from einops import rearrange

from retropipe.training.models.gpt2 import attention


def rotary_tables(pos: torch.Tensor, width: int, heads: int, base: float, dtype: torch.dtype):
    """cos and signed sin (t, heads·c), c = width / heads, for rotating each head's feature pairs
    (x_i, x_{i+c/2}) by pos (t,) · base^(-2i/c): cos over both halves, sin negated over the first."""
    c = width // heads
    inv_freq = base ** (-torch.arange(0, c, 2, device=pos.device, dtype=torch.float32) / c)
    angles = pos.to(torch.float32)[:, None] * inv_freq[None]  # (t, c/2), fp32 even under autocast
    cos, sin = angles.cos(), angles.sin()
    return (torch.cat([cos, cos], -1).repeat(1, heads).to(dtype),
            torch.cat([-sin, sin], -1).repeat(1, heads).to(dtype))


def swap_halves(x: torch.Tensor, heads: int) -> torch.Tensor:
    """x (..., heads·c) with each head's two halves swapped: (x_2, x_1) for (x_1, x_2)."""
    halves = x.unflatten(-1, (heads, 2, -1))                                      # (..., h, 2, c/2)
    return torch.cat([halves[..., 1:, :], halves[..., :1, :]], -2).flatten(-3)


class _Rotary(torch.autograd.Function):
    """x·cos + swap_halves(x)·sin forward, grad·cos + swap_halves(grad·sin) backward (the swap is
    its own inverse), over whole rows of (B, t, heads·c) with (t, heads·c) tables.

    Whole rows, because autograd over each head's halves would run a dozen kernels each way over
    rows of c/2 strided elements: at an encoder's 32-wide heads, 15% of a tiny RETRO block
    (docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, x, cos, sin, heads: int):
        ctx.save_for_backward(cos, sin)
        ctx.heads = heads
        return torch.addcmul(x * cos, swap_halves(x, heads), sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad = grad.contiguous()  # it arrives in the heads' layout (B, h, t, c): strided rows here
        return torch.addcmul(swap_halves(grad * sin, ctx.heads), grad, cos), None, None, None


def rotary(x: torch.Tensor, pos: torch.Tensor, base: float, heads: int = 1) -> torch.Tensor:
    """Rotate each head's feature pairs (x_i, x_{i+c/2}) of x (..., t, heads·c) by pos (t,) ·
    base^(-2i/c) (RoFormer, rotate-half).

    q·k then depends on the positions only through their difference: a relative encoding.
    `Attention` does the same with its tables kept (`Attention.tables`); this builds them each call.
    """
    cos, sin = rotary_tables(pos, x.shape[-1], heads, base, x.dtype)
    return _Rotary.apply(x, cos, sin, heads)


@dataclass(frozen=True)
class Positions:
    """The positions start … stop - 1, that run `times` times over: every set of positions RETRO's
    attentions use (a neighbour's r tokens, a chunk's m, k neighbours side by side). Hashable, so
    that what is built from them (rotary tables, the CCA's bias offsets) is built once."""
    start: int
    stop: int
    times: int = 1

    def __len__(self) -> int:
        return (self.stop - self.start) * self.times

    def shifted(self, by: int) -> "Positions":
        return Positions(self.start + by, self.stop + by, self.times)

    def tensor(self, device) -> torch.Tensor:
        """(len(self),) int64."""
        return torch.arange(self.start, self.stop, device=device).repeat(self.times)


# Constants a module keeps per (positions, dtype, device); past this many it starts afresh (decoding
# one token at a time meets at most chunk_len query positions per attention).
CONSTANTS_KEPT = 256


def kept_constant(cache: dict, key, build):
    """build() once per key into cache: a tensor that depends on nothing learned (rotary tables,
    index offsets). Each takes a dozen small kernels to build, and on a GPU the step waits on the
    host's launches (docs/benchmarks.md), so it is built once, not every call. Built outside
    inference mode, so that a table first built while generating can be saved for backward in
    training; traced afresh under torch.compile, which folds them into its kernels."""
    if torch.compiler.is_compiling():
        return build()
    value = cache.get(key)
    if value is None:
        if len(cache) >= CONSTANTS_KEPT:
            cache.clear()
        with torch.inference_mode(False), torch.no_grad():
            value = cache[key] = build()
    return value


class KeepsConstants(nn.Module):
    """A module with kept_constant's cache, `constants`: emptied when the module moves or changes
    dtype (`.to`, `.cuda`, `.bfloat16`), so that no table of its old device or dtype stays alive."""

    def __init__(self):
        super().__init__()
        self.constants: dict = {}

    def _apply(self, *args, **kwargs):
        self.constants.clear()
        return super()._apply(*args, **kwargs)


def key_mask(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From valid keys (..., t) bool: the keys to attend to and whether any key is valid (..., 1).

    A row with no valid key would softmax over nothing (NaN, and NaN gradients even if the output
    is zeroed later), so such rows attend to all keys instead and the caller multiplies their
    output by `any_valid` = 0: an exact zero contribution.
    """
    any_valid = valid.any(dim=-1, keepdim=True)
    return valid | ~any_valid, any_valid


def with_null_slot(k: torch.Tensor, v: torch.Tensor, key: torch.Tensor):
    """k, v (B, h, s, c) with a slot 0 of key `key` (h, c) and value zero prepended."""
    B, heads, _, c = k.shape
    k = torch.cat([key.to(k.dtype)[None, :, None].expand(B, heads, 1, c), k], dim=2)
    return k, torch.cat([v.new_zeros(B, heads, 1, c), v], dim=2)


class Attention(KeepsConstants):
    """Multi-head attention of queries x (B, t, d_q) over a context (B, s, d_kv) → (B, t, d_q);
    its rotary tables, per (positions, dtype, device), in `constants`."""

    def __init__(self, d_q: int, d_kv: int, width: int, n_head: int, dropout: float, rotary_base: float):
        super().__init__()
        self.n_head, self.dropout, self.rotary_base = n_head, dropout, rotary_base
        self.q = nn.Linear(d_q, width)
        self.kv = nn.Linear(d_kv, 2 * width)
        self.proj = nn.Linear(width, d_q)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x, context, q_pos: Positions, k_pos: Positions, mask=None, null_key=None):
        # q_pos, k_pos: the positions of the queries (t) and of the context's keys (s). mask: bool
        # (True = attend) or float (added to the attention logits: a relative-position
        # term, -inf where not attended), broadcastable to (B, heads, t, s). null_key (heads, c): a
        # slot before the context whose value is zero, so attending to it adds nothing (the copy
        # gate's way to decline); the mask is then float and holds the slot's logits as column 0,
        # (B, heads, t, 1 + s) (ChunkedCrossAttention.logit_bias).
        k, v = self.kv(context).chunk(2, dim=-1)
        q, k = (_Rotary.apply(z, *self.tables(pos, z), self.n_head) for z, pos in ((self.q(x), q_pos), (k, k_pos)))
        q, k, v = (rearrange(z, "B t (h c) -> B h t c", h=self.n_head) for z in (q, k, v))
        if null_key is not None:
            k, v = with_null_slot(k, v, null_key)
        y = attention(q, k, v, mask, self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(rearrange(y, "B h t c -> B t (h c)")))

    def tables(self, pos: Positions, like: torch.Tensor):
        """rotary_tables of pos for x like `like` (..., t, heads·c), built once → cos, sin (t, heads·c)."""
        return kept_constant(self.constants, (pos, like.dtype, like.device), lambda: rotary_tables(
            pos.tensor(like.device), like.shape[-1], self.n_head, self.rotary_base, like.dtype))
