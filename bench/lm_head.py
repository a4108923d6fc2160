"""Benchmark the LM head + cross-entropy: the plain path (all logits at once) vs the fused, sliced one,
with its slice buffers fresh each call ("fused") or kept from call to call ("kept", as training runs it).

    python bench/lm_head.py [--tokens 1024] [--d 128] [--repeat 3] [--slice 256] [--precision fp32|bf16]
                            [--no-target 0.21]

One micro-batch of the demo's shape (4 × 256 tokens, width 128, GPT-2's 50,257-way tied head),
forward + backward with respect to h and the tied matrix, fp32 (or a bf16 h and matrix, as
DeepSpeed's bf16 mode trains), with a share of the tokens padding (no target) as the demo's
training batches have (21% of their tokens, in 87% of their sequences). Each variant runs in a fresh
process (so peak RSS is its own) and variants alternate `--repeat` times so machine noise hits
both; the best time and the peak-RSS growth over the process's baseline are printed, with
their ratios. The fused path computes the same loss and gradients (tests/training/test_model.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 50257


def worker(args) -> None:
    import torch

    from retropipe.training.models.gpt2 import loss_fn
    from retropipe.training.models.lm_head import SliceBuffers, lm_loss

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    h = torch.randn(1, args.tokens, args.d, dtype=dtype, requires_grad=True)
    w = (torch.randn(VOCAB, args.d) * 0.02).to(dtype).requires_grad_()
    buffers = SliceBuffers() if args.worker == "kept" else None
    labels = torch.randint(0, VOCAB, (1, args.tokens))
    labels[torch.rand(labels.shape) < args.no_target] = -100     # padding: no target, as in the demo's batches
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    best = float("inf")
    for _ in range(args.steps):
        t0 = time.perf_counter()
        if args.worker in ("fused", "kept"):
            loss = lm_loss(h, w, labels, slice_tokens=args.slice, buffers=buffers)
        else:
            loss = loss_fn(h @ w.t(), labels)
        loss.backward()
        best = min(best, time.perf_counter() - t0)
        h.grad = w.grad = None
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print("RESULT " + json.dumps({"seconds": best, "peak_rss_growth_mb": grown / 1024}), flush=True)


def run(variant: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", variant], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch (4 × 256 in the demo)")
    parser.add_argument("--d", type=int, default=128, help="model width")
    parser.add_argument("--slice", type=int, default=256, help="tokens per slice of the fused path")
    parser.add_argument("--steps", type=int, default=4, help="timed forward+backward passes per process")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--no-target", type=float, default=0.21,
                        help="share of tokens without a target (padding; the demo's training batches: 21%%)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from retropipe.training.run.hardware import describe

    print(describe())
    print(f"{args.tokens} tokens × width {args.d} → {VOCAB:,} logits; {args.precision}; {os.cpu_count()} threads; "
          f"fused slices of {args.slice} tokens; {args.no_target:.0%} without a target")
    results = {"plain": [], "fused": [], "kept": []}
    for _ in range(args.repeat):
        for variant in results:
            results[variant].append(run(variant))
    best = {v: (min(r["seconds"] for r in rs), max(r["peak_rss_growth_mb"] for r in rs)) for v, rs in results.items()}
    for v, (s, mb) in best.items():
        print(f"{v:<6} {s * 1000:8.1f} ms   peak RSS growth {mb:7.1f} MB")
    (ps, pm), (fs, fm) = best["plain"], best["fused"]
    print(f"fused / plain: time {fs / ps:.2f}×, peak memory growth {fm / max(pm, 1e-9):.2f}×")
    print(f"kept / fused (the slice buffers kept between calls): time {best['kept'][0] / fs:.2f}×")


if __name__ == "__main__":
    main()
