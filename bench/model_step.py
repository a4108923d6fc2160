"""Benchmark a model training step (forward + backward): GPT-2 vs RETRO, fp32 vs bf16, and MFU.

    python bench/model_step.py [--quick] [--device cpu|cuda] [--presets tiny,gpt2-124m] [--seq-len N]
                               [--batch B] [--dtypes fp32,bf16] [--compile none|blocks|model]

Prints, measured side by side in one run, for each preset and precision: tokens/s of the
GPT-2 baseline and of RETRO on the same trunk (k = 2 neighbours of 2 · chunk_len tokens per
chunk), their step-time ratio beside their ratio of forward FLOPs (`model_flops`: the blocks,
RETRO's CCAs and encoder, the head; goal: step ratio ≤ 1.05 × FLOP ratio), and model FLOP utilisation:
nanoGPT's estimate_mfu, 6N + 12·L·H·Q·T FLOPs per token (N = parameters without positions),
against the matmul FLOP/s measured in the same run by timing a big matmul in the same dtype, and
against GPT-2's own matmul shapes at this batch timed alone (the step's ceiling).
Steps run as training runs them: the fused LM head (train.fused_head, the default) and, for
bf16, a bf16 model (DeepSpeed's bf16 mode keeps the weights in bf16 and the fp32 master copy in
its optimizer); `--bf16 autocast` measures fp32 weights under torch.autocast instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

from retropipe.training.models.registry import build_model  # noqa: E402
from retropipe.training.models.config import ModelConfig  # noqa: E402
from retropipe.training.models.flops import flops_per_token, mfu  # noqa: E402
from retropipe.training.models.gpt2 import FusedLoss, block_flops  # noqa: E402
from retropipe.training.models.retro import retrieval_flops  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_flops(cfg: ModelConfig, n: int, k: int) -> float:
    """Forward FLOPs of a sequence of n tokens: every block, RETRO's retrieval path in its CCA
    layers (the first holding the encoder; k neighbours a chunk), and the head (2·n·V·d)."""
    cca = cfg.cca_blocks() if cfg.retrieves else []
    return (cfg.n_layer * block_flops(cfg, n) + 2 * n * cfg.vocab_size * cfg.n_embd
            + sum(retrieval_flops(cfg, n, k, i == cca[0]) for i in cca))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_flops(device: str, dtype: torch.dtype, size: int, reps: int) -> float:
    """Best achieved FLOP/s of a size×size matmul: the denominator of the MFU, measured as the
    training log measures it (training/run/hardware.py), for about `reps` products."""
    from retropipe.training.run.hardware import matmul_flops_per_s

    a = torch.randn(size, size, device=device, dtype=dtype)
    sync(device)
    t0 = time.perf_counter()
    a @ a
    sync(device)
    return matmul_flops_per_s(dtype, device, size, seconds=reps * (time.perf_counter() - t0))


def model_matmul_flops(cfg, tokens: int, device: str, dtype: torch.dtype, reps: int = 3) -> float:
    """FLOP/s of GPT-2's own matmuls at this batch, timed alone (best of reps): each block's four
    linear layers (q/k/v, attention output, MLP in and out) and the LM head in the device's slices
    (lm_head.slice_tokens_for) against its vocabulary as padded there, each forward and both
    backward products. The ceiling a step of this shape can reach with every other operation free:
    the 2048² peak overstates it where a dimension is as small as n_embd."""
    from retropipe.training.models.lm_head import slice_tokens_for, vocab_padding

    d, vocab = cfg.n_embd, cfg.vocab_size + vocab_padding(cfg.vocab_size, torch.device(device))
    slice_tokens = slice_tokens_for(torch.device(device))
    products = [(tokens, i, o) for i, o in ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d))]   # (rows, in, out)
    weights = {(i, o): torch.randn(i, o, device=device, dtype=dtype) for _, i, o in products}
    xs = {i: torch.randn(tokens, i, device=device, dtype=dtype) for _, i, _ in products}
    gs = {o: torch.randn(tokens, o, device=device, dtype=dtype) for _, _, o in products}
    head_w = torch.randn(vocab, d, device=device, dtype=dtype)
    head_h = torch.randn(min(slice_tokens, tokens), d, device=device, dtype=dtype)
    head_g = torch.randn(min(slice_tokens, tokens), vocab, device=device, dtype=dtype)
    slices = [min(slice_tokens, tokens - s) for s in range(0, tokens, slice_tokens)]  # rows per head slice

    def run():
        for _ in range(cfg.n_layer):
            for _, i, o in products:
                xs[i] @ weights[(i, o)], gs[o] @ weights[(i, o)].t(), xs[i].t() @ gs[o]
        for rows in slices:
            head_h[:rows] @ head_w.t(), head_g[:rows] @ head_w, head_g[:rows].t() @ head_h[:rows]
    flops = 6 * tokens * (cfg.n_layer * sum(i * o for _, i, o in products) + d * vocab)
    run()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return flops / best


# As a training run keeps it: one fused loss, its head buffers kept from step to step.
FUSED_LOSS = FusedLoss()


def one_step(model, batch, device: str, autocast_dtype: torch.dtype | None) -> float:
    """Seconds of one forward + backward (no optimizer step)."""
    sync(device)
    t0 = time.perf_counter()
    with torch.autocast(device, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        loss = FUSED_LOSS(model(*batch[:-1]), batch[-1])
    loss.backward()
    sync(device)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def step_times(runs: dict, device: str, autocast_dtype: torch.dtype | None, warmup: int, iters: int) -> dict:
    """Best step time per model, the models' steps interleaved so that a noisy neighbour on a
    shared machine slows both alike; the minimum is the least disturbed run."""
    best = {name: float("inf") for name in runs}
    for i in range(warmup + iters):
        for name, (model, batch) in runs.items():
            t = one_step(model.train(), batch, device, autocast_dtype)
            if i >= warmup:
                best[name] = min(best[name], t)
    return best


def compiled(model, how: str):
    """model with its forward through torch.compile: "blocks" each block alone, in place (as
    DeepSpeed's PipelineModule.compile does a stage's layers), "model" the whole; "none" as it is."""
    if how == "blocks":
        for block in model.blocks:
            block.compile()          # in place, once; a later dtype recompiles
    return torch.compile(model) if how == "model" else model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter sequences and fewer iterations")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--presets", default="tiny,gpt2-124m")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: per preset)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256, quick 128)")
    parser.add_argument("--chunk-len", type=int, default=64)
    parser.add_argument("--neighbours", type=int, default=2)
    parser.add_argument("--dtypes", default="fp32,bf16", help="subset of fp32,bf16")
    parser.add_argument("--bf16", default="weights", choices=["weights", "autocast"],
                        help="bf16 as DeepSpeed trains (a bf16 model, the default) or fp32 weights under autocast")
    parser.add_argument("--compile", default="none", choices=["none", "blocks", "model"],
                        help="torch.compile each block (as a pipeline stage would) or the whole forward; the "
                             "fused head stays as training runs it")
    args = parser.parse_args(argv)
    device, cuda = args.device, args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU")
    seq_len = args.seq_len or (1024 if cuda else (128 if args.quick else 256))
    warmup, iters = (1, 2) if args.quick else (1, 4 if not cuda else 10)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}; seq_len {seq_len}, chunk_len {args.chunk_len}, "
          f"k {args.neighbours}; bf16 as {args.bf16}; torch.compile: {args.compile}; "
          f"best of {iters} steps after {warmup} warm-up")
    dtypes = {label: DTYPES[label] for label in args.dtypes.split(",")}
    peak = {label: 0.0 for label in dtypes}

    def measure_peak():
        # Re-measured beside every model measurement, keeping the best: on a shared machine a
        # single early measurement may be slowed by a neighbour and inflate every MFU.
        for label, dtype in dtypes.items():
            peak[label] = max(peak[label], matmul_flops(device, dtype, 8192 if cuda else 2048, 20 if cuda else 5))

    rows, shapes_peak = [], {}
    for preset in args.presets.split(","):
        batch_size = args.batch or ({"tiny": 4}.get(preset, 1) * (8 if cuda else 1))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 50257, (batch_size, seq_len + 1), generator=g)
        l = seq_len // args.chunk_len
        neighbours = torch.randint(0, 50257, (batch_size, l, args.neighbours, 2 * args.chunk_len), generator=g)
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        models = {}
        for kind in ("gpt2", "retro"):
            cfg = ModelConfig.preset(preset, kind=kind, chunk_len=args.chunk_len)
            models[kind] = (cfg, build_model(cfg, fused_head=True).to(device))
        for label, dtype in dtypes.items():
            measure_peak()
            shapes_peak[(preset, label)] = model_matmul_flops(models["gpt2"][0], batch_size * seq_len, device, dtype)
            as_weights = dtype != torch.float32 and args.bf16 == "weights"
            runs = {kind: (compiled(model.to(dtype if as_weights else torch.float32), args.compile),
                           (x, y) if kind == "gpt2" else (x, neighbours.to(device), y))
                    for kind, (cfg, model) in models.items()}
            autocast = dtype if dtype != torch.float32 and not as_weights else None
            best = step_times(runs, device, autocast, warmup, iters)
            flop_ratio = (model_flops(models["retro"][0], seq_len, args.neighbours)
                          / model_flops(models["gpt2"][0], seq_len, args.neighbours))
            for kind, (cfg, model) in models.items():
                n = sum(p.numel() for p in model.parameters())
                fpt = flops_per_token(cfg, seq_len)
                rows.append((preset, label, kind, n, batch_size, best[kind], best[kind] / best["gpt2"], fpt,
                             fpt - 12 * cfg.n_layer * cfg.n_embd * seq_len, flop_ratio))   # 6N: without attention
                print(f"  measured {preset} {label} {kind}: {best[kind]:.3f} s/step", flush=True)
        del models
    measure_peak()
    for label in dtypes:
        print(f"matmul {label}: {peak[label] / 1e9:,.1f} GFLOP/s (best in this run)")
    for (preset, label), flops in shapes_peak.items():
        print(f"matmul {label}, {preset} GPT-2's own shapes: {flops / 1e9:,.1f} GFLOP/s "
              f"({flops / peak[label]:.0%} of the {label} peak)")
    print("MFU: against the big matmul's peak. matmuls: the share of GPT-2's step its linear layers and head "
          "(6N FLOPs per token) take at the speed of its own shapes timed alone; the rest is attention and "
          "everything not a matmul")
    print(f"\n{'preset':<11} {'dtype':<5} {'model':<6} {'params':>12} {'batch':>5} {'step s':>8} "
          f"{'tokens/s':>10} {'MFU':>6} {'matmuls':>8} {'RETRO/base':>10} {'FLOPs':>6} {'÷ FLOPs':>8}")
    for preset, label, kind, n, batch_size, t, ratio, fpt, matmul_fpt, flop_ratio in rows:
        tps = batch_size * seq_len / t
        share = f"{mfu(matmul_fpt, tps, shapes_peak[(preset, label)]):.1%}" if kind == "gpt2" else ""
        print(f"{preset:<11} {label:<5} {kind:<6} {n:>12,} {batch_size:>5} {t:>8.3f} {tps:>10,.0f} "
              f"{mfu(fpt, tps, peak[label]):>6.1%} {share:>8} {f'{ratio:.2f}x' if kind == 'retro' else '':>10}"
              + (f" {flop_ratio:>5.2f}x {ratio / flop_ratio:>7.2f}x" if kind == "retro" else ""))
    return 0


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)
    sys.exit(main())
