"""RETRO (Borgeaud et al. 2021, §2.4 and Appendix B): the GPT-2 trunk plus chunked cross-attention.

    Retro(cfg).forward(tokens (b, n) int64, neighbours (b, l, k, r) int64 | None) -> (b, n, vocab)

n = l · chunk_len; each of the k neighbours of chunk u is r tokens (the retrieved chunk and its
continuation, r = 2 · chunk_len), -1 where missing. `neighbours=None` or all -1 is RETRO[OFF]:
every CCA contributes an exact zero and the model computes its GPT-2 trunk alone.

`Retro` is a `GPT2` whose layer list differs in two places: the first layer looks the neighbours
up with the tokens (`embed_inputs`), and the blocks at `cfg.cca_blocks()` are `RetroBlock`s, a
GPT-2 `Block` with a CCA between self-attention and MLP. The first one also owns the retrieval
encoder, which reads the decoder activations right after that block's self-attention (paper: the
encoder is conditioned on the activations at the first CCA layer). Trunk parameter names equal
GPT-2's, so a GPT-2 state dict loads into RETRO as is (RETRO-fit, training/models/io.py).

The retrieval encoder (`RetrievalEncoder`) is a small bidirectional transformer over each
neighbour's r tokens. Input: the neighbours embedded with the decoder's own token embedding
(`embed_inputs`, a tied use of `wte`), projected from n_embd to the encoder's width. Every
encoder layer is self-attention over the neighbour's tokens (bidirectional, rotary),
cross-attention to the decoder activations H_u of the chunk the neighbour was retrieved for
(paper: "conditioned on the activations of the retrieving chunk"), then an MLP. The encoding is
computed once, at the first CCA layer, and reused by every later one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from einops import rearrange

from retropipe.training.models.cache import DecodeCache, DecodeStep, LayerCache
from retropipe.training.models.cca import ChunkedCrossAttention
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2, MLP, Block, TokenEmbedding, block_flops, init_weights, lookup
from retropipe.training.models.layers import LayerDesc
from retropipe.training.models.rotary_attention import Attention, Positions, key_mask

# Neighbours per chunk assumed by the cost estimates of the layer list.
COST_NEIGHBOURS = 2


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


def embed_neighbours(wte: TokenEmbedding, neighbours: torch.Tensor) -> torch.Tensor:
    """Neighbour ids (..., k, r), -1 = missing → (..., k, r, d); missing tokens embed as token 0
    (the encoder and the CCA mask them out)."""
    return lookup(wte.weight, neighbours.clamp(min=0))


def embed_inputs(wte: TokenEmbedding, x, chunk_len: int):
    """First RETRO layer (tied use of wte): (tokens, neighbours) → (token embeddings (b, n, d),
    neighbours, embedded neighbours (b, l, k, r, d), tokens): the tokens travel on for the CCAs'
    copy gate.

    Tokens and neighbours are looked up together, in one `gpt2.lookup` (whose backward adds into
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
    return h.view(*tokens.shape, -1), neighbours, embedded.view(*neighbours.shape, -1), tokens


class EncoderLayer(nn.Module):
    """One layer of the retrieval encoder: self-attention over a neighbour, cross-attention to its
    retrieving chunk, MLP."""

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
    """Each chunk's neighbours, embedded, → their encoding (see the module docstring)."""

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


def reading_chunks(ids: torch.Tensor) -> torch.Tensor | None:
    """(S,) int64: the chunks of neighbour ids (b, l, k, r) with at least one neighbour token, as
    indices into the b·l chunks; None when every chunk has one. One host sync on a GPU."""
    chunks = (ids >= 0).flatten(2).any(-1).flatten().nonzero().squeeze(1)
    return None if len(chunks) == ids.shape[0] * ids.shape[1] else chunks


class RetroBlock(Block):
    """Block + CCA. Tuple in: (h, ids, embedded, tokens) for the first, (h, ids, encoded, tokens)
    for later ones.

    Tuple out: (h, ids, encoded, tokens), except the last CCA layer, which returns h alone: nothing
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
        if self.first:
            h, ids, embedded, tokens = x                           # embedded (b, l, k, r, d)
        else:
            h, ids, encoded, tokens = x                            # encoded (b, l, k, r, e)
        h = h + self.attn(self.ln_1(h))
        # In evaluation (eval mode, no gradient) the encoder and the CCA run only over the chunks
        # that have a neighbour: a chunk without one gets an exact zero from its CCA either way
        # (RETRO[OFF] is every chunk; retrieval.aligned_only leaves many). Its encoding, never
        # read, is zeros (a pipeline stage boundary still gets the full shape). In training every
        # chunk runs: a pipeline stage must hand on tensors that get a gradient, and a recomputing
        # activation checkpoint must take the same branch as the forward it repeats.
        chunks = None if self.training or torch.is_grad_enabled() else reading_chunks(ids)
        if self.first:
            encoded = self._encode(embedded, ids, h, chunks)
        if chunks is None or len(chunks):
            h = h + self.cca(h, encoded, ids, tokens, chunks)
        h = h + self.mlp(self.ln_2(h))
        return h if self.last else (h, ids, encoded, tokens)

    def _encode(self, embedded: torch.Tensor, ids: torch.Tensor, h: torch.Tensor, chunks: torch.Tensor | None):
        """The encoding (b, l, k, r, e) of every chunk's neighbours, or only of `chunks` (indices
        into the b·l chunks; the others zeros), encoded as one batch of chunks."""
        if chunks is None:
            return self.encoder(embedded, ids, h)                  # once, for every CCA
        b, l, k, r = ids.shape
        if not len(chunks):
            return embedded.new_zeros(b, l, k, r, self.encoder.proj_in.out_features)
        states = h.reshape(b * l, self.chunk_len, -1).index_select(0, chunks)     # (S, m, d)
        some = self.encoder(embedded.flatten(0, 1).index_select(0, chunks)[None],
                            ids.flatten(0, 1).index_select(0, chunks)[None], states.flatten(0, 1)[None])[0]
        encoded = some.new_zeros(b * l, *some.shape[1:]).index_copy_(0, chunks, some)   # (b l, k, r, e)
        return encoded.view(b, l, *some.shape[1:])

    def decode(self, h: torch.Tensor, layer: LayerCache, step: DecodeStep) -> torch.Tensor:
        """forward for the new positions step.start … + T - 1, h (b, T, d). The first CCA block
        encodes every chunk that the new positions complete, once, into cache.encoded (its ids into
        cache.neighbours, for the CCA's mask): the encoder reads a chunk's decoder states from this
        block, and no position before the chunk's last token reads its neighbours (the causal shift)."""
        cache, start = step.cache, step.start
        h = h + self.attn(self.ln_1(h), layer)
        if self.first:
            self._encode_completed(h, layer.capacity, step)
        h = h + self.cca.decode(h, start, cache.encoded, cache.neighbours, step.tokens)
        return h + self.mlp(self.ln_2(h))

    def _encode_completed(self, h: torch.Tensor, capacity: int, step: DecodeStep) -> None:
        cache, start, neighbours = step.cache, step.start, step.neighbours
        m, (b, n, d) = self.chunk_len, h.shape
        if cache.states is None:
            chunks = -(-capacity // m)
            cache.states = h.new_empty(b, capacity, d)
            cache.neighbours = neighbours.new_empty(b, chunks, *neighbours.shape[2:])
            cache.encoded = h.new_empty(b, chunks, *neighbours.shape[2:], self.encoder.proj_in.out_features)
        cache.states[:, start:start + n] = h
        u0, u1 = start // m, (start + n) // m          # chunks u0 … u1 - 1 end at a new position
        if u1 > u0:
            ids = cache.neighbours[:, u0:u1] = neighbours[:, u0:u1]               # (b, l', k, r)
            cache.encoded[:, u0:u1] = self.encoder(step.completed, ids, cache.states[:, u0 * m:u1 * m])


def is_retrieval_parameter(name: str) -> bool:
    """CCA and encoder parameters: the ones a RETRO-fit trains (works for any container's names)."""
    parts = name.split(".")
    return "cca" in parts or "encoder" in parts


def freeze_trunk(module: nn.Module) -> nn.Module:
    for name, p in module.named_parameters():
        if not is_retrieval_parameter(name):
            p.requires_grad_(False)
    return module


def retrieval_flops(cfg: ModelConfig, n: int, k: int, first: bool) -> float:
    """Forward FLOPs of a RetroBlock's retrieval path over n tokens with k neighbours per chunk: its
    CCA (queries, keys and values, attention); the first block's also holds the encoder's (input
    projection, then per layer self-attention, cross-attention to the chunk, MLP)."""
    d, e, m = cfg.n_embd, cfg.encoder_embd, cfg.chunk_len
    r = 2 * m
    nb = (n // m) * k * r  # neighbour tokens per sequence
    flops = 4 * n * d * d + 4 * nb * e * d + 4 * n * k * r * d
    if first:
        per_layer = 8 * nb * e * e + 4 * nb * r * e + 4 * nb * e * e + 4 * n * d * e + 4 * nb * m * e + 16 * nb * e * e
        flops += 2 * nb * d * e + cfg.encoder_layers * per_layer
    return flops


class Retro(GPT2):
    """GPT-2 plus chunked cross-attention over retrieved neighbours (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_seed: int | None = None, fused_head: bool = False):
        if cfg.kind != "retro":
            raise ValueError(f"Retro needs model.kind 'retro', got {cfg.kind!r}")
        super().__init__(cfg, layer_seed, fused_head)
        if cfg.freeze_trunk:
            freeze_trunk(self)

    @classmethod
    def first_layer(cls, cfg: ModelConfig):
        """The tokens and their chunks' neighbours looked up together; the neighbours' tokens cost too."""
        n = cfg.n_positions
        neighbour_tokens = (n // cfg.chunk_len) * COST_NEIGHBOURS * 2 * cfg.chunk_len
        return functools.partial(embed_inputs, chunk_len=cfg.chunk_len), (n + neighbour_tokens) * cfg.n_embd * 1e-9

    @classmethod
    def block(cls, cfg: ModelConfig, i: int) -> LayerDesc:
        """Block i; a RetroBlock at the CCA positions (the first owns the encoder, the last ends the tuple)."""
        cca = cfg.cca_blocks()
        if i not in cca:
            return super().block(cfg, i)
        first = i == cca[0]
        cost = (block_flops(cfg, cfg.n_positions) + retrieval_flops(cfg, cfg.n_positions, COST_NEIGHBOURS, first)) * 1e-9
        return LayerDesc(f"blocks.{i}", RetroBlock, dict(cfg=cfg, first=first, last=i == cca[-1]), cost=cost,
                         retrieval=True)

    def inputs(self, tokens: torch.Tensor, neighbours: torch.Tensor | None):
        """(tokens, neighbours); None = RETRO[OFF], one missing neighbour per chunk."""
        return tokens, neighbours if neighbours is not None else no_neighbours(tokens, self.cfg.chunk_len)

    def decode_step(self, tokens: torch.Tensor, neighbours: torch.Tensor | None, cache: DecodeCache) -> DecodeStep:
        """neighbours (b, l, k, r) of the chunks 0 … l - 1 begun so far (None = RETRO[OFF]).

        A chunk's neighbours are read once, when its last token is fed, and kept encoded in the
        cache: they must be final by then (training/evaluation/sampling.py retrieves a chunk just
        as it completes); what later calls pass for that chunk is not read.
        """
        m, start = self.cfg.chunk_len, cache.length
        b, n = tokens.shape
        chunks = -(-(start + n) // m)
        if neighbours is None:
            neighbours = torch.full((b, chunks, 1, 2 * m), -1, dtype=torch.int64, device=tokens.device)
        if neighbours.dim() != 4 or tuple(neighbours.shape[:2]) != (b, chunks):
            raise ValueError(f"neighbours must be (b, l, k, r) = ({b}, {chunks}, k, r) for {start + n} tokens, "
                             f"got {tuple(neighbours.shape)}")
        completed = embed_neighbours(self.wte, neighbours[:, start // m:(start + n) // m])   # (b, l', k, r, d)
        before = cache.last_token if start else tokens.new_full((b,), -1)
        cache.last_token = tokens[:, -1]
        return DecodeStep(start, cache, neighbours, completed, torch.cat([before[:, None], tokens], 1))
