"""Attention with rotary relative positions, and RETRO's chunked cross-attention (CCA).

One `Attention` module serves the encoder's self-attention, the encoder's cross-attention to
the decoder, and the CCA; the CCA is a thin wrapper that does the causal shift (a pad) and the
chunk reshapes around it. Missing neighbour tokens (id -1) are masked out of the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import attention
from retropipe.training.models.lm_head import autocast_dtype


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

    Written with autograd over each head's halves, the rotation ran a dozen kernels each way, most
    over rows of c/2 strided elements: at an encoder's 32-wide heads, 15% of a tiny RETRO block.
    This takes 60% of that time (docs/benchmarks.md)."""

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
    index offsets). At RETRO's shapes each took a dozen small kernels per call, and on a GPU the
    step waits on the host's launches (docs/benchmarks.md). Built outside inference mode, so that a
    table first built while generating can be saved for backward in training; traced afresh under
    torch.compile, which folds them into its kernels."""
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


class ChunkedCrossAttention(KeepsConstants):
    """CCA (RETRO §2.4): the tokens of chunk u attend to the encoded neighbours of chunk u-1.

    Causal shift: the neighbours of chunk u were retrieved with chunk u's own tokens, so only
    positions that have seen all of chunk u may use them, i.e. positions (u+1)·m-1 … (u+2)·m-2
    (m = chunk_len): chunk u's last token and the next chunk minus its last token. Shifting the
    queries left by m-1 (a pad) lines those positions up with chunk u. The first m-1 positions
    have no retrieval before them and get an exact zero (the residual only).

    Relative positions: query i of the shifted chunk u sits at offset m-1+i from the start of
    chunk u; neighbour token j sits at offset j from the start of its neighbour, which is aligned
    with chunk u (its continuation with chunk u+1). They enter twice, as in the Transformer-XL
    relative encoding RETRO uses (§B): through the content (rotary q·k, relative by construction)
    and as a learned bias per head and relative offset j − (m-1+i), the query-independent term.
    That bias is what lets a query find the neighbour token aligned with the token it predicts
    (offset +1) within tens of steps; rotary alone needs hundreds (docs/models.md). All k·r tokens
    of the chunk's neighbours are attended to jointly; missing ones (id -1) are masked.

    Copy gate (model.copy_gate): a neighbour is worth copying from where it keeps matching the text
    read so far, and only there. Each query gets a logit bonus (learned, per head) on every
    neighbour token whose previous token is the query's current token, a second bonus where the
    two previous tokens are the query's last two, and a null slot that adds nothing, so it can
    decline: where a neighbour lines up and then diverges, or never belonged, no bigram matches and
    the null slot wins. One common token (" the", a newline) matches anywhere; two in a row rarely
    do by chance (docs/results.md, "Doing no harm").
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = self.chunk_len = cfg.chunk_len
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg.n_embd, cfg.encoder_embd, cfg.n_embd, cfg.n_head, cfg.dropout, cfg.rotary_base)
        # One logit bias per head and offset j − q in [-(2m-2), m]: 3m - 1 offsets, applied as
        # position_bias_scale × the parameter (ModelConfig: the bias must learn fast).
        self.position_bias = nn.Parameter(torch.zeros(cfg.n_head, 3 * m - 1))
        self.position_bias_scale = cfg.position_bias_scale
        # `constants` (KeepsConstants): the bias's offsets into position_bias, per (positions, device).
        self.copy_gate = cfg.copy_gate
        if cfg.copy_gate:  # constants, no random draw: every other weight starts as without the gate
            scale = cfg.position_bias_scale or 1.0
            self.gate_scale = scale
            self.match_bias = nn.Parameter(torch.full((cfg.n_head,), MATCH_INIT / scale))
            self.bigram_bias = nn.Parameter(torch.full((cfg.n_head,), BIGRAM_INIT / scale))
            self.null_bias = nn.Parameter(torch.full((cfg.n_head,), NULL_INIT / scale))
            self.null_key = nn.Parameter(torch.zeros(cfg.n_head, cfg.n_embd // cfg.n_head))

    def forward(self, h: torch.Tensor, encoded: torch.Tensor, neighbours: torch.Tensor,
                tokens: torch.Tensor | None = None, chunks: torch.Tensor | None = None) -> torch.Tensor:
        # h (b, n, d); encoded (b, l, k, r, e); neighbours (b, l, k, r) int64, -1 = missing;
        # tokens (b, n) int64, the sequence's own (the copy gate reads them); chunks (S,) int64:
        # attend only for these of the b·l chunks (the others have no neighbour: zeros), None = all.
        m = self.chunk_len
        b = h.shape[0]
        x = F.pad(self.ln(h), (0, 0, -(m - 1), m - 1))  # (b, n, d): row p now holds position p+m-1
        q = rearrange(x, "b (l m) d -> (b l) m d", m=m)
        current = None
        if tokens is not None:  # each shifted row's token and the one before it, -1 past the end
            now, before = (F.pad(tokens, (-(m - s), m - s), value=-1) for s in (1, 2))
            current = rearrange(torch.stack([now, before], -1), "b (l m) two -> (b l) m two", m=m)
        encoded = rearrange(encoded, "b l k r e -> (b l) k r e")
        neighbours = rearrange(neighbours, "b l k r -> (b l) k r")
        rows = Positions(0, m)
        if chunks is None:
            y = self.attend(q, encoded, neighbours, rows, current)
        else:
            def pick(x):                                                                # the S chunks' rows
                return None if x is None else x.index_select(0, chunks)

            some = self.attend(pick(q), pick(encoded), pick(neighbours), rows, pick(current))   # (S, m, d)
            y = some.new_zeros(q.shape[0], *some.shape[1:]).index_copy_(0, chunks, some)
        y = rearrange(y, "(b l) m d -> b (l m) d", b=b)
        return F.pad(y, (0, 0, m - 1, -(m - 1)))  # undo the shift; positions 0 … m-2 get zeros

    def attend(self, q: torch.Tensor, encoded: torch.Tensor, neighbours: torch.Tensor, rows: Positions,
               current: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, t, d): normalised queries at rows `rows` (t) of their shifted chunks; encoded
        (B, k, r, e) and neighbours (B, k, r) of those chunks; current (B, t, 2): the token at each
        query's position and the one before (-1 = none) → (B, t, d), an exact zero where a chunk
        has no neighbour at all."""
        m = self.chunk_len
        k, r = neighbours.shape[1:]
        context = rearrange(encoded, "B k r e -> B (k r) e")
        valid, any_valid = key_mask(rearrange(neighbours >= 0, "B k r -> B (k r)"))     # (B, k r), (B, 1)
        q_pos, k_pos = rows.shifted(m - 1), Positions(0, r, k)  # every neighbour starts at offset 0
        dtype = autocast_dtype(q.device.type) or q.dtype                       # the scores' dtype
        logits = self.logit_bias(q_pos, k_pos, valid, neighbours, current, dtype)
        y = self.attn(q, context, q_pos, k_pos, logits, self.null_key if self.copy_gate else None)   # (B, t, d)
        return y * any_valid[:, :, None].to(y.dtype)  # no neighbour → exact zero

    def logit_bias(self, q_pos: Positions, k_pos: Positions, valid: torch.Tensor, neighbours: torch.Tensor,
                   current: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The term added to the attention logits of queries at q_pos (t) over keys at k_pos
        (s = k r): the position bias, -inf at keys not `valid` (B, s), and with the copy gate its
        bonuses and the null slot's logit as column 0 → (B, heads, t, [1 +] s) in dtype.

        The gate's term is one batched product, term + bonus (heads, 2) · marks (2, t (1 + s)) per
        chunk, over the channels (match, bigram) of each key, its additive term the null slot's
        column and the position bias. Built from broadcasts, the same sum took a dozen passes over
        (B, heads, t, s) each way (docs/benchmarks.md)."""
        m, (B, s), t, device = self.chunk_len, valid.shape, len(q_pos), valid.device
        offsets = kept_constant(self.constants, (q_pos, k_pos, device), lambda: (          # (t, s), into position_bias
            k_pos.tensor(device)[None, :] - q_pos.tensor(device)[:, None] + 2 * m - 2))
        position = self.position_bias_scale * self.position_bias[:, offsets]     # (heads, t, s)
        blocked = torch.zeros(B, s, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))
        if not self.copy_gate:
            return position.to(dtype) + blocked[:, None, None]                   # (B, heads, t, s)
        heads = position.shape[0]
        null = (self.gate_scale * self.null_bias)[:, None, None].expand(heads, t, 1)
        term = torch.cat([null, position], -1).to(dtype).flatten(1)             # (heads, t (1 + s))
        bonus = (self.gate_scale * torch.stack([self.match_bias, self.bigram_bias], 1)).to(dtype)   # (heads, 2)
        marks = F.pad(self.matches(neighbours, current), (1, 0)).to(dtype).flatten(2)   # (B, 2, t (1 + s))
        logits = torch.baddbmm(term.expand(B, -1, -1), bonus.expand(B, -1, -1), marks)  # (B, heads, t (1 + s))
        # Out of place: added in place to this view, backward would copy the whole term once more.
        return logits.view(B, heads, t, 1 + s) + F.pad(blocked, (1, 0))[:, None, None]

    def matches(self, neighbours: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """(B, 2, t, k r) bool: [match, bigram]. match on neighbour token j where token j - 1 of the
        same neighbour is the query's current token (the neighbour matches the text just read, so
        its token j may be the next one); bigram where token j - 2 is also the one before it.
        current (B, t, 2): each query's token and the one before."""
        previous, previous2 = (rearrange(F.pad(neighbours, (s, -s), value=-1), "B k r -> B 1 (k r)")
                               for s in (1, 2))                                          # tokens j - 1, j - 2
        match = (previous == current[:, :, None, 0]) & (previous >= 0)                   # (B, t, k r)
        bigram = match & (previous2 == current[:, :, None, 1]) & (previous2 >= 0)
        return torch.stack([match, bigram], 1)

    def decode(self, h: torch.Tensor, start: int, encoded: torch.Tensor | None, neighbours: torch.Tensor,
               tokens: torch.Tensor | None = None) -> torch.Tensor:
        """forward's output at the new positions start … start + T - 1 only (h (b, T, d); tokens
        (b, T + 1): the token before them (-1 at the start) and the tokens fed at them).

        encoded (b, l, k, r, e) and neighbours (b, l, k, r) hold the sequence's chunks from 0; a
        new position p reads chunk (p + 1) // m - 1 only, which is complete by p (so the caller
        need not have encoded any later one).
        """
        m = self.chunk_len
        b, n, d = h.shape
        first, last = max(start, m - 1), start + n - 1     # the new positions that have a chunk to read
        out = h.new_zeros(b, n, d)
        if last < first:
            return out
        s0, s1 = first - (m - 1), last - (m - 1)           # their rows in the shifted layout
        u0, u1 = s0 // m, s1 // m
        x = self.ln(h[:, first - start:])                  # (b, t, d)
        current = None
        if tokens is not None:                             # (b, t, 2): each position's token, the one before
            current = torch.stack([tokens[:, 1:], tokens[:, :-1]], -1)[:, first - start:]
        if u0 == u1:  # one chunk (every step after the first): only the new rows are computed
            rows = Positions(s0 % m, s1 % m + 1)
            y = self.attend(x, encoded[:, u0], neighbours[:, u0], rows, current)
        else:         # a prompt over several chunks: lay the rows out in whole chunks, as forward
            chunks = h.new_zeros(b, (u1 - u0 + 1) * m, d)
            chunks[:, s0 - u0 * m:s1 - u0 * m + 1] = x
            if current is not None:
                laid = current.new_full((b, (u1 - u0 + 1) * m, 2), -1)
                laid[:, s0 - u0 * m:s1 - u0 * m + 1] = current
                current = rearrange(laid, "b (l m) two -> (b l) m two", m=m)
            y = self.attend(rearrange(chunks, "b (l m) d -> (b l) m d", m=m),
                            rearrange(encoded[:, u0:u1 + 1], "b l k r e -> (b l) k r e"),
                            rearrange(neighbours[:, u0:u1 + 1], "b l k r -> (b l) k r"), Positions(0, m), current)
            y = rearrange(y, "(b l) m d -> b (l m) d", b=b)[:, s0 - u0 * m:s1 - u0 * m + 1]
        out[:, first - start:] = y
        return out


# The copy gate's start (each head; learned, as scale × parameter): a neighbour token after one
# matching token gets +2 logits, after two +6, the null slot +2. With the position bias still
# zero, a query then attends where a bigram matches, else to the null slot and the neighbours alike.
MATCH_INIT, BIGRAM_INIT, NULL_INIT = 2.0, 4.0, 2.0


def cca_flops(cfg: ModelConfig, n: int, k: int, first: bool) -> float:
    """Forward FLOPs of one CCA over n tokens with k neighbours per chunk (queries, keys and values,
    attention); the first CCA layer's also holds the encoder's (input projection, then per layer
    self-attention, cross-attention to the chunk, MLP)."""
    d, e, m = cfg.n_embd, cfg.encoder_embd, cfg.chunk_len
    r = 2 * m
    nb = (n // m) * k * r  # neighbour tokens per sequence
    flops = 4 * n * d * d + 4 * nb * e * d + 4 * n * k * r * d
    if first:
        per_layer = 8 * nb * e * e + 4 * nb * r * e + 4 * nb * e * e + 4 * n * d * e + 4 * nb * m * e + 16 * nb * e * e
        flops += 2 * nb * d * e + cfg.encoder_layers * per_layer
    return flops
