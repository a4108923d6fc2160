"""Where the pipeline is cut: stage boundaries over the model's layer list (training/models/layers.py).

    parts = partition(layer_list(cfg), stages=2, method="cost")   # e.g. [0, 4, 6]
    # stage s runs layers parts[s]:parts[s+1]

Pure Python over `LayerDesc`s (no DeepSpeed): launch/train.py checks the cut before any process
starts, and the adapter (training/pipeline/deepspeed_engine.py) hands the same boundaries to DeepSpeed.

Every stage must own a gradient: a stage of tied layers alone (e.g. the LM head, whose vocabulary
matmul dominates small models) has no parameter of its own, which DeepSpeed's optimizers reject;
with a frozen trunk (RETRO-fit) only RETRO layers train, so each stage needs one (and stage 0's
outputs then require grad, as the pipe's backward needs).
"""

from __future__ import annotations

from typing import Callable

from retropipe.training.models.layers import LayerDesc


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of num_parts near-equal runs of items, the first ones one longer (DeepSpeed's
    `partition_uniform`); more parts than items gives trailing empty parts."""
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def min_max_partition(weights: list[float], stages: int, valid: Callable[[int, int], bool]) -> list[int] | None:
    """Boundaries minimising the costliest stage, over cuts where valid(start, stop) holds for
    every stage; None when no such cut exists. Exact (dynamic programming, O(stages · n²))."""
    n, inf = len(weights), float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[s][i]: the lowest max-stage cost of layers [0, i) in s stages; cut[s][i]: the last cut.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] < inf and valid(j, i):
                    cost = max(best[s - 1][j], prefix[i] - prefix[j])
                    if cost < best[s][i]:
                        best[s][i], cut[s][i] = cost, j
    if best[stages][n] == inf:
        return None
    parts = [n]
    for s in range(stages, 0, -1):
        parts.append(cut[s][parts[-1]])
    return parts[::-1]


def stage_trains(descs: list[LayerDesc], frozen_trunk: bool) -> Callable[[int, int], bool]:
    """valid(start, stop): whether a stage of layers [start, stop) owns a parameter that trains."""

    def valid(start: int, stop: int) -> bool:
        layers = descs[start:stop]
        if frozen_trunk:
            return any(d.retrieval for d in layers)
        return not all(d.tie_key for d in layers)

    return valid


def layer_weights(descs: list[LayerDesc], method: str) -> list[float]:
    """Per-layer weights: estimated FLOPs ("cost") or parameters ("parameters", counted without
    materialising the weights; a tied layer counts once, at its first use)."""
    if method == "cost":
        return [d.cost for d in descs]
    import torch

    seen, weights = set(), []
    for d in descs:
        if d.tie_key in seen:
            weights.append(0)
            continue
        with torch.device("meta"):
            weights.append(sum(p.numel() for p in d.build().parameters()))
        if d.tie_key:
            seen.add(d.tie_key)
    return weights


def partition(descs: list[LayerDesc], stages: int, method: str, frozen_trunk: bool = False) -> list[int]:
    """Stage boundaries [0, ..., len(descs)] by `method` ("cost", "parameters" or "uniform");
    a ValueError naming the train.* key when no cut lets every stage train."""
    if stages > len(descs):
        raise ValueError(f"train.pipeline_stages={stages} exceeds the model's {len(descs)} pipeline layers")
    valid = stage_trains(descs, frozen_trunk)
    if method == "uniform":
        parts = partition_uniform(len(descs), stages)
        if not all(valid(a, b) for a, b in zip(parts, parts[1:])):
            raise ValueError(f"train.partition=uniform: the uniform cut {parts} leaves a stage without a layer "
                             f"that trains; use train.partition=cost, which searches for a valid cut")
        return parts
    parts = min_max_partition(layer_weights(descs, method), stages, valid)
    if parts is None:
        need = "a RETRO (CCA) layer, as only those train with a frozen trunk" if frozen_trunk else \
            "a layer of its own besides the tied embedding"
        raise ValueError(f"train.pipeline_stages={stages}: no '{method}' partition of the model's "
                         f"{len(descs)} pipeline layers gives every stage {need}")
    return parts
