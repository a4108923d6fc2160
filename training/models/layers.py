"""The layer list: what a model and every pipeline stage are built from.

A model class (GPT2, and Retro its subclass) defines its layers once, in order, as `LayerDesc`s
(`GPT2.layer_list(cfg)`). From that one list:
    - the model itself is built (`build_layers`: each layer's module under its state-dict name),
      and its forward runs the list in order;
    - DeepSpeed builds each pipeline stage's slice of it (training/pipeline/deepspeed_engine.py);
    - the partitioner weighs where to cut it (training/pipeline/partition.py, by `cost`).

Activations between layers (the pipeline contract; ids int64, everything else float):

    GPT-2:  tokens (b, n) ─wte→ x ─wpe→ h ─blocks→ h ─ln_f→ h ─wte→ logits (b, n, vocab)
    RETRO:  (tokens, ids) ─wte→ (x, ids, embedded (b, l, k, r, d), tokens) ─wpe→ (h, ids, embedded, tokens)
            ─blocks before the first CCA→ (h, ids, embedded, tokens)
            ─first CCA block→ (h, ids, encoded (b, l, k, r, e), tokens) ─blocks→ (h, ids, encoded, tokens)
            ─last CCA block→ h ─blocks, ln_f→ h ─wte→ logits

ids = neighbour token ids (b, l, k, r), -1 = missing (no separate mask crosses stages); tokens =
the sequence's own (b, n), which the CCAs' copy gate reads. Every float crossing a layer boundary
is differentiated downstream: `embedded` feeds the encoder, `encoded` the CCAs, and the last CCA
drops both.

Tying: the two `wte` entries (the input lookup, of RETRO's neighbours too; the output head) share
tie_key "embed" and one `TokenEmbedding` module; they differ by forward_fn(module, x). A layer's
`cost` estimates its forward GFLOPs per sequence of n_positions tokens, for cost-balanced cuts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn


@dataclass
class LayerDesc:
    # Prefix of the layer's parameters in the model's state dict ("wte", "wpe", "blocks.5", "ln_f").
    name: str
    cls: type
    kwargs: dict = field(default_factory=dict)
    # Layers with the same tie key share one module (built once); None = a layer of its own.
    tie_key: str | None = None
    # For tied layers: forward_fn(module, x) instead of module(x).
    forward_fn: Callable | None = None
    # Estimated forward GFLOPs per sequence (relative weights for pipeline partitioning).
    cost: float = 0.0
    # Whether the layer holds retrieval parameters (CCA, encoder): the ones a frozen trunk trains.
    retrieval: bool = False

    def build(self) -> nn.Module:
        return self.cls(**self.kwargs)


@contextlib.contextmanager
def seeded(seed: int):
    """Draw from torch's CPU generator as if freshly seeded, leaving the caller's state untouched.

    Only the CPU generator is seeded (layers are built on the CPU): `torch.manual_seed` would also
    reseed every CUDA generator, and leave each data-parallel replica with the same dropout masks.
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def attach(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register module at dotted `name` on root: "ln_f", or "blocks.5" in an nn.ModuleList
    (an nn.ModuleDict when the list starts elsewhere than 0: a slice of the layers)."""
    *parents, leaf = name.split(".")
    for part in parents:
        if not hasattr(root, part):  # a whole model's blocks are a list; a stage's slice of them a dict
            root.add_module(part, nn.ModuleList() if leaf == "0" else nn.ModuleDict())
        root = getattr(root, part)
    if isinstance(root, nn.ModuleList):
        if int(leaf) != len(root):
            raise ValueError(f"layer {name}: list layers must come in order (next is {len(root)})")
        root.append(module)
    else:
        root.add_module(leaf, module)


def build_layers(root: nn.Module, descs: list[LayerDesc], layer_seed: int | None = None
                 ) -> list[tuple[nn.Module, Callable | None]]:
    """Build every layer of the list onto root (a tied key's module once) and return the calls
    (module, forward_fn) to make in order.

    layer_seed: layer i is built under seed layer_seed + i, as the pipeline stage holding it
    builds it, so its weights do not depend on the cut; None = one stream in list order.
    """
    tied: dict[str, nn.Module] = {}
    calls = []
    for i, desc in enumerate(descs):
        if desc.tie_key in tied:
            module = tied[desc.tie_key]
        else:
            with seeded(layer_seed + i) if layer_seed is not None else contextlib.nullcontext():
                module = desc.build()
            attach(root, desc.name, module)
            if desc.tie_key is not None:
                tied[desc.tie_key] = module
        calls.append((module, desc.forward_fn))
    return calls


def run_layers(calls: list[tuple[nn.Module, Callable | None]], x):
    """Run the calls of `build_layers` in order on x."""
    for module, forward_fn in calls:
        x = forward_fn(module, x) if forward_fn is not None else module(x)
    return x


class LayerStack(nn.Module):
    """A slice of a layer list as one module, run in order: a pipeline stage in-process (tests and
    benchmarks; DeepSpeed builds the real stages). Parameter names are the model's."""

    def __init__(self, descs: list[LayerDesc], layer_seed: int | None = None):
        super().__init__()
        self._calls = build_layers(self, descs, layer_seed)

    def forward(self, x):
        return run_layers(self._calls, x)
