"""What an incremental forward (`model.decode`, generation) keeps between calls and shares across blocks.

    cache = model.new_cache()
    logits = model.decode(prompt, neighbours, cache)      # then one token at a time
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retropipe.training.models.config import ModelConfig


class LayerCache:
    """Keys and values one self-attention layer has computed so far: (b, heads, t, c) each.

    Preallocated to `capacity` positions (model.n_positions), filled in place: appending a token
    copies one position, not the whole past.
    """

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.k = self.v = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, heads, T, c) after the cached positions; return all of them (b, heads, t + T, c)."""
        b, heads, n, c = k.shape
        end = self.length + n
        if end > self.capacity:
            raise ValueError(f"key/value cache full: {end} positions, capacity {self.capacity} (model.n_positions)")
        if self.k is None:
            self.k = k.new_empty(b, heads, self.capacity, c)
            self.v = v.new_empty(b, heads, self.capacity, c)
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class DecodeCache:
    """Everything an incremental forward keeps between calls.

    `layers[i]`: block i's keys and values. `length`: positions fed so far (the next token's
    position). RETRO also keeps `states` (b, capacity, d), the decoder states after the first CCA
    block's self-attention that the encoder reads, and for every complete chunk its neighbour ids
    `neighbours` (b, chunks, k, r) and their encoding `encoded` (b, chunks, k, r, e)
    (retro.RetroBlock.decode), and the last token fed `last_token` (b,) (the copy gate's bigrams).
    """

    def __init__(self, cfg: ModelConfig):
        self.layers = [LayerCache(cfg.n_positions) for _ in range(cfg.n_layer)]
        self.length = 0
        self.states: torch.Tensor | None = None
        self.neighbours: torch.Tensor | None = None
        self.encoded: torch.Tensor | None = None
        self.last_token: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget every position (the buffers are kept for reuse)."""
        self.length = 0
        for layer in self.layers:
            layer.length = 0

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (sequences that stopped are dropped from the batch)."""
        for layer in self.layers:
            if layer.k is not None:
                layer.k, layer.v = layer.k[rows], layer.v[rows]
        if self.states is not None:
            self.states, self.neighbours, self.encoded = self.states[rows], self.neighbours[rows], self.encoded[rows]
        if self.last_token is not None:
            self.last_token = self.last_token[rows]


@dataclass
class DecodeStep:
    """What the blocks of one incremental forward share: where its T new positions start, the
    cache, and for RETRO the neighbours of the chunks begun so far (b, l, k, r) with the embedded
    neighbours (b, l', k, r, d) of the chunks that the new positions complete (none: l' = 0), and
    the tokens fed, after the one fed before them (the copy gate reads them)."""

    start: int
    cache: DecodeCache
    neighbours: torch.Tensor | None = None
    completed: torch.Tensor | None = None
    tokens: torch.Tensor | None = None          # (b, T + 1): the token before (-1 at 0), then the new ones
