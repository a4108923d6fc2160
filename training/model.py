"""GPT-2: a pre-LayerNorm decoder with learned absolute positions and tied input/output embeddings.

Parameter names follow Hugging Face `GPT2LMHeadModel` minus its `transformer.` prefix
(`wte`, `wpe`, `blocks.i.attn.c_attn`, ...), so `hf_interop.py` only renames `h` to `blocks` and
transposes its Conv1D weights. The output head is the token embedding itself (`lm_logits`), so
the state dict holds no `lm_head` and GPT-2 small counts exactly 124,439,808 parameters.

Every module below is also a layer of `layers.layer_list` (the pipeline form). Layers pass either
a bare tensor or a tuple whose first item is the hidden state `h`; a plain `Block` transforms
`h` and hands the rest of the tuple (RETRO's neighbour ids, encoded neighbours) on untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from training.config import ModelConfig

IGNORE_INDEX = -100


def init_weights(module: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2·n_layer).

    Each layer class calls this on itself, so a pipeline stage that builds only some layers
    initialises them exactly as the monolithic model would.
    """
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            # c_proj (and the CCA/encoder output projections) write into the residual stream.
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("c_proj", "proj")) else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)


class TokenEmbedding(nn.Embedding):
    """The token embedding `wte`, shared by the input, the output head and RETRO's neighbours.

    It is the one tied module (DeepSpeed: `TiedLayerSpec('embed', TokenEmbedding, ...)`); its uses
    are the functions `embed_tokens` (RETRO: `retro.embed_inputs`, which looks up the neighbours
    too) and `lm_logits`. They read `wte.weight` rather than calling `wte(...)`: in a pipeline the
    module's own forward is replaced by its first use (training/pipeline.py), so a call would run
    the wrong use.
    """

    def __init__(self, vocab_size: int, n_embd: int, init_std: float = 0.02):
        super().__init__(vocab_size, n_embd)
        nn.init.normal_(self.weight, mean=0.0, std=init_std)


class _Lookup(torch.autograd.Function):
    """F.embedding whose backward adds into the weight's existing gradient instead of building a
    dense (vocab, d) one per call (CPU).

    A dense embedding gradient is 77 MB at GPT-2's vocabulary and d = 384: written as zeros,
    scattered into, then read and added to `.grad` once more for every micro-batch, while the rows
    it changes are a few thousand. On a CPU pipeline stage that memory traffic, contending with the
    other stage's head, was the largest cost after the matmuls (docs/benchmarks.md). So once the
    weight holds a dense gradient (from an earlier backward: an earlier micro-batch of the step),
    this returns a sparse one: autograd adds it in place (`dense += sparse`), its accumulation
    hooks (DeepSpeed's) still run, and `.grad` stays dense. While `.grad` is None it returns a
    dense gradient, so `.grad` is never sparse.
    """

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight  # the parameter itself: its .grad is read at backward time
        return F.embedding(ids, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows, flat = ids.reshape(-1).long(), grad.reshape(-1, grad.shape[-1])          # (b·n,), (b·n, d)
        held = weight.grad
        if held is None or held.is_sparse or held.dtype != grad.dtype or held.device != grad.device:
            return None, torch.zeros(weight.shape, dtype=grad.dtype, device=grad.device).index_add_(0, rows, flat)
        return None, torch.sparse_coo_tensor(rows.unsqueeze(0), flat, weight.shape, check_invariants=False)


def lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ids (...) int → (..., d): the tied embedding's lookup for training (see `_Lookup`).

    CPU only: on a GPU the dense gradient costs little, and `F.embedding`'s own backward sums each
    row in a fixed order in fp32, where `index_add_` would add in bf16 with atomics (run-to-run
    differences)."""
    if torch.is_grad_enabled() and weight.requires_grad and weight.device.type == "cpu":
        return _Lookup.apply(ids, weight)
    return F.embedding(ids, weight)


def embed_tokens(wte: TokenEmbedding, x):
    """First layer: tokens (b, n) int64 → (b, n, d); RETRO's tuple keeps its neighbour ids."""
    if isinstance(x, tuple):
        tokens, *rest = x
        return (lookup(wte.weight, tokens), *rest)
    return lookup(wte.weight, x)


def lm_logits(wte: TokenEmbedding, h: torch.Tensor) -> torch.Tensor:
    """Last layer: (b, n, d) → logits (b, n, vocab) through the tied embedding matrix."""
    return F.linear(h, wte.weight)


def head_inputs(wte: TokenEmbedding, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Last layer of the fused path: h (b, n, d) and the tied matrix, for `fused_loss_fn`, which
    computes the logits and the loss slice by slice (training/lm_head.py)."""
    return h, wte.weight


class PositionEmbedding(nn.Module):
    """Adds the learned absolute position `wpe` to the token embedding, then embedding dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_positions = cfg.n_positions
        # A bare parameter, so its name is "wpe.weight" as in GPT-2.
        self.weight = nn.Parameter(torch.empty(cfg.n_positions, cfg.n_embd).normal_(mean=0.0, std=0.02))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, start: int = 0):
        # start: position of the first token (> 0 only when decoding with a cache).
        x, *rest = x if isinstance(x, tuple) else (x,)
        n = x.shape[1]
        if start + n > self.n_positions:
            raise ValueError(f"sequence of {start + n} tokens is longer than model.n_positions ({self.n_positions})")
        h = self.drop(x + self.weight[start:start + n])  # (b, n, d)
        return (h, *rest) if rest else h


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
    """Everything an incremental forward (`model.decode`) keeps between calls.

    `layers[i]`: block i's keys and values. `length`: positions fed so far (the next token's
    position). RETRO also keeps `states` (b, capacity, d), the decoder states after the first CCA
    block's self-attention that the encoder reads, and for every complete chunk its neighbour ids
    `neighbours` (b, chunks, k, r) and their encoding `encoded` (b, chunks, k, r, e)
    (retro.RetroBlock.decode).
    """

    def __init__(self, cfg: ModelConfig):
        self.layers = [LayerCache(cfg.n_positions) for _ in range(cfg.n_layer)]
        self.length = 0
        self.states: torch.Tensor | None = None
        self.neighbours: torch.Tensor | None = None
        self.encoded: torch.Tensor | None = None

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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        # One fused projection for q, k, v: the layout of GPT-2's c_attn.
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:  # (b, n, d)
        q, k, v = rearrange(self.c_attn(x), "b n (three h c) -> three b h n c", three=3, h=self.n_head)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            # The n new queries follow `past` cached positions: query i sees keys 0 … past + i.
            past = cache.length
            k, v = cache.append(k, v)                                            # (b, h, past + n, c)
            n = q.shape[2]
            mask = None if n == 1 else torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.resid_drop(self.c_proj(rearrange(y, "b h n c -> b n (h c)")))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN decoder layer: h + attn(ln(h)), then h + mlp(ln(h)).

    Accepts `h` or a tuple `(h, *rest)`; `rest` (int64 ids, RETRO's encoded neighbours) passes
    through unchanged, which is what lets the same block sit anywhere in a pipeline.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg.n_embd, cfg.dropout)
        init_weights(self, cfg.n_layer)

    def forward(self, x):
        h, *rest = x if isinstance(x, tuple) else (x,)
        h = h + self.attn(self.ln_1(h))
        h = h + self.mlp(self.ln_2(h))
        return (h, *rest) if rest else h

    def decode(self, h: torch.Tensor, layer: LayerCache) -> torch.Tensor:
        """forward for new positions h (b, T, d), attending to the cached ones too."""
        h = h + self.attn(self.ln_1(h), layer)
        return h + self.mlp(self.ln_2(h))


class GPT2(nn.Module):
    """The baseline: `forward(tokens (b, n) int64) -> logits (b, n, vocab)`.

    The forward below is literally the layer list of `layers.layer_list(cfg)` run in order, so the
    pipeline form computes bit-identical results from the same state dict.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = TokenEmbedding(cfg.vocab_size, cfg.n_embd, cfg.embedding_init_std)
        self.wpe = PositionEmbedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)

    def hidden(self, tokens: torch.Tensor, neighbours: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states (b, n, d), after ln_f: what the tied head reads."""
        if neighbours is not None:
            raise ValueError("the GPT-2 baseline takes no neighbours (model.kind is 'gpt2')")
        h = self.wpe(embed_tokens(self.wte, tokens))  # (b, n, d)
        for block in self.blocks:
            h = block(h)
        return self.ln_f(h)

    def forward(self, tokens: torch.Tensor, neighbours: torch.Tensor | None = None) -> torch.Tensor:
        return lm_logits(self.wte, self.hidden(tokens, neighbours))  # (b, n, vocab)

    def new_cache(self) -> DecodeCache:
        return DecodeCache(self.cfg)

    def decode(self, tokens: torch.Tensor, neighbours: None, cache: DecodeCache) -> torch.Tensor:
        """Incremental forward for generation: tokens (b, T) at positions cache.length …, the earlier
        ones read from the cache; returns the last position's logits (b, vocab), as forward's."""
        if neighbours is not None:
            raise ValueError("the GPT-2 baseline takes no neighbours (model.kind is 'gpt2')")
        h = self.wpe(embed_tokens(self.wte, tokens), cache.length)              # (b, T, d)
        for block, layer in zip(self.blocks, cache.layers):
            h = block.decode(h, layer)
        cache.length += tokens.shape[1]
        return lm_logits(self.wte, self.ln_f(h[:, -1]))                         # (b, vocab)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


def fused_loss_fn(outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """loss_fn of the fused path: outputs = (h, tied matrix) from `head_inputs`; same value as
    loss_fn(h @ Wᵀ, labels), without ever holding all the logits (training/lm_head.py)."""
    from training.lm_head import lm_loss

    h, weight = outputs
    return lm_loss(h, weight, labels)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over labels != -100 (padding); labels are already the next tokens.

    Computed in fp32 whatever the logits' dtype. A micro-batch with no label at all gives 0, not
    NaN, so an all-padding micro-batch cannot poison a pipeline step.
    """
    logits = rearrange(logits, "b n v -> (b n) v").float()
    labels = rearrange(labels, "b n -> (b n)")
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
