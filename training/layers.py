"""The models as a flat list of layers: what pipeline stages are cut from.

    layer_list(cfg) -> list[LayerDesc]     # GPT-2 or RETRO, per cfg.kind
    build_sequential(cfg) -> LayerSequence  # the list run in-process (CPU tests, no DeepSpeed)
    build_sequential_seeded(cfg, seed)      # the same, each layer built under seed + its index,
                                            # as every pipeline stage builds it (training/pipeline.py)

Activations between layers (the pipeline contract; ids int64, everything else float):

    GPT-2:  tokens (b, n) ─wte→ x ─wpe→ h ─blocks→ h ─ln_f→ h ─wte→ logits (b, n, vocab)
    RETRO:  (tokens, ids) ─wte→ (x, ids, embedded (b, l, k, r, d)) ─wpe→ (h, ids, embedded)
            ─blocks before the first CCA→ (h, ids, embedded)
            ─first CCA block→ (h, ids, encoded (b, l, k, r, e)) ─blocks→ (h, ids, encoded)
            ─last CCA block→ h ─blocks, ln_f→ h ─wte→ logits

ids = neighbour token ids (b, l, k, r), -1 = missing (no separate mask crosses stages). Every
float crossing a layer boundary is differentiated downstream: `embedded` feeds the encoder,
`encoded` the CCAs, and the last CCA drops both.

Tying: the two `wte` entries (the input lookup, of RETRO's neighbours too; the output head)
share tie_key "embed" and one `TokenEmbedding` module; they differ by forward_fn(module, x). The
DeepSpeed adapter (training/pipeline.py `layer_specs`) builds the first use as a `TiedLayerSpec`
of a subclass whose own forward is that use (DeepSpeed saves a tied module only through a use
without forward_fn) and the later uses as
`TiedLayerSpec(d.tie_key, d.cls, forward_fn=d.forward_fn)`; untied layers are `LayerSpec`s.
`d.name` is the layer's prefix in the GPT2/Retro state dict ("wte", "wpe", "blocks.5", "ln_f").
`d.cost` estimates forward GFLOPs per sequence of n_positions tokens (k = 2 neighbours of
2 · chunk_len tokens) for cost-balanced partitioning.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from training.config import ModelConfig
from training.model import Block, PositionEmbedding, TokenEmbedding, embed_tokens, head_inputs, lm_logits
from training.retro import RetroBlock, embed_inputs, freeze_trunk, no_neighbours

# Neighbours per chunk assumed by the cost estimates.
COST_NEIGHBOURS = 2


@dataclass
class LayerDesc:
    # Prefix of the layer's parameters in the GPT2 / Retro state dict.
    name: str
    cls: type
    kwargs: dict = field(default_factory=dict)
    # Layers with the same tie key share one module (built once); None = a layer of its own.
    tie_key: str | None = None
    # For tied layers: forward_fn(module, x) instead of module(x).
    forward_fn: Callable | None = None
    # Estimated forward GFLOPs per sequence (relative weights for pipeline partitioning).
    cost: float = 0.0

    def build(self) -> nn.Module:
        return self.cls(**self.kwargs)


def _block_flops(cfg: ModelConfig, n: int) -> float:
    d = cfg.n_embd
    return 24 * n * d * d + 4 * n * n * d  # q, k, v, proj, MLP matmuls + attention scores and values


def _cca_flops(cfg: ModelConfig, n: int, first: bool) -> float:
    d, e, m, k = cfg.n_embd, cfg.encoder_embd, cfg.chunk_len, COST_NEIGHBOURS
    r = 2 * m
    nb = (n // m) * k * r  # neighbour tokens per sequence
    flops = 4 * n * d * d + 4 * nb * e * d + 4 * n * k * r * d  # q/out, k/v, attention
    if first:  # the encoder: input projection, then per layer self-attn, cross-attn, MLP
        per_layer = 8 * nb * e * e + 4 * nb * r * e + 4 * nb * e * e + 4 * n * d * e \
            + 4 * nb * m * e + 16 * nb * e * e
        flops += 2 * nb * d * e + cfg.encoder_layers * per_layer
    return flops


def layer_list(cfg: ModelConfig, fused_head: bool = False) -> list[LayerDesc]:
    """The model's layers in order; fused_head ends with `head_inputs` (h and the tied matrix, for
    model.fused_loss_fn) instead of the logits."""
    n, d, giga = cfg.n_positions, cfg.n_embd, 1e-9
    retro = cfg.kind == "retro"
    wte = dict(cls=TokenEmbedding, kwargs=dict(vocab_size=cfg.vocab_size, n_embd=d, init_std=cfg.embedding_init_std),
               tie_key="embed")
    first_fn = functools.partial(embed_inputs, chunk_len=cfg.chunk_len) if retro else embed_tokens
    nb = (n // cfg.chunk_len) * COST_NEIGHBOURS * 2 * cfg.chunk_len if retro else 0  # neighbour tokens looked up too
    descs = [LayerDesc("wte", **wte, forward_fn=first_fn, cost=(n + nb) * d * giga),
             LayerDesc("wpe", PositionEmbedding, dict(cfg=cfg), cost=n * d * giga)]
    cca = [i - 1 for i in cfg.cca_layers()] if retro else []
    for i in range(cfg.n_layer):
        if i in cca:
            flops = _block_flops(cfg, n) + _cca_flops(cfg, n, first=i == cca[0])
            descs.append(LayerDesc(f"blocks.{i}", RetroBlock, dict(cfg=cfg, first=i == cca[0], last=i == cca[-1]),
                                   cost=flops * giga))
        else:
            descs.append(LayerDesc(f"blocks.{i}", Block, dict(cfg=cfg), cost=_block_flops(cfg, n) * giga))
    descs.append(LayerDesc("ln_f", nn.LayerNorm, dict(normalized_shape=d), cost=n * d * giga))
    descs.append(LayerDesc("wte", **wte, forward_fn=head_inputs if fused_head else lm_logits,
                           cost=2 * n * d * cfg.vocab_size * giga))
    return descs


def _attach(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register module at dotted `name` ("blocks.5"), creating ModuleDict parents as needed."""
    *parents, leaf = name.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, nn.ModuleDict())
        root = getattr(root, part)
    root.add_module(leaf, module)


class LayerSequence(nn.Module):
    """The layer list run in order, with parameter names equal to the monolithic model's."""

    def __init__(self, cfg: ModelConfig, descs: list[LayerDesc]):
        super().__init__()
        self.cfg = cfg
        tied: dict[str, nn.Module] = {}
        self._calls: list[tuple[nn.Module, Callable | None]] = []  # plain list: not registered twice
        for desc in descs:
            if desc.tie_key is not None and desc.tie_key in tied:
                module = tied[desc.tie_key]
            else:
                module = desc.build()
                _attach(self, desc.name, module)
                if desc.tie_key is not None:
                    tied[desc.tie_key] = module
            self._calls.append((module, desc.forward_fn))
        if cfg.freeze_trunk:
            freeze_trunk(self)

    def forward(self, tokens: torch.Tensor, neighbours: torch.Tensor | None = None) -> torch.Tensor:
        x = tokens
        if self.cfg.kind == "gpt2" and neighbours is not None:
            raise ValueError("the GPT-2 baseline takes no neighbours (model.kind is 'gpt2')")
        if self.cfg.kind == "retro":
            x = (tokens, neighbours if neighbours is not None else no_neighbours(tokens, self.cfg.chunk_len))
        for module, forward_fn in self._calls:
            x = forward_fn(module, x) if forward_fn is not None else module(x)
        return x


def build_sequential(cfg: ModelConfig, fused_head: bool = False) -> LayerSequence:
    return LayerSequence(cfg, layer_list(cfg, fused_head))


@contextlib.contextmanager
def seeded(seed: int):
    """Draw from torch's CPU generator as if freshly seeded, leaving the caller's state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def seeded_class(cls: type, seed: int) -> type:
    """`cls` whose constructor draws its initial weights under `seed`."""
    def __init__(self, *args, **kwargs):
        with seeded(seed):
            cls.__init__(self, *args, **kwargs)
    return type(cls.__name__, (cls,), {"__init__": __init__})


def build_sequential_seeded(cfg: ModelConfig, seed: int, fused_head: bool = False) -> LayerSequence:
    """The single-process twin of the pipeline: layer i is built under seed + i, as the stage
    holding it builds it, so the weights do not depend on the cut (2-stage loss == 1-stage loss)."""
    descs = [LayerDesc(d.name, seeded_class(d.cls, seed + i), d.kwargs, d.tie_key, d.forward_fn, d.cost)
             for i, d in enumerate(layer_list(cfg, fused_head=fused_head))]
    return LayerSequence(cfg, descs)
