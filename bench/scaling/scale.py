"""How every stage's cost grows with its work: time and peak memory at 4 sizes, fitted.

    python bench/scaling/scale.py --quick       # each stage at 4 sizes spanning 8×: ≤ 6 minutes on 2 cores
    python bench/scaling/scale.py [--full]      # larger sizes, for bigger machines
    python bench/scaling/scale.py --quick --stages index,neighbours --factory 'IVF{K}_HNSW32,PQ32' --threads 1

The product's own code, in-process (no Ray), fitted against what each stage's size counts:
prepare (data/prepare.py; chunks written) over the shipped corpus replicated r times, replica i's
documents renamed `<id>#i` and prefixed "(i) " (distinct documents); embed (embed_job.py
`embed_stores`, serial runner, `embed_precision: auto`; chunks) over the corpus's first documents
(replicas would be copies, which a build does not embed); index (index.py `build_index`: train, add,
on-disk merge; database chunks) over prepare's training split at each size; neighbours
(neighbour_search.py `query_neighbours`; chunks): every chunk of that store queries its database as
the build does, 20 candidates re-ranked, k = 2 outside its 4-chunk sequence; train-gpt2, train-retro
(a plain-torch step with AdamW of configs/tiny.yaml's model, bf16 autocast where the CPU computes
bf16; tokens); evaluate (scoring.py `score_split` of RETRO[ON], window 256, stride 128, untrained,
fixed neighbours; chunks). The database stages index bench/index.py's clustered 384-d unit vectors
(a cluster per 100 chunks) in shards aligned with the store's: `--factory` with K = 4·√N lists
(FAISS's guideline under 1M vectors: 4–16·√N), trained on 30·K vectors (its floor), nprobe 16;
PQ32x4 stands in for PQ32 under 39 · 256 training vectors (the test's sizes).

Each (stage, size) runs in a fresh process (--child); setup (imports, inputs, model, a warm-up) is
untimed. Time: the stage's (train: a step, mean of 3); `--repeat R`: R rounds over the sizes, each
size's fastest run kept (a shared machine's bursts slow one round). Memory: peak RSS during the stage above the
RSS as it began (the high-water mark reset then through /proc/self/clear_refs, read after from
ru_maxrss); it counts mapped file pages (memory-mapped shards, on-disk lists), which the kernel may
drop: `anonymous` (sampled every 10 ms) is the process's own; under 1 MB counts as 1 MB. Printed per
stage: `STAGE: time exponent X.XX, memory exponent Y.YY`, least-squares slopes of log time and log
memory on log size (1: linear, 0: flat), and its cost per unit at the largest size. Goals: every
time exponent ≤ 1.15; the database build's (embed, index, neighbours) memory exponents ≤ 0.5.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from bench.scaling.stages import NPROBE, RUNS, SIZES, replicated_corpus  # noqa: E402

STAGES = ("prepare", "embed", "index", "neighbours", "train-gpt2", "train-retro", "evaluate")
DATABASE_BUILD = ("embed", "index", "neighbours")
UNITS = {"prepare": "chunk", "embed": "chunk", "index": "chunk", "neighbours": "chunk",
         "train-gpt2": "token", "train-retro": "token", "evaluate": "chunk"}
SIZE_KIND = {"prepare": "data", "index": "data", "neighbours": "data", "embed": "embed",
             "train-gpt2": "train", "train-retro": "train", "evaluate": "evaluate"}


# -- the driver ---------------------------------------------------------------------------------

def run_child(stage: str, size: float, args, work: Path, corpus: Path) -> dict:
    """One (stage, size) in a fresh process (--in-process, the test's: in this one, imports paid once)."""
    if args.in_process:
        return RUNS[stage](work, size, corpus, args)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", stage, "--size", str(size), "--mode", args.mode,
           "--workdir", str(work), "--corpus-file", str(corpus), "--factory", args.factory]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"bench/scaling/scale.py: {stage} at size {size} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def slope(xs, ys) -> float:
    """Least-squares slope of log y on log x."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def report(stage: str, rows: list[dict]) -> dict:
    """The stage's fitted line, and its cost per unit at the largest size."""
    xs, times = [r["units"] for r in rows], [r["seconds"] for r in rows]
    fit = {key: slope(xs, [max(r[key], 1.0) for r in rows]) for key in ("peak_mb", "anon_mb")}
    fit["time"] = slope(xs, times)
    print(f"{stage}: time exponent {fit['time']:.2f}, memory exponent {fit['peak_mb']:.2f}")
    unit, last = UNITS[stage], rows[-1]
    fit["per_unit_us"] = last["seconds"] / last["units"] * 1e6
    print(f"  at {last['units']:,} {unit}s: {fit['per_unit_us']:,.1f} µs per {unit}, "
          f"{last['peak_mb'] / last['units'] * 1000:,.2f} MB per 1k {unit}s ({last['peak_mb']:,.1f} MB; anonymous "
          f"{last['anon_mb']:,.1f} MB, exponent {fit['anon_mb']:.2f}); time ×{times[-1] / times[0]:.1f} for "
          f"×{xs[-1] / xs[0]:.1f} the work")
    return fit


def describe(stage: str, size: float, r: dict) -> str:
    extra = {k: v for k, v in r.items() if k not in ("units", "seconds", "peak_mb", "anon_mb")}
    return (f"  {stage:<11} size {size:<6g} {r['units']:>9,} {UNITS[stage]}s {r['seconds']:>8.3f} s "
            f"peak {r['peak_mb']:>7.1f} MB anonymous {r['anon_mb']:>7.1f} MB {json.dumps(extra) if extra else ''}")


def goals(fits: dict) -> None:
    fast = [s for s, f in fits.items() if f["time"] > 1.15]
    print(f"goal time exponent ≤ 1.15 for every stage: {'met' if not fast else 'missed by ' + ', '.join(fast)}")
    build = [s for s in fits if s in DATABASE_BUILD]
    heavy = [s for s in build if fits[s]["peak_mb"] > 0.5]
    if build:
        print(f"goal memory exponent ≤ 0.5 for the database build ({', '.join(build)}): "
              f"{'met' if not heavy else 'missed by ' + ', '.join(heavy)}")


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="≤ 6 minutes on 2 cores")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="the default")
    mode.add_argument("--tiny", dest="mode", action="store_const", const="tiny", help=argparse.SUPPRESS)
    parser.add_argument("--stages", default=",".join(STAGES), help="a subset (what they read is added)")
    parser.add_argument("--factory", default="IVF{K},PQ32", help="FAISS factory; {K} = 4·√N lists")
    parser.add_argument("--threads", type=int, default=0, help="OpenMP threads a stage (default: every core)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of fresh processes; each size's fastest kept")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--child", "--size", "--corpus-file", "--mode"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.mode, args.threads = args.mode or "full", args.threads or (1 if args.mode == "tiny" else 0)
    if set(args.stages.split(",")) - set(STAGES):
        parser.error(f"--stages: the stages are {', '.join(STAGES)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:   # one (stage, size), in its own process: its result line for the driver
        size = float(args.size) if SIZE_KIND[args.child] == "data" else int(float(args.size))
        print("RESULT " + json.dumps(RUNS[args.child](Path(args.workdir), size, Path(args.corpus_file), args)))
        return 0
    from retropipe.data.cpu import CPU_FLAGS, cpu_flags, cpu_model

    print(f"{cpu_model()}, {os.cpu_count()} cores ({', '.join(n for f, n in CPU_FLAGS.items() if f in cpu_flags())}); "
          f"load average {os.getloadavg()[0]:.2f}; mode {args.mode}; index {args.factory} with K = 4·√N lists, "
          f"30·K training vectors, nprobe {NPROBE}")
    if args.in_process and args.threads:   # --threads reaches children through OMP_NUM_THREADS; here, directly
        import faiss
        import torch
        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    wanted = set(args.stages.split(","))    # neighbours read the index, the index reads prepare's stores
    wanted |= {"index"} if "neighbours" in wanted else set()
    wanted |= {"prepare"} if "index" in wanted else set()
    fits, begin = {}, time.perf_counter()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        corpus = replicated_corpus(Path(tmp) / "corpus.jsonl", math.ceil(max(SIZES[args.mode]["data"])))
        for stage in (s for s in STAGES if s in wanted):
            sizes, best = SIZES[args.mode][SIZE_KIND[stage]], {}
            for _ in range(args.repeat):   # rounds over the sizes: a neighbour's burst slows one round, not a size
                for size in sizes:
                    row = run_child(stage, size, args, Path(tmp), corpus)
                    print(describe(stage, size, row), flush=True)
                    best[size] = min(best.get(size, row), row, key=lambda r: r["seconds"])
            fits[stage] = report(stage, [best[size] for size in sizes])
    goals(fits)
    print(f"load average at the end {os.getloadavg()[0]:.2f}; {time.perf_counter() - begin:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
