"""The output head and its cross-entropy, fused and computed over slices of tokens.

    loss = lm_loss(h, wte.weight, labels)        # h (b, n, d), labels (b, n): the mean token NLL

Plain path: logits = h @ Wᵀ, (b, n, vocab) at once, then cross-entropy. At GPT-2's 50,257-way
vocabulary the logits dwarf everything else a small model holds: 4 × 256 × 50,257 floats are
206 MB, written, read and written again by the softmax and its gradient. The fused path never
holds more than `slice_tokens` rows of logits: for each slice of tokens it computes the logits,
their softmax (one row-wise pass) and the loss, and, when gradients are wanted, straight away
the gradient of the loss with respect to the slice's logits (softmax − one-hot, in place) and
from it the gradients of h and W (W's accumulated in place), which backward only scales. Only
the N' tokens with a target enter it (padding's logits would be computed for nothing): 6·N'·d·V
FLOPs with W trainable, 4·N'·d·V without, and a fraction of the plain path's memory traffic.
`loss_fn(logits, labels)` in training/models/gpt2.py stays the plain path; a test checks both give
the same loss and gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Tokens per slice on a CPU: 256 × 50,257 fp32 logits are 51 MB; small enough to stay out of the
# way, large enough that the slice matmuls run at full speed (bench/lm_head.py measures it).
SLICE_TOKENS = 256
# On a GPU the slice matmuls need many rows to fill the device: 4,096 rows (two bf16 buffers of
# 412 MB at GPT-2's vocabulary) ran GPT-2 124M's training step 1.6× faster than 256 on an H200.
GPU_SLICE_TOKENS = 4096
# cuBLAS runs its fast tensor-core kernels only where the leading dimensions are multiples of 8
# elements; at GPT-2's odd vocabulary (50,257) the head's three products fell back to slow kernels,
# half of an H200's step (docs/benchmarks.md, "GPU: one NVIDIA H200"). On a GPU the head computes
# against the matrix padded with zero rows to a multiple of this, their logits -inf: no share of
# the softmax, no gradient, the same loss.
GPU_VOCAB_MULTIPLE = 64


def slice_tokens_for(device: torch.device) -> int:
    return GPU_SLICE_TOKENS if device.type == "cuda" else SLICE_TOKENS


def vocab_padding(vocab: int, device: torch.device) -> int:
    """Zero rows the head's matrix gets on this device (GPU_VOCAB_MULTIPLE)."""
    return -vocab % GPU_VOCAB_MULTIPLE if device.type == "cuda" else 0


def head_matrix(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tied matrix (V, d) in the matmuls' dtype with its device's zero rows after it
    (vocab_padding): (V + pad, d); no copy beyond the dtype's where there is no padding."""
    w, pad = weight.to(dtype), vocab_padding(weight.shape[0], weight.device)
    return F.pad(w, (0, 0, 0, pad)) if pad else w


class SliceBuffers:
    """The head's two (S, V + pad) buffers (logits, softmax), kept from one call to the next on a CPU.

    torch's CPU allocator caches nothing, and glibc maps allocations over 32 MB afresh each time:
    each 51 MB buffer of a fresh call (fp32, 256 × 50,257) is new pages from the kernel, faulted in
    and zeroed as the logits' product first writes them. Kept by their owner (a training run's
    `FusedLoss`, an evaluation's scoring loop), they cost that once: the demo's GPT-2 pipeline on
    AVX2 kernels ran 12–18% faster (docs/benchmarks.md). bf16 buffers (26 MB) were already reused
    from glibc's heap. On a GPU the caching allocator reuses memory, and holding the buffers would
    only take it from the trunk's activations: there every call gets fresh ones."""

    def __init__(self):
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (rows, cols) buffers: views of the kept ones where they are large enough."""
        pair = self._pair
        if pair is None or pair[0].shape[0] < rows or pair[0].shape[1] != cols or pair[0].dtype != dtype \
                or pair[0].device != device:
            pair = tuple(torch.empty(rows, cols, dtype=dtype, device=device) for _ in range(2))
            self._pair = pair if device.type == "cpu" else None
        return pair[0][:rows], pair[1][:rows]


def slice_logits(hs: torch.Tensor, w: torch.Tensor, vocab: int, out: torch.Tensor) -> torch.Tensor:
    """hs (S, d) @ wᵀ into out (S, V + pad); the padding's columns -inf: probability 0, no gradient."""
    logits = torch.mm(hs, w.t(), out=out)
    if w.shape[0] > vocab:
        logits[:, vocab:] = float("-inf")
    return logits


class _FusedLMLoss(torch.autograd.Function):
    """Summed NLL of labels under softmax(h @ Wᵀ), slice by slice; gradients computed in forward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, slice_tokens: int | None,
                buffers: SliceBuffers | None):
        # h (N, d), weight (V, d), labels (N,) with IGNORE_INDEX for no target.
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        vocab = weight.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        # Matmuls in h's precision (bf16 under mixed precision) or autocast's (the `out=` matmuls
        # below bypass autocast, so cast here); softmax and loss in fp32. W's gradient accumulates
        # over the slices in fp32, or, where W itself is bf16 (a bf16 model, as DeepSpeed trains
        # it), in W's dtype as every other gradient of that model is made: in place, without a
        # (V, d) fp32 copy per slice.
        mm_dtype = autocast_dtype(h.device.type) or h.dtype
        acc_dtype = weight.dtype if weight.dtype == mm_dtype else torch.float32
        slice_tokens = slice_tokens or slice_tokens_for(h.device)
        # Only the rows with a target go through the head: a padding token's logits would be
        # computed and their gradient zeroed. 21% of the demo's training tokens are padding (each
        # document's last chunk is filled out to chunk_len), and the head is the busiest stage.
        has_target = labels != IGNORE_INDEX
        rows = None if bool(has_target.all()) else has_target.nonzero().squeeze(1)              # (N',)
        h_rows, labels = (h, labels) if rows is None else (h.index_select(0, rows), labels[rows])
        hm, w = h_rows.to(mm_dtype), head_matrix(weight, mm_dtype)                    # (N', d), (V + pad, d)
        grad_rows = torch.empty_like(h_rows) if want_h else None                      # (N', d)
        # Not zeroed where a first slice's product overwrites it (a pass over (V, d) less per call).
        new_grad = torch.empty_like if len(labels) else torch.zeros_like
        grad_w = new_grad(w, dtype=acc_dtype) if want_w else None
        for start, probs, target, _, nll in scored_slices(hm, w, vocab, labels, slice_tokens, buffers):
            total += nll.sum()
            if want_h or want_w:
                _slice_grads(probs, target, hm[start:start + slice_tokens], w,
                             grad_rows[start:start + slice_tokens] if want_h else None, grad_w, start > 0)
        grad_h = grad_rows
        if want_h and rows is not None:                                               # no target: 0
            grad_h = torch.zeros_like(h).index_copy_(0, rows, grad_rows)
        # W's gradient whole, not a view of itself, where there is no padding: autograd then adds a
        # second use's gradient of the tied matrix (the lookup's, in one process) into it in place,
        # not into a new (V, d) tensor, fresh pages on a CPU (docs/benchmarks.md).
        if want_w and len(grad_w) > vocab:
            grad_w = grad_w[:vocab]
        ctx.save_for_backward(grad_h, grad_w if want_w else None)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # Scaled in place where the dtype allows: no second (V, d) tensor per call. A second
        # backward through the same graph then fails autograd's check of the saved tensors.
        grad_h, grad_w = ctx.saved_tensors
        dh = grad_h.mul_(grad_output.to(grad_h.dtype)) if grad_h is not None else None          # h's dtype
        if grad_w is not None:
            dw = grad_w.mul_(grad_output) if grad_w.dtype == ctx.w_dtype else (grad_w * grad_output).to(ctx.w_dtype)
        else:
            dw = None
        return dh, dw, None, None, None


def scored_slices(hm: torch.Tensor, w: torch.Tensor, vocab: int, labels: torch.Tensor, slice_tokens: int,
                  buffers: SliceBuffers | None = None):
    """For each slice of `slice_tokens` rows of hm (N, d), in w's dtype, against w (V + pad, d):
    (start, softmax (S, V + pad), target (S,), valid (S,), NLL (S,) fp32, 0 where no target).

    Two (S, V) buffers serve all slices: the logits and their softmax (`buffers`' where given, to
    keep between calls; fresh ones otherwise). A fresh 51 MB tensor per slice costs its page
    faults every time; a row-wise softmax into a buffer reads each row once
    from cache, where logsumexp, sub_ and exp_ each streamed the whole slice. The softmax is kept
    in the matmuls' dtype (computed in fp32 inside the kernel): in bf16 it is the gradient's dtype
    anyway, and an fp32 copy of each slice cost more than the matmuls. The NLL then carries bf16's
    rounding of each target's probability (a relative 2^-8 at most, ±0.004 nats per token,
    unbiased). The softmax is the buffer: each slice's is gone once the next is yielded."""
    rows = min(slice_tokens, hm.shape[0])
    buffers = buffers if buffers is not None else SliceBuffers()
    logits_buf, probs_buf = buffers.get(rows, w.shape[0], w.dtype, hm.device)
    for start in range(0, hm.shape[0], slice_tokens):
        ys = labels[start:start + slice_tokens]
        logits = slice_logits(hm[start:start + slice_tokens], w, vocab, logits_buf[:len(ys)])     # (S, V + pad)
        probs = torch.ops.aten._softmax.out(logits, -1, False, out=probs_buf[:len(ys)])          # (S, V + pad)
        valid = ys != IGNORE_INDEX                                    # no target: 0, as cross_entropy
        target = torch.where(valid, ys, 0)
        yield start, probs, target, valid, torch.where(valid, _target_nll(logits, probs, target), 0.0)


def _target_nll(logits: torch.Tensor, probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(S,) fp32 NLL of target under probs (S, V), the softmax of logits (S, V)."""
    p_target = probs.gather(1, target[:, None]).squeeze(1).float()                # (S,)
    nll = -torch.log(p_target)
    # A probability below fp32's (and bf16's) normal range has lost its digits (or is 0): take those rows' NLL
    # exactly from their logits, lse − logit.
    lost = p_target < torch.finfo(torch.float32).tiny
    if lost.any():
        rows_lost = logits[lost].float()
        nll[lost] = torch.logsumexp(rows_lost, -1) - rows_lost.gather(1, target[lost, None]).squeeze(1)
    return nll


def _slice_grads(probs: torch.Tensor, target: torch.Tensor, hs: torch.Tensor, w: torch.Tensor,
                 grad_h: torch.Tensor | None, grad_w: torch.Tensor | None, accumulate: bool) -> None:
    """One slice's gradients of Σ nll, every row with a target: into grad_h (its rows, (S, d)) and
    into grad_w (V, d), added to what it holds with `accumulate`, written over it without.

    d(Σ nll)/d logits = softmax − one-hot, computed in place of probs, in the matmuls' dtype. Where
    a gradient is kept in another dtype (fp32 h and W under autocast) the products are converted;
    otherwise they are written and accumulated in place."""
    grad = probs
    grad[torch.arange(len(target), device=probs.device), target] -= 1.0
    if grad_h is not None:
        if grad_h.dtype == grad.dtype:
            torch.mm(grad, w, out=grad_h)
        else:
            grad_h[:] = grad @ w
    if grad_w is not None:
        if grad_w.dtype == grad.dtype:
            grad_w.addmm_(grad.t(), hs, beta=1 if accumulate else 0)    # beta 0: grad_w's content unread
        elif accumulate:
            grad_w += (grad.t() @ hs).float()
        else:
            grad_w.copy_(grad.t() @ hs)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on this device type, or None when it is off."""
    try:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except (AttributeError, TypeError):  # torch < 2.4: per-device functions
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def lm_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, slice_tokens: int | None = None,
            buffers: SliceBuffers | None = None) -> torch.Tensor:
    """Mean cross-entropy of labels (b, n) under the tied head W (V, d) applied to h (b, n, d).

    Labels are already the next tokens; IGNORE_INDEX (-100) is no target. Computed in fp32
    whatever h's dtype; a batch with no target gives 0, not NaN (as training.models.gpt2.loss_fn).
    slice_tokens: tokens per slice (None: the device's, `slice_tokens_for`); buffers: the caller's
    SliceBuffers, to keep between calls (None: fresh ones).
    """
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    total = _FusedLMLoss.apply(h2, weight, y, slice_tokens, buffers)
    return total / (y != IGNORE_INDEX).sum().clamp(min=1)


def token_nll(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, slice_tokens: int | None = None,
              buffers: SliceBuffers | None = None) -> torch.Tensor:
    """Per-token NLL (b, n) of targets under the head, without gradients, slice by slice (evaluation).

    As the training loss computes it (`scored_slices`): each slice's softmax in the matmuls' dtype,
    the NLL from the target's probability, exact from the logits where that underflows. In bf16 the
    probability carries bf16's rounding (a relative 2^-8 at most, ±0.004 nats per token, unbiased),
    less than the bf16 logits' own; in fp32 the NLL is fp32's. A log-softmax into an fp32 buffer,
    its (S, V) pass with a logarithm per element, took three times as long under bf16 and 1.1
    times in fp32 (docs/benchmarks.md).
    """
    with torch.no_grad():
        mm_dtype = autocast_dtype(h.device.type) or h.dtype      # as _FusedLMLoss
        h2, y = h.reshape(-1, h.shape[-1]).to(mm_dtype), targets.reshape(-1)
        out = torch.empty(y.shape, dtype=torch.float32, device=h.device)
        w = head_matrix(weight, mm_dtype)                           # (V + pad, d), as _FusedLMLoss
        slice_tokens = slice_tokens or slice_tokens_for(h.device)
        for start, _, _, _, nll in scored_slices(h2, w, weight.shape[0], y, slice_tokens, buffers):
            out[start:start + len(nll)] = nll
        return out.view(targets.shape)
