"""GPT-2: a pre-LayerNorm decoder with learned absolute positions and tied input/output embeddings.

    model = GPT2(cfg)                                   # cfg: ModelConfig with kind "gpt2"
    logits = model(tokens)                              # (b, n) int64 → (b, n, vocab)
    logits = model.decode(new_tokens, None, cache)      # generation: cache = model.new_cache()

The model is its layer list (`GPT2.layer_list`, training/models/layers.py): the constructor builds
the list's modules under their state-dict names, forward runs them in order, and a pipeline stage
builds a slice of the same list. RETRO (retro.py) is a subclass that changes the list's first
layer and the blocks that hold cross-attention, and what the first layer reads.

Parameter names follow Hugging Face `GPT2LMHeadModel` minus its `transformer.` prefix
(`wte`, `wpe`, `blocks.i.attn.c_attn`, ...), so `hf_interop.py` only renames `h` to `blocks` and
transposes its Conv1D weights. The output head is the token embedding itself (`lm_logits`), so
the state dict holds no `lm_head` and GPT-2 small counts exactly 124,439,808 parameters.

Layers pass either a bare tensor or a tuple whose first item is the hidden state `h`; a plain
`Block` transforms `h` and hands the rest of the tuple (RETRO's neighbour ids, encoded neighbours)
on untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from retropipe.training.models.cache import DecodeCache, DecodeStep, LayerCache
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.layers import LayerDesc, build_layers, run_layers
from retropipe.training.models.lm_head import IGNORE_INDEX, SliceBuffers, lm_loss


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
    module's own forward is replaced by its first use (training/pipeline/deepspeed_engine.py), so a call would run
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
    dense gradient, so `.grad` is never sparse: so in bf16, where each micro-batch's gradient goes
    to its fp32 copy after its backward and `.grad` is let go (training/pipeline/bf16_grads.py).
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
    """Last layer of the fused path: h (b, n, d) and the tied matrix, for `FusedLoss`, which
    computes the logits and the loss slice by slice (training/models/lm_head.py)."""
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


# CPU training in bf16 or fp16 computes attention as explicit matmuls instead of SDPA while the
# scores per head (queries × keys) are at most this many per channel of a head: the matmuls' extra
# traffic grows with the scores, flash attention's work with scores × channels, and torch's CPU
# flash attention (forward and backward) is the slower of the two up to 512² scores at 64 channels
# (768² is a tie), 362² at 32 (docs/benchmarks.md, "Attention in bf16 on a CPU").
EXPLICIT_ATTENTION_SCORES_PER_CHANNEL = 4096


def attention(q, k, v, mask=None, dropout_p: float = 0.0, is_causal: bool = False) -> torch.Tensor:
    """softmax(q·kᵀ/√c + mask) v for q (B, h, t, c), k and v (B, h, s, c); mask bool (True =
    attend) or float (added), broadcastable to (B, h, t, s), leaving every row a key (a row with
    none gives NaN here, where SDPA gives 0); is_causal (no mask, t = s): query i sees keys 0 … i.

    SDPA, except when training in bf16/fp16 on a CPU with t · s ≤ EXPLICIT_ATTENTION_SCORES_PER_CHANNEL
    · c: there explicit matmuls are faster, keeping the (B, h, t, s) probabilities for backward
    (small at these sizes). The mask enters as the additive term of the scores' matmul (baddbmm)
    and 1/√c as its alpha, so no pass over the scores scales or masks them, forward or backward.
    """
    if is_causal and (mask is not None or q.shape[-2] != k.shape[-2]):
        raise ValueError("attention: is_causal takes no mask and as many queries as keys")
    if (q.device.type != "cpu" or q.dtype == torch.float32 or not torch.is_grad_enabled()
            or q.shape[-2] * k.shape[-2] > EXPLICIT_ATTENTION_SCORES_PER_CHANNEL * q.shape[-1]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    (B, h, t, c), s = q.shape, k.shape[-2]
    bias = _additive_mask(mask, is_causal, t, s, q)
    bias = bias[(None,) * (4 - bias.dim())]                                      # (B or 1, h or 1, t or 1, s or 1)
    bias = bias[0] if bias.shape[:2] == (1, 1) else bias.expand(B, h, *bias.shape[2:]).reshape(B * h, *bias.shape[2:])
    scores = torch.baddbmm(bias, q.reshape(B * h, t, c), k.reshape(B * h, s, c).transpose(1, 2), alpha=c ** -0.5)
    probs = scores.softmax(dim=-1).view(B, h, t, s)
    return (F.dropout(probs, dropout_p) if dropout_p else probs) @ v


def _additive_mask(mask, is_causal: bool, t: int, s: int, like: torch.Tensor) -> torch.Tensor:
    """The mask as a float term added to the scores, in like's dtype: 0 where attended, -inf not."""
    if is_causal:
        return torch.full((t, s), float("-inf"), dtype=like.dtype, device=like.device).triu_(1)
    if mask is None:
        return like.new_zeros(1, 1)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(~mask, float("-inf"))
    return mask.to(like.dtype)


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
            y = attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
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

    def decode(self, h: torch.Tensor, layer: LayerCache, step: DecodeStep) -> torch.Tensor:
        """forward for new positions h (b, T, d), attending to the cached ones too."""
        h = h + self.attn(self.ln_1(h), layer)
        return h + self.mlp(self.ln_2(h))


def block_flops(cfg: ModelConfig, n: int) -> float:
    """Forward FLOPs of one block over n tokens: q, k, v, proj, MLP matmuls + attention scores and values."""
    d = cfg.n_embd
    return 24 * n * d * d + 4 * n * n * d


class GPT2(nn.Module):
    """The baseline: forward(tokens (b, n) int64) -> logits (b, n, vocab).

    layer_seed: layer i is built under seed layer_seed + i, as the pipeline stage holding it
    builds it (the single-process twin of a pipeline run); None = one stream, in list order.
    fused_head: the last layer hands (h, W) to `FusedLoss` instead of the logits.
    """

    def __init__(self, cfg: ModelConfig, layer_seed: int | None = None, fused_head: bool = False):
        super().__init__()
        self.cfg = cfg
        # wte, wpe, blocks (an nn.ModuleList), ln_f: attributes named as in the state dict.
        self._calls = build_layers(self, self.layer_list(cfg, fused_head), layer_seed)

    # -- the definition --
    @classmethod
    def layer_list(cls, cfg: ModelConfig, fused_head: bool = False) -> list[LayerDesc]:
        """The model's layers in order: the token embedding's first use, the positions, the blocks,
        the final LayerNorm, the tied output head (with fused_head: `head_inputs`)."""
        n, d = cfg.n_positions, cfg.n_embd
        wte = dict(cls=TokenEmbedding, kwargs=dict(vocab_size=cfg.vocab_size, n_embd=d, init_std=cfg.embedding_init_std),
                   tie_key="embed")
        first_fn, first_cost = cls.first_layer(cfg)
        return [LayerDesc("wte", **wte, forward_fn=first_fn, cost=first_cost),
                LayerDesc("wpe", PositionEmbedding, dict(cfg=cfg), cost=n * d * 1e-9),
                *(cls.block(cfg, i) for i in range(cfg.n_layer)),
                LayerDesc("ln_f", nn.LayerNorm, dict(normalized_shape=d), cost=n * d * 1e-9),
                LayerDesc("wte", **wte, forward_fn=head_inputs if fused_head else lm_logits,
                          cost=2 * n * d * cfg.vocab_size * 1e-9)]

    @classmethod
    def first_layer(cls, cfg: ModelConfig):
        """(forward_fn of the token embedding's first use, its GFLOPs)."""
        return embed_tokens, cfg.n_positions * cfg.n_embd * 1e-9

    @classmethod
    def block(cls, cfg: ModelConfig, i: int) -> LayerDesc:
        """Block i (0-indexed)."""
        return LayerDesc(f"blocks.{i}", Block, dict(cfg=cfg), cost=block_flops(cfg, cfg.n_positions) * 1e-9)

    def inputs(self, tokens: torch.Tensor, neighbours: torch.Tensor | None):
        """What the first layer reads."""
        if neighbours is not None:
            raise ValueError("the GPT-2 baseline takes no neighbours (model.kind is 'gpt2')")
        return tokens

    # -- forward: the list in order --
    def hidden(self, tokens: torch.Tensor, neighbours: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states (b, n, d), after ln_f: what the tied head reads."""
        return run_layers(self._calls[:-1], self.inputs(tokens, neighbours))

    def forward(self, tokens: torch.Tensor, neighbours: torch.Tensor | None = None):
        """logits (b, n, vocab); with fused_head, (h, W) for `FusedLoss`."""
        return run_layers(self._calls[-1:], self.hidden(tokens, neighbours))

    # -- generation: the same modules, one step at a time --
    def new_cache(self) -> DecodeCache:
        return DecodeCache(self.cfg)

    def decode(self, tokens: torch.Tensor, neighbours: torch.Tensor | None, cache: DecodeCache) -> torch.Tensor:
        """Incremental forward for generation: tokens (b, T) at positions cache.length …, the earlier
        ones read from the cache; returns the last position's logits (b, vocab), as forward's."""
        step = self.decode_step(tokens, neighbours, cache)
        h = self.wpe(embed_tokens(self.wte, tokens), step.start)                 # (b, T, d)
        for block, layer in zip(self.blocks, cache.layers):
            h = block.decode(h, layer, step)
        cache.length += tokens.shape[1]
        return lm_logits(self.wte, self.ln_f(h[:, -1]))                         # (b, vocab)

    def decode_step(self, tokens: torch.Tensor, neighbours: torch.Tensor | None, cache: DecodeCache) -> DecodeStep:
        """What every block of this decode call shares."""
        self.inputs(tokens, neighbours)  # the same check as forward's
        return DecodeStep(cache.length, cache)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


class FusedLoss:
    """loss_fn of the fused path: outputs = (h, tied matrix) from `head_inputs`; same value as
    loss_fn(h @ Wᵀ, labels), without ever holding all the logits (training/models/lm_head.py).
    One per training run: it keeps the head's slice buffers from one micro-batch to the next."""

    def __init__(self):
        self.buffers = SliceBuffers()

    def __call__(self, outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        h, weight = outputs
        return lm_loss(h, weight, labels, buffers=self.buffers)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over labels != -100 (padding); labels are already the next tokens.

    Computed in fp32 whatever the logits' dtype. A micro-batch with no label at all gives 0, not
    NaN, so an all-padding micro-batch cannot poison a pipeline step.
    """
    logits = rearrange(logits, "b n v -> (b n) v").float()
    labels = rearrange(labels, "b n -> (b n)")
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
