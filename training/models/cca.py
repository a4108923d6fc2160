"""RETRO's chunked cross-attention (CCA) and its copy gate.

The CCA is `Attention` (training/models/rotary_attention.py) with the causal shift (a pad) and the
chunk reshapes around it, and a term added to its logits: a learned bias per relative position
and, with the copy gate, a bonus on neighbour tokens that continue the text just read and a null
slot to attend to instead. Missing neighbour tokens (id -1) are masked out of the keys.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from retropipe.training.models.config import ModelConfig
from retropipe.training.models.lm_head import autocast_dtype
from retropipe.training.models.rotary_attention import Attention, KeepsConstants, Positions, kept_constant, key_mask

# The copy gate's start (each head; learned): a neighbour token after one matching token gets +2
# logits, after two +6, the null slot +2. With the position bias still zero, a query then attends
# where a bigram matches, else to the null slot and the neighbours alike.
MATCH_INIT, BIGRAM_INIT, NULL_INIT = 2.0, 4.0, 2.0


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
    read so far, and only there. Per head, the logit of query i on neighbour token j is

        logit(i, j) = q_i·k_j / √c + s·P[j − (m-1+i)] + g·(M + B·[n_{j-2} = x_{i-1} ≥ 0])·[n_{j-1} = x_i ≥ 0]

    where x_i is the token at query i's position and x_{i-1} the one before it (-1 = none); n_{j-1},
    n_{j-2} are the tokens before j in the same neighbour (-1 before its start); P, M, B and N are
    the head's learned position, match, bigram and null biases; s = position_bias_scale and g = s,
    or 1 where s = 0. Keys of missing tokens get -inf, and a null slot, key k_∅ and value zero, gets
    q_i·k_∅ / √c + g·N: attending to it adds nothing, so the CCA can decline. Where a neighbour lines up and then
    diverges, or never belonged, no bigram matches and the null slot wins. One common token
    (" the", a newline) matches anywhere; two in a row rarely do by chance (docs/results.md,
    "Doing no harm").
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = self.chunk_len = cfg.chunk_len
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg.n_embd, cfg.encoder_embd, cfg.n_embd, cfg.n_head, cfg.dropout, cfg.rotary_base)
        # One logit bias per head and offset j − (m-1+i) in [-(2m-2), m]: 3m - 1 offsets.
        self.position_bias = nn.Parameter(torch.zeros(cfg.n_head, 3 * m - 1))
        self.position_bias_scale = cfg.position_bias_scale
        # `constants` (KeepsConstants): the bias's offsets into position_bias, per (positions, device).
        self.copy_gate = cfg.copy_gate
        if cfg.copy_gate:  # constants, no random draw: every other weight starts as without the gate
            # Read as scale × parameter (logit_bias), so stored as INIT / scale: they start at INIT.
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

        With the gate, the sum is one batched product per chunk, term + bonus (heads, 2) · marks
        (2, t (1 + s)): marks are each key's channels (match, bigram), term the null slot's column
        and the position bias. That is one pass over (B, heads, t, 1 + s) each way, where a sum of
        broadcasts makes a dozen (docs/benchmarks.md).

        Every bias is used as scale × its parameter: Adam moves a parameter by about lr a step
        whatever its gradient, so the logit moves by about scale × lr, whole logits within tens of
        steps where the trunk's rate would take thousands (ModelConfig.position_bias_scale)."""
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
