"""RETRO (Borgeaud et al. 2021, §2.4 and Appendix B): the GPT-2 trunk plus chunked cross-attention.

    Retro(cfg).forward(tokens (b, n) int64, neighbours (b, l, k, r) int64 | None) -> (b, n, vocab)

n = l · chunk_len; each of the k neighbours of chunk u is r tokens (the retrieved chunk and its
continuation, r = 2 · chunk_len), -1 where missing. `neighbours=None` or all -1 is RETRO[OFF]:
every CCA contributes an exact zero and the model computes its GPT-2 trunk alone.

A `RetroBlock` is a GPT-2 `Block` with a CCA between self-attention and MLP; the first one also
owns the retrieval encoder, which reads the decoder activations right after that block's
self-attention (paper: the encoder is conditioned on the activations at the first CCA layer).
Trunk parameter names equal GPT-2's, so a GPT-2 state dict loads into RETRO as is (RETRO-fit).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from training.cca import ChunkedCrossAttention
from training.config import ModelConfig
from training.encoder import RetrievalEncoder
from training.model import (GPT2, Block, DecodeCache, LayerCache, PositionEmbedding, TokenEmbedding, init_weights,
                            lm_logits, lookup)

# Trunk fields a RETRO-fit must share with its GPT-2 checkpoint.
TRUNK_FIELDS = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")


def check_inputs(tokens: torch.Tensor, neighbours: torch.Tensor, chunk_len: int) -> None:
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be (b, n) int64, got {tuple(tokens.shape)} {tokens.dtype}")
    b, n = tokens.shape
    if n % chunk_len:
        raise ValueError(f"RETRO needs a sequence length that is a multiple of model.chunk_len "
                         f"({chunk_len}), got {n} tokens")
    if neighbours.dim() != 4 or tuple(neighbours.shape[:2]) != (b, n // chunk_len) or neighbours.dtype != torch.int64:
        raise ValueError(f"neighbours must be (b, l, k, r) = ({b}, {n // chunk_len}, k, r) int64 "
                         f"(l = n / chunk_len), got {tuple(neighbours.shape)} {neighbours.dtype}")


def no_neighbours(tokens: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """RETRO[OFF]: one missing neighbour (all -1) of 2 · chunk_len tokens per chunk."""
    b, n = tokens.shape
    return torch.full((b, max(n // chunk_len, 1), 1, 2 * chunk_len), -1, dtype=torch.int64, device=tokens.device)


def embed_inputs(wte: TokenEmbedding, x, chunk_len: int):
    """First RETRO layer (tied use of wte): (tokens, neighbours) → (token embeddings (b, n, d),
    neighbours, embedded neighbours (b, l, k, r, d)).

    Tokens and neighbours are looked up together, in one `model.lookup` (whose backward adds into
    the tied weight's gradient in place, not through a dense gradient per call). Missing
    neighbour tokens (-1) embed as token 0; the encoder and the CCA mask them out. The embedded
    neighbours travel through the blocks before the first CCA (a `Block` passes them on) to the
    encoder, so they receive a gradient (a DeepSpeed pipe requirement).
    """
    tokens, neighbours = x
    check_inputs(tokens, neighbours, chunk_len)
    ids = torch.cat([tokens.reshape(-1), neighbours.clamp(min=0).reshape(-1)])
    both = lookup(wte.weight, ids)                                         # (b·n + b·l·k·r, d)
    h, embedded = both.split([tokens.numel(), neighbours.numel()])
    return h.view(*tokens.shape, -1), neighbours, embedded.view(*neighbours.shape, -1)


# The identity-path map is drawn from its own generator: every stage of a pipeline, building only
# some RetroBlocks, draws the same one.
IDENTITY_PATH_SEED = 20211208
IDENTITY_PATH_SCALE = 0.5


def identity_path(cfg: ModelConfig) -> torch.Tensor:
    """(encoder_embd, n_embd): a fixed map with orthonormal rows (columns if encoder_embd > n_embd)."""
    d, e = cfg.n_embd, cfg.encoder_embd
    g = torch.Generator().manual_seed(IDENTITY_PATH_SEED)
    q, _ = torch.linalg.qr(torch.randn(max(d, e), min(d, e), generator=g))  # orthonormal columns
    return q.t().contiguous() if e <= d else q


def init_identity_path(block: "RetroBlock", cfg: ModelConfig) -> None:
    """model.retrieval_init "identity": start the retrieval path as a copy of the neighbours' tokens.

    The encoder starts as Q·(token embedding) (its layers' output projections at zero: each layer
    adds nothing until it learns to), the CCA's values read Q back (Qᵀ) and its output projection
    is a scaled identity. So from step 0 a CCA that attends to neighbour token j adds a multiple of
    that token's embedding to the residual stream, which the tied head reads as "token j is
    likely": the chunked cross-attention only has to learn *where* to look. With GPT-2's random
    init it must first discover that path through four random matrices, a plateau of hundreds of
    steps at CPU scale (docs/results.md). Values and output of the encoder change nothing else: a
    chunk without neighbours still gets an exact zero.
    """
    q = identity_path(cfg)                                                        # (e, d)
    d = cfg.n_embd
    with torch.no_grad():
        if block.first:
            enc = block.encoder
            enc.proj_in.weight.copy_(q)
            enc.proj_in.bias.zero_()
            for layer in enc.layers:
                for out in (layer.attn.proj, layer.cross.proj, layer.mlp.c_proj):
                    out.weight.zero_()
        attn = block.cca.attn
        attn.kv.weight[d:].copy_(q.t())                                          # values: (d, e)
        attn.proj.weight.copy_(IDENTITY_PATH_SCALE * torch.eye(d))


class RetroBlock(Block):
    """Block + CCA. Tuple in: (h, ids, embedded) for the first, (h, ids, encoded) for later ones.

    Tuple out: (h, ids, encoded), except the last CCA layer, which returns h alone: nothing
    downstream needs the neighbours, and a pipeline must not carry a float nobody differentiates.
    """

    def __init__(self, cfg: ModelConfig, first: bool, last: bool):
        super().__init__(cfg)
        self.first, self.last, self.chunk_len = first, last, cfg.chunk_len
        self.cca = ChunkedCrossAttention(cfg)
        init_weights(self.cca, cfg.n_layer)
        if first:
            self.encoder = RetrievalEncoder(cfg)
        if cfg.retrieval_init == "identity":
            init_identity_path(self, cfg)

    def forward(self, x):
        h, neighbours, z = x
        h = h + self.attn(self.ln_1(h))
        encoded = self.encoder(z, neighbours, h) if self.first else z  # (b, l, k, r, e), once
        h = h + self.cca(h, encoded, neighbours)
        h = h + self.mlp(self.ln_2(h))
        return h if self.last else (h, neighbours, encoded)

    def decode(self, h: torch.Tensor, layer: LayerCache, start: int, neighbours: torch.Tensor, cache: DecodeCache,
               wte: TokenEmbedding) -> torch.Tensor:
        """forward for the new positions start … start + T - 1, h (b, T, d); neighbours (b, l, k, r)
        of the chunks so far. The first CCA block encodes every chunk that the new positions
        complete, once, into cache.encoded (its ids into cache.neighbours, for the CCA's mask): the
        encoder reads a chunk's decoder states from this block, and no position before the chunk's
        last token reads its neighbours (the causal shift)."""
        h = h + self.attn(self.ln_1(h), layer)
        if self.first:
            m, (b, n, d) = self.chunk_len, h.shape
            if cache.states is None:
                chunks = -(-layer.capacity // m)
                cache.states = h.new_empty(b, layer.capacity, d)
                cache.neighbours = neighbours.new_empty(b, chunks, *neighbours.shape[2:])
                cache.encoded = h.new_empty(b, chunks, *neighbours.shape[2:], self.encoder.proj_in.out_features)
            cache.states[:, start:start + n] = h
            u0, u1 = start // m, (start + n) // m          # chunks u0 … u1 - 1 end at a new position
            if u1 > u0:
                ids = cache.neighbours[:, u0:u1] = neighbours[:, u0:u1]               # (b, l', k, r)
                z = F.embedding(ids.clamp(min=0), wte.weight)                          # as embed_inputs
                cache.encoded[:, u0:u1] = self.encoder(z, ids, cache.states[:, u0 * m:u1 * m])
        h = h + self.cca.decode(h, start, cache.encoded, cache.neighbours)
        return h + self.mlp(self.ln_2(h))


def is_retrieval_parameter(name: str) -> bool:
    """CCA and encoder parameters: the ones a RETRO-fit trains (works for any container's names)."""
    parts = name.split(".")
    return "cca" in parts or "encoder" in parts


def freeze_trunk(module: nn.Module) -> nn.Module:
    for name, p in module.named_parameters():
        if not is_retrieval_parameter(name):
            p.requires_grad_(False)
    return module


class Retro(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.kind != "retro":
            raise ValueError(f"Retro needs model.kind 'retro', got {cfg.kind!r}")
        self.cfg = cfg
        cca = [i - 1 for i in cfg.cca_layers()]  # 0-indexed
        self.wte = TokenEmbedding(cfg.vocab_size, cfg.n_embd, cfg.embedding_init_std)
        self.wpe = PositionEmbedding(cfg)
        self.blocks = nn.ModuleList(
            RetroBlock(cfg, first=i == cca[0], last=i == cca[-1]) if i in cca else Block(cfg)
            for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        if cfg.freeze_trunk:
            freeze_trunk(self)

    def hidden(self, tokens: torch.Tensor, neighbours: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states (b, n, d), after ln_f: what the tied head reads."""
        if neighbours is None:
            neighbours = no_neighbours(tokens, self.cfg.chunk_len)
        # Exactly the layer list of layers.layer_list(cfg), in order.
        x = self.wpe(embed_inputs(self.wte, (tokens, neighbours), self.cfg.chunk_len))  # (h, ids, embedded)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, tokens: torch.Tensor, neighbours: torch.Tensor | None = None) -> torch.Tensor:
        return lm_logits(self.wte, self.hidden(tokens, neighbours))  # (b, n, vocab)

    def new_cache(self) -> DecodeCache:
        return DecodeCache(self.cfg)

    def decode(self, tokens: torch.Tensor, neighbours: torch.Tensor | None, cache: DecodeCache) -> torch.Tensor:
        """Incremental forward for generation: tokens (b, T) at positions cache.length …, the earlier
        ones read from the cache; neighbours (b, l, k, r) of the chunks 0 … l - 1 begun so far
        (None = RETRO[OFF]); returns the last position's logits (b, vocab), as forward's.

        A chunk's neighbours are read once, when its last token is fed, and kept encoded in the
        cache: they must be final by then (training/sampling.py retrieves a chunk just as it
        completes); what later calls pass for that chunk is not read.
        """
        m, start = self.cfg.chunk_len, cache.length
        b, n = tokens.shape
        chunks = -(-(start + n) // m)
        if neighbours is None:
            neighbours = torch.full((b, chunks, 1, 2 * m), -1, dtype=torch.int64, device=tokens.device)
        if neighbours.dim() != 4 or tuple(neighbours.shape[:2]) != (b, chunks):
            raise ValueError(f"neighbours must be (b, l, k, r) = ({b}, {chunks}, k, r) for {start + n} tokens, "
                             f"got {tuple(neighbours.shape)}")
        h = self.wpe(F.embedding(tokens, self.wte.weight), start)                # (b, T, d)
        for block, layer in zip(self.blocks, cache.layers):
            if isinstance(block, RetroBlock):
                h = block.decode(h, layer, start, neighbours, cache, self.wte)
            else:
                h = block.decode(h, layer)
        cache.length += n
        return lm_logits(self.wte, self.ln_f(h[:, -1]))                         # (b, vocab)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


def retrofit(source: GPT2 | str | os.PathLike, retro_cfg: ModelConfig | None = None) -> Retro:
    """RETRO-fit (paper §4.2): RETRO around a trained GPT-2 whose trunk is frozen.

    `source`: a GPT2 model, or a directory (ours, or a Hugging Face GPT-2 one). `retro_cfg`: the
    RETRO config (kind 'retro'; its trunk fields must match the checkpoint's); None = the
    checkpoint's config with kind 'retro' and the default CCA layers and encoder. Returns a
    model in train mode with freeze_trunk=True: only CCA and encoder parameters require grad.
    """
    if isinstance(source, (str, os.PathLike)):
        from training.model_io import load_pretrained  # model_io imports this module
        source = load_pretrained(source)
    if not isinstance(source, GPT2):
        raise ValueError(f"retrofit needs a GPT-2 model or checkpoint, got {type(source).__name__}")
    if retro_cfg is None:
        retro_cfg = dataclasses.replace(source.cfg, kind="retro")
    for key in TRUNK_FIELDS:
        if getattr(retro_cfg, key) != getattr(source.cfg, key):
            raise ValueError(f"retrofit: model.{key} is {getattr(retro_cfg, key)} but the GPT-2 checkpoint "
                             f"has {getattr(source.cfg, key)}")
    retro_cfg = dataclasses.replace(retro_cfg, kind="retro", freeze_trunk=True)
    model = Retro(retro_cfg)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    trunk_missing = [k for k in missing if not is_retrieval_parameter(k)]
    if unexpected or trunk_missing:
        raise ValueError(f"retrofit: state dict mismatch, unexpected {unexpected}, missing {trunk_missing}")
    return model.train()
