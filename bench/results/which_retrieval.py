"""Which retrieval to use: RETRO against the rivals on one corpus, every method, two seeds (docs/results.md).

    python bench/results/which_retrieval.py --workdir runs/which/demo                      # the demo's corpus and database
    python bench/results/which_retrieval.py --workdir runs/which/versions --set data.corpus=runs/versions/versions.jsonl \\
        --set 'retrieval.corpora=[]' --set 'eval.database_curve=[]'
    python bench/results/which_retrieval.py --workdir runs/which/techdocs --set data.corpus=../shared/corpora/techdocs.jsonl.gz \\
        --set 'retrieval.corpora=[]' --set 'eval.database_curve=[]' --set eval.max_chunks=2000

Every row is the command a user would type, run in turn (each skips work already complete, so a
rerun resumes):
  1. `launch/demo.py` into <workdir>/dense, the in-context-trained rival asked for: data, the dense
     database, the GPT-2 baseline, RETRO from its weights, the GPT-2 trained with its neighbours in
     context. Then each row is scored alone (its evaluation seconds its own): the baseline, the
     untrained rivals (in-context, kNN-LM; deterministic given the baseline), the trained ones.
  2. per further method (bm25, hybrid): <workdir>/<method> starts as a copy of the dense workdir's
     data and retrieval directories (what the method shares is skipped), then launch/build_index.py,
     RETRO trained from the same baseline on that method's neighbours, and its evaluation.
  3. per further seed: RETRO of every method and the in-context-trained GPT-2 again, from the same
     baseline, and their evaluation.
It prints one table: each row's bits per byte per seed, beside its training and evaluation
seconds (the command's wall time on this machine; the rivals' evaluation is the dense report's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from retropipe.launch.report import slice_harm

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("dense", "bm25", "hybrid")
CONFIG = "configs/tiny.yaml"
IN_CONTEXT_RUN = "gpt2-in-context"   # launch/demo.py's name for the in-context-trained run


def run(cmd: list[str], what: str, times: dict) -> None:
    """One command, timed into times[what]; its failure stops the benchmark."""
    print(f"\n=== {what}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        sys.exit(f"which_retrieval: '{what}' failed (its output is above)")
    times[what] = times.get(what, 0.0) + time.perf_counter() - start


def sets_of(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def train(workdir: Path, sets: list[str], name: str, seed: int, times: dict, *extra: str) -> None:
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    base = workdir.parent / "dense" / "runs" / "gpt2" / "model"
    run([deepspeed, "--num_gpus", "2", "--log_level", "warning", "launch/train.py", "--config", CONFIG, *sets,
         "--set", f"workdir={workdir}", "--set", f"train.name={name}", "--set", f"train.seed={seed}",
         "--set", f"train.init_from={base}", *extra], f"train {workdir.name} {name}", times)


def evaluate(workdir: Path, sets: list[str], names: list[str], out: str, times: dict, rival: str = "") -> dict:
    """Score the runs `names` of workdir alone (with the untrained `rival` only, if one is named)."""
    checkpoints = [a for n in names for a in ("--checkpoint", str(workdir / "runs" / n))]
    run([sys.executable, "launch/evaluate.py", "--config", CONFIG, *sets, "--set", f"workdir={workdir}",
         "--set", f"eval.rivals=[{rival}]", "--set", "eval.database_curve=[]", "--set", "eval.more_neighbours=0",
         *checkpoints, "--out", str(workdir / "reports" / "rows" / out), "--no-progress"],
        f"evaluate {workdir.name} {out}", times)
    return json.loads((workdir / "reports" / "rows" / out / "report.json").read_text())


def method_workdir(root: Path, method: str) -> Path:
    """<root>/<method>, its data and retrieval directories copied from <root>/dense once."""
    workdir = root / method
    for folder in ("data", "retrieval", "corpora"):
        if (root / "dense" / folder).exists() and not (workdir / folder).exists():
            shutil.copytree(root / "dense" / folder, workdir / folder, symlinks=True)
    return workdir


def demo(sets: list[str], root: Path, times: dict) -> None:
    """launch/demo.py into <root>/dense with every rival; its training stages' seconds into times."""
    cmd = [sys.executable, "launch/demo.py", "--config", CONFIG, *sets, "--set", f"workdir={root / 'dense'}",
           "--set", "eval.rivals=[in_context_trained]"]  # the untrained rivals are scored as rows below
    print(f"\n=== demo: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    stage_runs = {"train the GPT-2 baseline": "gpt2", "train RETRO from the baseline's weights": "retro",
                  "train GPT-2 with neighbours in context from the baseline's weights": IN_CONTEXT_RUN}
    for line in proc.stdout:
        print(line, end="", flush=True)
        for stage, name in stage_runs.items():
            if line.startswith(f"=== {stage}: done in "):
                times[f"train dense {name}"] = float(line.rsplit(" ", 1)[-1].rstrip("s\n"))
    if proc.wait() != 0:
        sys.exit("which_retrieval: the demo failed (its output is above)")


def row(report: dict, suffix: str) -> float:
    return next(r["bits_per_byte"] for r in report["rows"] if r["model"].endswith(suffix))


def harm(report: dict) -> tuple[float, float]:
    """A RETRO report's worst ON vs OFF over the α slices of ≥ 50 chunks, and SHUFFLED vs OFF overall."""
    worst = max((h["on_vs_off"] for h in slice_harm(report) if h["chunks"] >= 50 and h["on_vs_off"] is not None),
                default=float("nan"))
    return worst, row(report, "RETRO[SHUFFLED]") / row(report, "RETRO[OFF]") - 1


def print_table(rows: list[tuple], seeds: list[int]) -> None:
    """rows: (name, {seed: bits per byte}, training seconds, evaluation seconds)."""
    best_free = min(v for name, bpb, _, _ in rows if "no training" in name for v in bpb.values())
    print("\n| row | " + " | ".join(f"seed {s}" for s in seeds) + " | vs best untrained rival | train s | eval s |")
    print("|---|" + "---|" * len(seeds) + "---|---|---|")
    for name, bpb, train_s, eval_s in rows:
        cells = [f"{bpb[s]:.4f}" if s in bpb else "(the same)" for s in seeds]
        print(f"| {name} | " + " | ".join(cells) + f" | {bpb[seeds[0]] / best_free:.3f}× | "
              + " | ".join(f"{t:.0f}" if t is not None else "–" for t in (train_s, eval_s)) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="key=value, as launch/demo.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = parser.parse_args()
    root, seeds, times = args.workdir.resolve(), args.seeds, {}
    sets = sets_of(args.overrides)
    demo(sets, root, times)
    # The demo's own database corpora (its second edition) unless the user set retrieval.corpora.
    if not any(o.startswith("retrieval.corpora=") for o in args.overrides):
        sets += ["--set", f"retrieval.corpora=[{root / 'dense' / 'corpora' / 'second_edition.jsonl'}]"]
    dense = root / "dense"
    rows = []
    for name, rival, suffix in (("GPT-2 baseline", "", "(baseline)"), ("GPT-2 in-context (no training)", "in_context",
                                " in-context k=1"), ("GPT-2 kNN-LM (no training)", "knn_lm", " kNN-LM")):
        out = rival or "baseline"
        bpb = row(evaluate(dense, sets, ["gpt2"], out, times, rival), suffix)
        rows.append((name, {seeds[0]: bpb}, None if rival else times.get("train dense gpt2"),
                     times[f"evaluate dense {out}"]))
    trained = {}
    for seed in seeds:
        name = IN_CONTEXT_RUN if seed == seeds[0] else f"{IN_CONTEXT_RUN}_s{seed}"
        if seed != seeds[0]:
            train(dense, [*sets, "--set", "model.in_context=1"], name, seed, times)
        trained[seed] = row(evaluate(dense, sets, [name], name, times), "in-context trained k=1")
    rows.append(("GPT-2 in-context, trained", trained, times.get(f"train dense {IN_CONTEXT_RUN}"),
                 times[f"evaluate dense {IN_CONTEXT_RUN}"]))
    harms = []
    for method in args.methods:
        workdir, msets = method_workdir(root, method), [*sets, "--set", f"retrieval.method={method}"]
        if method != "dense":
            run([sys.executable, "launch/build_index.py", "--config", CONFIG, *msets, "--set", f"workdir={workdir}"],
                f"database {method}", times)
        on = {}
        for seed in seeds:
            name = "retro" if seed == seeds[0] else f"retro_s{seed}"
            if (method, seed) != ("dense", seeds[0]):
                train(workdir, [*msets, "--set", "model.kind=retro"], name, seed, times)
            report = evaluate(workdir, msets, [name], name, times)
            on[seed] = row(report, "RETRO[ON] k=2")
            harms.append((method, seed, *harm(report)))
        rows.append((f"RETRO[ON], {method} neighbours", on, times.get(f"train {method} retro"),
                     times[f"evaluate {method} retro"]))
    print_table(rows, seeds)
    print("\n| method | seed | worst α slice (≥ 50 chunks): ON vs OFF | SHUFFLED vs OFF |\n|---|---|---|---|")
    for method, seed, worst, shuffled in harms:
        print(f"| {method} | {seed} | {worst:+.2%} | {shuffled:+.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
