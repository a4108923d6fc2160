"""Benchmark generation: tokens/s with and without the key/value cache, side by side in one run.

    python bench/generate.py [--preset tiny] [--kinds gpt2,retro] [--prompt 64] [--new 192] [--chunk-len 64]
                             [--samples 1] [--repeat 3] [--threads N] [--device auto|cpu|cuda]

Randomly initialised models of a preset (GPT-2 and its RETRO twin, chunk_len 64, k = 2
neighbours), greedy decoding of --new tokens after a --prompt-token prompt, --samples sequences
per batch (training/evaluation/sampling.py `generate_samples`). RETRO's neighbours come from a stub that
returns fixed random ids (no embedder, no FAISS): the figures are the model's, not retrieval's.
With and without the cache alternate --repeat times, so machine noise hits both; the best time of
each is printed with tokens/s (new tokens over wall time, prompt included) and the ratio, and the
two runs are checked to give the same tokens. Keep prompt + new within n_positions (1024 for the
presets) to measure the cache; beyond it the GPT-2 cache refills at every step (sampling.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset (training/models/config.py MODEL_PRESETS)")
    parser.add_argument("--kinds", default="gpt2,retro", help="comma-separated model kinds")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new", type=int, default=192, help="new tokens per sequence")
    parser.add_argument("--chunk-len", type=int, default=64, help="RETRO chunk length")
    parser.add_argument("--samples", type=int, default=1, help="sequences per batch (--num-samples)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each variant (the best counts)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from retropipe.launch.cli import resolve_device
    from retropipe.training.evaluation.sampling import generate_samples
    from retropipe.training.models.registry import build_model
    from retropipe.training.models.config import ModelConfig
    from retropipe.training.run.hardware import describe

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    print(describe())
    print(f"device {device}, {torch.get_num_threads()} threads; preset {args.preset}, prompt {args.prompt} + "
          f"{args.new} new tokens, batch {args.samples}, greedy, best of {args.repeat}\n")
    print(f"{'model':<6} {'params':>12}  {'no cache s':>10} {'tokens/s':>9}  {'cache s':>8} {'tokens/s':>9}  "
          f"{'speed-up':>8}  same tokens")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50257, args.prompt).tolist()
    neighbours = rng.integers(0, 50257, (2, 2 * args.chunk_len))
    for kind in args.kinds.split(","):
        torch.manual_seed(0)
        cfg = ModelConfig.preset(args.preset, kind=kind, chunk_len=args.chunk_len)
        model = build_model(cfg).to(device).eval()
        retrieve = (lambda tokens, u: neighbours) if kind == "retro" else None
        best, tokens = {True: float("inf"), False: float("inf")}, {}
        generate_samples(model, prompt, 4, args.samples, temperature=0, retrieve=retrieve)  # warm-up
        for _ in range(args.repeat):
            for cache in (False, True):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = generate_samples(model, prompt, args.new, args.samples, temperature=0, retrieve=retrieve,
                                        cache=cache)
                if device == "cuda":
                    torch.cuda.synchronize()
                best[cache] = min(best[cache], time.perf_counter() - t0)
                tokens[cache] = [o.tokens for o in outs]
        new = args.new * args.samples
        print(f"{kind:<6} {model.num_parameters():>12,}  {best[False]:>10.2f} {new / best[False]:>9.1f}  "
              f"{best[True]:>8.2f} {new / best[True]:>9.1f}  {best[False] / best[True]:>7.2f}x  "
              f"{'yes' if tokens[True] == tokens[False] else 'NO'}")


if __name__ == "__main__":
    main()
