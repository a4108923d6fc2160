"""Benchmark a short training run's start-up: launch/train.py as it ships against the same with
`gc.freeze()` turned into a no-op, side by side.

    python bench/startup/train_startup.py [--rounds 3] [--precisions bf16,fp32] [--workdir runs/bench_startup]

Each run trains a small GPT-2 (2 layers × 32) for 2 steps on 2 processes over gloo, 2 pipeline
stages, ranks spawned as tests/distributed.py spawns them (no launcher): almost all of its time is
importing torch and DeepSpeed, building the engine and writing the model, the fixed cost every
training test and each of the demo's training stages pays. Variants alternate, round by round, so
machine noise hits both (each first in every other round). Prints each run's wall and CPU seconds
(ranks together), then per precision the medians and their ratio. The data: the shipped corpus's
first 100 documents.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SMALL = ["data.max_documents=100", "data.chunk_len=16", "train.seq_len=64", "model.n_layer=2", "model.n_head=2",
         "model.n_embd=32", "model.n_positions=64", "train.micro_batch_size=1", "train.micro_batches=2",
         "train.steps=2", "train.eval_every=0", "train.checkpoint_every=2", "train.pipeline_stages=2",
         "eval.window=64", "eval.stride=32"]
# Runs launch/train.py with gc.freeze a no-op: the "without" variant.
NO_FREEZE = "import gc, runpy, sys; gc.freeze = lambda: None; sys.argv[0] = 'launch/train.py'; " \
            "runpy.run_path('launch/train.py', run_name='__main__')"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(workdir: Path, name: str, precision: str, freeze: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one 2-rank run (CPU: both ranks, user + system)."""
    sets = [a for o in [*SMALL, f"workdir={workdir}", f"train.name={name}", f"train.precision={precision}"]
            for a in ("--set", o)]
    head = ["launch/train.py"] if freeze else ["-c", NO_FREEZE]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    logs = [workdir / "logs" / f"{name}-rank{r}.log" for r in range(2)]
    logs[0].parent.mkdir(parents=True, exist_ok=True)
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    procs = [subprocess.Popen([sys.executable, *head, "--config", "configs/tiny-gpt2.yaml", "--no-progress", *sets],
                              cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=open(logs[r], "w"), stderr=subprocess.STDOUT) for r in range(2)]
    codes = [p.wait() for p in procs]
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if any(codes):
        raise SystemExit(f"train_startup: {name} failed:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--workdir", default="runs/bench_startup")
    args = ap.parse_args(argv)
    from retropipe.data.prepare import prepare
    from retropipe.launch.config import load_config

    workdir = (ROOT / args.workdir).resolve()
    cfg = load_config(ROOT / "configs" / "tiny-gpt2.yaml", [f"workdir={workdir}", *SMALL])
    prepare(cfg.data, cfg.data_dir, progress=False)
    stamp = time.strftime("%H%M%S")
    for precision in args.precisions.split(","):
        times = {True: [], False: []}
        for r in range(args.rounds):
            for freeze in ((False, True), (True, False))[r % 2]:  # each variant first in every other round
                wall, cpu = run(workdir, f"{stamp}-{precision}-{r}-{int(freeze)}", precision, freeze)
                times[freeze].append(wall)
                print(f"{precision} round {r} {'gc.freeze' if freeze else 'no freeze':9s}  wall {wall:5.2f} s  "
                      f"cpu {cpu:5.2f} s", flush=True)
        before, after = statistics.median(times[False]), statistics.median(times[True])
        print(f"{precision}: median wall {before:.2f} s without gc.freeze, {after:.2f} s with: {after / before:.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
