"""RETRO's retrieval encoder: a small bidirectional transformer over each neighbour's r tokens.

Input: the neighbours embedded with the decoder's own token embedding (`retro.embed_inputs`,
a tied use of `wte`), projected from n_embd to the encoder's width. Every encoder layer is
self-attention over the neighbour's tokens (bidirectional, rotary), cross-attention to the
decoder activations H_u of the chunk the neighbour was retrieved for (paper: "conditioned on
the activations of the retrieving chunk"), then an MLP. The encoding is computed once, at the
first CCA layer, and reused by every later one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from einops import rearrange

from retropipe.training.models.cca import Attention, Positions, key_mask
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import MLP, init_weights


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.encoder_embd
        self.ln_1 = nn.LayerNorm(e)
        self.attn = Attention(e, e, e, cfg.encoder_head, cfg.dropout, cfg.rotary_base)
        self.ln_2 = nn.LayerNorm(e)
        self.cross = Attention(e, cfg.n_embd, e, cfg.encoder_head, cfg.dropout, cfg.rotary_base)
        self.ln_3 = nn.LayerNorm(e)
        self.mlp = MLP(e, cfg.dropout)

    def forward(self, x, mask, context):
        # x (B·k, r, e) with B = b·l; mask (B·k, 1, 1, r); context (B, m, d) the retrieving chunk.
        k, r, m = x.shape[0] // context.shape[0], x.shape[1], context.shape[1]
        pos_r, pos_m = Positions(0, r), Positions(0, m)
        y = self.ln_1(x)
        x = x + self.attn(y, y, pos_r, pos_r, mask)
        # Cross-attention rows are independent, so the k neighbours of a chunk query its context
        # together: keys and values are projected once per chunk, not once per neighbour.
        # Neighbour token j and chunk token i share an origin: the neighbour is aligned with its chunk.
        y = rearrange(self.ln_2(x), "(B k) r e -> B (k r) e", k=k)
        x = x + rearrange(self.cross(y, context, Positions(0, r, k), pos_m), "B (k r) e -> (B k) r e", k=k)
        return x + self.mlp(self.ln_3(x))


class RetrievalEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.chunk_len = cfg.chunk_len
        self.proj_in = nn.Linear(cfg.n_embd, cfg.encoder_embd)
        # H is the raw residual stream of the decoder; normalise it once for every layer's keys.
        self.ln_context = nn.LayerNorm(cfg.n_embd)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_f = nn.LayerNorm(cfg.encoder_embd)
        init_weights(self, cfg.n_layer)

    def forward(self, embedded: torch.Tensor, neighbours: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # embedded (b, l, k, r, d) float; neighbours (b, l, k, r) int64, -1 = missing; h (b, n, d).
        b, l, k, r = neighbours.shape
        x = rearrange(self.proj_in(embedded), "b l k r e -> (b l k) r e")
        # A neighbour with no token at all attends to its (garbage) tokens: finite, and the CCA
        # masks it out anyway.
        mask, _ = key_mask(rearrange(neighbours >= 0, "b l k r -> (b l k) 1 1 r"))
        context = rearrange(self.ln_context(h), "b (l m) d -> (b l) m d", m=self.chunk_len)
        for layer in self.layers:
            x = layer(x, mask, context)
        return rearrange(self.ln_f(x), "(b l k) r e -> b l k r e", b=b, l=l)  # (b, l, k, r, e)
