"""Profile one training step (forward + backward + AdamW) with the torch profiler: where the time goes.

    python bench/profile_step.py [--shapes tiny,12x384,gpt2-124m] [--kinds gpt2,retro] [--precision fp32|bf16|auto]
    # on a GPU, at the GPT-2 small shape, with a trace per profile for chrome://tracing or Perfetto:
    python bench/profile_step.py --device cuda --shapes gpt2-124m --precision bf16 --batch 8 --seq-len 1024 \
        --trace runs/traces/
    # an AVX2-only CPU's kernels on an AVX-512 machine (same ISA paths, not the same chip):
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/profile_step.py --precision fp32

The model is the layer list the pipeline runs (training/models/layers.py), with the fused LM head as
training uses it, one process on all cores; bf16 is a bf16 model, as DeepSpeed's bf16 mode trains
(`--bf16 autocast`: fp32 weights under torch.autocast). Prints, per shape and kind, the step time and the
time of each phase (trunk forward, fused head + loss, backward, optimizer) and the top operators
by self CPU time with their share of the step. On a GPU (`--device cuda`) the phases are timed with
the device synchronised after each, and operators are ranked by the GPU time of the kernels they
launch (self device time), then the kernels themselves.
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
from retropipe.training.models.registry import build_model  # noqa: E402
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


def step(model, opt, inputs, labels, autocast_dtype, device: str = "cpu", phases: dict | None = None) -> None:
    """One training step; with `phases`, the device is synchronised after each phase and its
    seconds added there (a GPU runs ahead of the host: without the sync a phase's wall time is its
    launches, not its kernels)."""
    clock = [time.perf_counter()]

    def mark(phase):
        if phases is not None:
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            phases[phase] = phases.get(phase, 0.0) + now - clock[0]
            clock[0] = now

    with torch.autocast(device, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        with record_function("trunk forward"):
            outputs = model(*inputs)
        mark("trunk forward")
        with record_function("head + loss"):
            loss = FUSED_LOSS(outputs, labels)
        mark("head + loss")
    with record_function("backward"):
        loss.backward()
    mark("backward")
    with record_function("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    mark("optimizer")


def self_time(e, device: str) -> float:
    """An event's self time in µs: on the CPU its own, on a GPU that of the kernels it launched."""
    if device == "cpu":
        return e.self_cpu_time_total
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)


def named_range(e) -> bool:
    """A named range (the phases, the optimizer's own), not an operator or a kernel. On a GPU its
    device time spans the kernels inside it, counted themselves; on the CPU its self time is the
    host's own work in it (the optimizer's Python), so only the phases are left out there."""
    return e.key in PHASES or bool(getattr(e, "is_user_annotation", False)) or e.key.startswith("Optimizer.")


def profile_one(shape: str, kind: str, precision: str, bf16: str, batch: int, seq_len: int, top: int,
                device: str = "cpu", trace: Path | None = None) -> None:
    cfg = (ModelConfig(kind=kind, chunk_len=64, **SHAPES[shape]) if shape in SHAPES
           else ModelConfig.preset(shape, kind=kind, chunk_len=64))
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    as_weights = dtype != torch.float32 and bf16 == "weights"
    model = build_model(cfg, fused_head=True).train().to(device, dtype if as_weights else torch.float32)
    autocast = dtype if dtype != torch.float32 and not as_weights else None
    # DeepSpeed's ZeRO-1 updates one flat fp32 buffer per parameter group, a few passes over one
    # big tensor; torch's per-tensor AdamW on CPU (foreach falls back to a loop there) would be
    # 25% of a tiny step that training never pays. The fused kernel is the closest stand-in.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs, labels = batch_for(cfg, batch, seq_len, 2, torch.Generator().manual_seed(0))
    inputs, labels = tuple(x.to(device) for x in inputs), labels.to(device)
    for _ in range(3):  # warm-up: allocator, oneDNN primitive caches, cuBLAS and SDPA kernel choice
        step(model, opt, inputs, labels, autocast, device)
    plain = float("inf")
    for _ in range(3 if device == "cuda" else 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, opt, inputs, labels, autocast, device)
        if device == "cuda":
            torch.cuda.synchronize()
        plain = min(plain, time.perf_counter() - t0)
    phases: dict = {}
    step(model, opt, inputs, labels, autocast, device, phases)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step(model, opt, inputs, labels, autocast, device)
        if device == "cuda":
            torch.cuda.synchronize()
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"{shape}_{kind}_{precision}.json"))
    averages = prof.key_averages()
    unit = "CPU" if device == "cpu" else "GPU"
    # Operators (host-side events): a GPU kernel's time is counted once, at the operator that launched it.
    events = [e for e in averages if self_time(e, device) > 0 and e.device_type == torch.autograd.DeviceType.CPU
              and not (e.key in PHASES if device == "cpu" else named_range(e))]
    total = sum(self_time(e, device) for e in events)
    events.sort(key=lambda e: -self_time(e, device))
    wall = sum(phases.values())
    calls = sum(e.count for e in averages if e.device_type == torch.autograd.DeviceType.CPU
                and not named_range(e))   # every operator the host dispatched, views included
    print(f"\n## {shape} {kind}, {precision}, batch {batch} × {seq_len} tokens on {device}: step "
          f"{plain * 1e3:.1f} ms unprofiled ({batch * seq_len / plain:,.0f} tokens/s); profiled self {unit} "
          f"{total / 1e3:.1f} ms; {calls:,} operator calls")
    print("phases: " + ", ".join(f"{p} {phases.get(p, 0) * 1e3:.1f} ms ({phases.get(p, 0) / wall:.0%})"
                                 for p in PHASES))
    print(f"{'operator':<48} {'self ms':>9} {'share':>7} {'calls':>6}")
    for e in events[:top]:
        print(f"{e.key[:48]:<48} {self_time(e, device) / 1e3:>9.2f} {self_time(e, device) / total:>7.1%} {e.count:>6}")
    if device == "cuda":
        kernels = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA
                          and not named_range(e)), key=lambda e: -self_time(e, device))
        print(f"{len(kernels)} kernel names, {sum(e.count for e in kernels)} launches (memsets and copies included)")
        print(f"{'kernel':<72} {'ms':>7} {'share':>7} {'calls':>6}")
        for e in kernels[:top]:
            ms = self_time(e, device) / 1e3
            print(f"{e.key[:72]:<72} {ms:>7.2f} {ms * 1e3 / total:>7.1%} {e.count:>6}")


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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--trace", type=Path, default=None, help="a folder for one chrome trace per profile")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU")
    precision = args.precision if args.device == "cpu" or args.precision != "auto" else "bf16"
    precision = resolve_precision(precision)
    print(describe())
    print(" ".join(f"{k}={os.environ.get(k, '(default)')}" for k in HELD_KERNEL_VARIABLES) + "; "
          f"{torch.get_num_threads()} threads; torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for shape in args.shapes.split(","):
        for kind in args.kinds.split(","):
            profile_one(shape, kind, precision, args.bf16, args.batch, args.seq_len, args.top, args.device, args.trace)
    return 0


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)
    sys.exit(main())
