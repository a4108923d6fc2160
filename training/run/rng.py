"""A process's random-number state (torch CPU and CUDA, Python, NumPy) as tensors and plain values.

Saved per rank with every checkpoint and restored on resume, so that anything random after a
resume (dropout, sampling) continues exactly as the uninterrupted run would have. Tensors and
strings only, so that `torch.load(weights_only=True)` reads it back (no pickle).
"""

from __future__ import annotations

import ast
import random

import numpy as np
import torch


def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": repr(random.getstate()),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():  # dropout on a GPU draws from the device's generator
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    # repr() of Python's state is a tuple of ints (and None): literal_eval reads it without eval.
    random.setstate(ast.literal_eval(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
