"""How fast a two-node training job ends when one of its ranks is killed, stopped or preempted.

    python bench/fault_exit.py [--runs 10] [--timeout 10] [--faults KILL:3,STOP:2,STOP:0,TERM:1]

Two DeepSpeed launchers on this machine stand for two nodes (2 ranks each, world 4, tiny GPT-2,
fp32), started as on a cluster without ssh (docs/cluster.md). Once training is under way the
victim rank gets the signal; the figure is the time until every other process of both nodes,
launchers included, has exited. Prints, per fault, the times (min / median / max), how many runs
ended within train.dist_timeout + 30 s (TERM, a preemption: within train.preempt_grace, 60 s), and
how many ended right: every line names the lost rank; for TERM, both launchers exit 75, the
newest checkpoint is the last step trained, and each node says to resume from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.distributed: the launch helpers the tests use

from retropipe.data.prepare import prepare  # noqa: E402
from retropipe.launch.config import load_config  # noqa: E402
from retropipe.training.run.hardware import describe  # noqa: E402
from tests.distributed import kill, launch_nodes, rank_pids  # noqa: E402

TINY = ["data.chunk_len=16", "data.max_documents=100", "train.seq_len=64", "model.n_layer=2", "model.n_head=2",
        "model.n_embd=32", "model.n_positions=64", "train.micro_batch_size=1", "train.micro_batches=2",
        "train.steps=100000", "train.precision=fp32", "train.eval_every=0", "train.checkpoint_every=100000",
        "eval.window=64", "eval.stride=32"]


def one_run(workdir: Path, sig: signal.Signals, victim: int, timeout: float, n: int) -> tuple[float, bool]:
    name = f"fault-{sig.name}-{victim}-{n}"
    sets = [a for o in [f"workdir={workdir}", f"train.name={name}", f"train.dist_timeout={timeout}", *TINY]
            for a in ("--set", o)]
    procs = launch_nodes(2, 2, ["--config", "configs/tiny-gpt2.yaml", "--no-progress", *sets], workdir / f"logs-{name}")
    metrics = workdir / "runs" / name / "metrics.jsonl"
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the job ended before the fault: see {workdir / f'logs-{name}'}")
            time.sleep(0.2)
        ranks = rank_pids(f"train.name={name}")
        os.kill(ranks[victim], sig)
        begun = time.time()
        others = [pid for rank, pid in ranks.items() if rank != victim]
        while any(p.poll() is None for p in procs) or any(os.path.exists(f"/proc/{pid}") for pid in others):
            time.sleep(0.1)
            if time.time() - begun > timeout + 300:
                break
        took = time.time() - begun
    finally:
        kill(procs)
        if sig == signal.SIGSTOP and os.path.exists(f"/proc/{ranks[victim]}"):
            os.kill(ranks[victim], signal.SIGKILL)
    log = "".join((workdir / f"logs-{name}" / f"node{i}.log").read_text() for i in (0, 1))
    if sig == signal.SIGTERM:
        return took, preempted_right(workdir / "runs" / name, log, [p.returncode for p in procs])
    lines = re.findall(r"train: error: lost rank (\d+) ", log)
    return took, len(lines) == 3 and all(int(r) == victim for r in lines)


def preempted_right(run_dir: Path, log: str, codes: list[int]) -> bool:
    """Both launchers exited 75, the newest checkpoint is the last step trained, each node says so."""
    latest = run_dir / "checkpoints" / "latest.json"
    if codes != [75, 75] or not latest.exists():
        return False
    step = json.loads(latest.read_text())["step"]
    trained = len((run_dir / "metrics.jsonl").read_text().splitlines())
    return trained == step and len(re.findall(rf"train: preempted \(SIGTERM\) after step {step}; .*"
                                              rf"resume from step {step} ", log)) == 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=10.0, help="train.dist_timeout")
    parser.add_argument("--faults", default="KILL:3,STOP:2,STOP:0,TERM:1", help="SIGNAL:RANK,...")
    args = parser.parse_args()
    print(describe())
    with tempfile.TemporaryDirectory(prefix="fault-exit-") as tmp:
        workdir = Path(tmp)
        cfg = load_config(ROOT / "configs" / "tiny-gpt2.yaml", [f"workdir={workdir}", *TINY])
        prepare(cfg.data, cfg.data_dir, progress=False)
        print(f"{'fault':<14}{'runs':>5}{'min s':>8}{'median s':>10}{'max s':>8}{'within bound':>19}"
              f"{'ended right':>13}")
        for fault in args.faults.split(","):
            sig_name, victim = fault.split(":")
            sig = getattr(signal, f"SIG{sig_name}")
            results = [one_run(workdir, sig, int(victim), args.timeout, n) for n in range(args.runs)]
            times = [t for t, _ in results]
            bound = 60 if sig == signal.SIGTERM else args.timeout + 30
            print(f"{sig.name + ' rank ' + victim:<14}{len(times):>5}{min(times):>8.1f}{statistics.median(times):>10.1f}"
                  f"{max(times):>8.1f}{sum(t < bound for t in times):>16}/{len(times)}"
                  f"{sum(ok for _, ok in results):>10}/{len(times)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
