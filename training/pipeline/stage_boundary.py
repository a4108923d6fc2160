"""What crosses a pipeline cut: RETRO's (h, ids, z, tokens) as one float tensor (hz) and the ints.

z is the neighbours' state: embedded (b, l, k, r, d) before the first CCA layer, encoded
(b, l, k, r, e) after it. DeepSpeed's pipeline engine runs a stage's backward once per float
tensor the stage sent on (`PipelineEngine._exec_backward_pass`: `h.backward(g_h,
retain_graph=True)`, then `z.backward(g_z)`). After the first CCA layer z depends on h below that
layer, so sent as two tensors every layer down there would run backward twice: right gradients,
twice the time (docs/benchmarks.md, "One tensor across the cut"). Sent as one, a stage runs
backward once. Plain torch: training/pipeline/deepspeed_engine.py wraps the layers either side of
each cut with these.
"""

from __future__ import annotations

import torch


def pack_boundary(x):
    """RETRO's (h, ids, z, tokens) as (hz, ids, tokens), hz (b, n·d + l·k·r·w): its two float
    tensors as one. Anything else (GPT-2's h, RETRO's h after the last CCA layer) passes unchanged."""
    if (isinstance(x, tuple) and len(x) == 4 and x[0].is_floating_point() and x[2].is_floating_point()
            and not x[1].is_floating_point() and not x[3].is_floating_point()):
        h, ids, z, tokens = x
        if h.dtype != z.dtype:  # one model, one dtype: anything else is a bug upstream, not a case
            raise TypeError(f"pack_boundary: h is {h.dtype} but the neighbours are {z.dtype}")
        return torch.cat([h.flatten(1), z.flatten(1)], dim=1), ids, tokens
    return x


def unpack_boundary(x, n_embd: int, chunk_len: int):
    """pack_boundary undone on the next stage: views of the received tensor, so its gradient is one too."""
    if (isinstance(x, tuple) and len(x) == 3 and x[0].is_floating_point() and not x[1].is_floating_point()
            and not x[2].is_floating_point()):
        hz, ids, tokens = x
        (b, l, k, r), n = ids.shape, ids.shape[1] * chunk_len
        h, z = hz.split([n * n_embd, hz.shape[1] - n * n_embd], dim=1)
        # (b, n, d), (b, l, k, r), (b, l, k, r, w), (b, n)
        return h.view(b, n, n_embd), ids, z.view(b, l, k, r, -1), tokens
    return x


def at_boundary(forward_fn, pack: bool, unpack):
    """forward_fn(module, x) that unpacks what a stage received and/or packs what it sends on."""
    def fn(module, x):
        out = forward_fn(module, unpack(x) if unpack else x)
        return pack_boundary(out) if pack else out
    return fn


def class_at_boundary(cls: type, pack: bool, unpack) -> type:
    """`cls` (same name, same parameters) whose forward is wrapped as at_boundary does."""
    fn = at_boundary(cls.forward, pack, unpack)
    return type(cls.__name__, (cls,), {"forward": lambda self, x: fn(self, x)})
