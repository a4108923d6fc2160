"""Profile one training step (forward + backward + AdamW) with the torch profiler: where the time goes.

    python bench/profile_step.py [--shapes tiny,12x384,gpt2-124m] [--kinds gpt2,retro] [--precision fp32|bf16|auto]
    # an AVX2-only CPU's kernels on an AVX-512 machine (same ISA paths, not the same chip):
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/profile_step.py --precision fp32

The model is the layer list the pipeline runs (training/models/layers.py), with the fused LM head as
training uses it, one process on all cores; bf16 is a bf16 model, as DeepSpeed's bf16 mode trains
(`--bf16 autocast`: fp32 weights under torch.autocast). Prints, per shape and kind, the step time and the
time of each phase (trunk forward, fused head + loss, backward, optimizer) and the top operators
by self CPU time with their share of the step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from retropipe.data.cpu import HELD_KERNEL_VARIABLES  # noqa: E402
from retropipe.training.models.build import build_model  # noqa: E402
from retropipe.training.models.config import ModelConfig  # noqa: E402
from retropipe.training.models.gpt2 import FusedLoss  # noqa: E402
from retropipe.training.run.hardware import describe, resolve_precision  # noqa: E402

# Shapes: "tiny" is the demo's model (configs/tiny.yaml), 12x384 the balanced pipeline benchmark's.
SHAPES = {"tiny": dict(n_layer=4, n_head=4, n_embd=128, n_positions=256, encoder_layers=2, encoder_embd=64,
                       encoder_head=2),
          "12x384": dict(n_layer=12, n_head=6, n_embd=384, n_positions=256, encoder_layers=2, encoder_embd=192,
                         encoder_head=3)}

def batch_for(cfg: ModelConfig, batch: int, seq_len: int, k: int, g: torch.Generator):
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if cfg.kind == "gpt2":
        return (x,), y
    l = seq_len // cfg.chunk_len
    neighbours = torch.randint(0, cfg.vocab_size, (batch, l, k, 2 * cfg.chunk_len), generator=g)  # (b, l, k, r)
    return (x, neighbours), y


# The fused head computes its gradients in its forward (training/models/lm_head.py), so "head + loss"
# is the whole head, forward and backward; "backward" is the trunk's (and the encoder's).
PHASES = ("trunk forward", "head + loss", "backward", "optimizer")
# As a training run keeps it: one fused loss, its head buffers kept from step to step.
FUSED_LOSS = FusedLoss()


def step(model, opt, inputs, labels, autocast_dtype) -> None:
    with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        with record_function("trunk forward"):
            outputs = model(*inputs)
        with record_function("head + loss"):
            loss = FUSED_LOSS(outputs, labels)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def profile_one(shape: str, kind: str, precision: str, bf16: str, batch: int, seq_len: int, top: int) -> None:
    cfg = (ModelConfig(kind=kind, chunk_len=64, **SHAPES[shape]) if shape in SHAPES
           else ModelConfig.preset(shape, kind=kind, chunk_len=64))
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    as_weights = dtype != torch.float32 and bf16 == "weights"
    model = build_model(cfg, fused_head=True).train().to(dtype if as_weights else torch.float32)
    autocast = dtype if dtype != torch.float32 and not as_weights else None
    # DeepSpeed's ZeRO-1 updates one flat fp32 buffer per parameter group, a few passes over one
    # big tensor; torch's per-tensor AdamW on CPU (foreach falls back to a loop there) would be
    # 25% of a tiny step that training never pays. The fused kernel is the closest stand-in.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs, labels = batch_for(cfg, batch, seq_len, 2, torch.Generator().manual_seed(0))
    for _ in range(2):  # warm-up: allocator, oneDNN primitive caches
        step(model, opt, inputs, labels, autocast)
    t0 = time.perf_counter()
    step(model, opt, inputs, labels, autocast)
    plain = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, opt, inputs, labels, autocast)
    averages = prof.key_averages()
    phases = {e.key: e.cpu_time_total for e in averages if e.key in PHASES}
    events = [e for e in averages if e.self_cpu_time_total > 0 and e.key not in PHASES]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    print(f"\n## {shape} {kind}, {precision}, batch {batch} × {seq_len} tokens: step {plain * 1e3:.0f} ms "
          f"unprofiled ({batch * seq_len / plain:,.0f} tokens/s); profiled self CPU {total / 1e3:.0f} ms")
    wall = sum(phases.values())
    print("phases: " + ", ".join(f"{p} {phases.get(p, 0) / 1e3:.0f} ms ({phases.get(p, 0) / wall:.0%})" for p in PHASES))
    print(f"{'operator':<48} {'self ms':>9} {'share':>7} {'calls':>6}")
    for e in events[:top]:
        print(f"{e.key[:48]:<48} {e.self_cpu_time_total / 1e3:>9.1f} {e.self_cpu_time_total / total:>7.1%} {e.count:>6}")



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,12x384", help=f"subset of {','.join(SHAPES)} or a model preset")
    parser.add_argument("--kinds", default="gpt2,retro")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--bf16", default="weights", choices=["weights", "autocast"],
                        help="bf16 as DeepSpeed trains (a bf16 model) or fp32 weights under autocast")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (the demo's micro-batch)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top", type=int, default=12, help="operators listed per profile")
    args = parser.parse_args(argv)
    precision = resolve_precision(args.precision)
    print(describe())
    print(" ".join(f"{k}={os.environ.get(k, '(default)')}" for k in HELD_KERNEL_VARIABLES) + "; "
          f"{torch.get_num_threads()} threads; torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for shape in args.shapes.split(","):
        for kind in args.kinds.split(","):
            profile_one(shape, kind, precision, args.bf16, args.batch, args.seq_len, args.top)
    return 0


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)
    sys.exit(main())
