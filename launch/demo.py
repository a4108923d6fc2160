"""The main job, end to end on the embedded corpus: `make demo`.

    python launch/demo.py [--config configs/tiny.yaml] [--set key=value ...] [--nproc 2]

write a second edition of the corpus → prepare data → build the retrieval database (Ray, BM25
neighbours): the training split plus the second edition → train the GPT-2 baseline, then RETRO from its weights
(DeepSpeed, `--nproc` processes, `train.pipeline_stages` stages) → evaluate both (bits per byte,
RETRO on/off/shuffled, leakage, the database-size curve) → generate a sample from each.

The second edition stands for what a real retrieval database holds and a training split does
not: other versions of the evaluated text. Every document of the corpus reappears there with 15%
of its sentences dropped (bench/corpora/twin_corpus.py --edited-only), the held-out ones too, so RETRO can
read a validation document's neighbours where the baseline can only guess. The report says how
much of the gain that is (α buckets, RETRO §2.6) and shows it grow with the database (the curve:
the training split alone, + half the edition, + all of it). The sample prompt is the opening of a
held-out entry (kluge), so the RETRO sample shows what it read.

RETRO starts from the trained baseline's weights (`train.init_from`; the paper's RETRO-fitting,
§4.2, with the trunk left to train): its chunked cross-attention and encoder start fresh, and in
the same 100 steps it learns to copy from its neighbours better than from scratch (docs/results.md).
It has then trained 200 steps in all, so its RETRO[OFF] row, not the baseline, is the comparison
for what retrieval adds; the report says so beside the rows. configs/tiny.yaml starts the token
embedding at N(0, 0.1) rather than GPT-2's 0.02 (`model.embedding_init_std`): at width 128 that
is what lets RETRO copy rare tokens, so that its sample continues the held-out entry as its
neighbour does.

Each stage is the command a user would type, run as a subprocess, so the demo shows the real
entry points; each skips work that is already complete, so rerunning the demo is cheap.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from retropipe.data.stage import PREEMPTED, SCHEDULER_SIGNALS
from retropipe.launch.cli import config_from_args, engines_verbose, entry_parser, quiet_engines
from retropipe.launch.config import load_config
from retropipe.launch.train import as_run, run_dir_of
from retropipe.training.run.config import TrainConfig
from retropipe.training.run.hardware import too_few_gpus
from retropipe.training.run.run_dir import run_dir_conflict

ROOT = Path(__file__).resolve().parent.parent

# The opening of the Jargon File's "kluge" entry, in the validation split of the embedded corpus
# (data.seed 1234): 72 tokens, one whole chunk to retrieve with.
PROMPT = ("kluge /klooj/ [from the German ‘klug’, clever; poss. related to Polish & Russian ‘klucz’ (a key, "
          "a hint, a main point)] 1. n. A Rube Goldberg (or Heath Robinson) device, whether in hardware or "
          "software. 2. n. A clever")
EDITION_SEED = 7
# The run directory of the GPT-2 trained with its neighbours in context (eval.rivals: in_context_trained).
IN_CONTEXT_RUN = "gpt2-in-context"


def demo_overrides(workdir: Path) -> list[str]:
    """The demo's settings over the config: the second edition in the database, BM25 neighbours
    (RETRO reads them best on every corpus measured, docs/results.md "Which retrieval to use", and
    they need no embedding), the database-size curve in the report."""
    return [f"retrieval.corpora=[{edition_path(workdir)}]", "retrieval.method=bm25", "eval.database_curve=[0,0.5,1]"]


def edition_path(workdir: Path) -> Path:
    return workdir / "corpora" / "second_edition.jsonl"


def older_runs(config: str, plan: list[tuple[str, list[str]]]) -> str | None:
    """An error message if a training stage's run directory holds a run of another config (an
    older demo's: RETRO trained from scratch, or either model with other settings). Training
    would refuse it only when its stage comes, with a hint (train.name) the demo cannot follow;
    so the demo names every such directory before any stage runs."""
    found = []
    for _, cmd in plan:
        if "launch/train.py" not in cmd:
            continue
        cfg = as_run(load_config(config, [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]))
        run_dir = run_dir_of(cfg)
        try:
            conflict = run_dir_conflict(cfg, run_dir)
        except (OSError, ValueError, yaml.YAMLError) as e:  # an unreadable config.yaml or rules.json
            conflict = f"{run_dir} cannot be checked ({e})"
        if conflict:
            found.append((run_dir, conflict))
    if not found:
        return None
    return ("; ".join(conflict for _, conflict in found) + ". Delete " + " and ".join(str(d) for d, _ in found)
            + " to train again, or give the demo another --set workdir=...")


def stages(config: str, corpus: str, overrides: list[str], nproc: int, workdir: Path,
           in_context_trained: bool = False) -> list[tuple[str, list[str]]]:
    """The demo's commands; in_context_trained (eval.rivals holds it): also a GPT-2 trained from the
    baseline's weights with its neighbours in context (model.in_context), RETRO's steps and lessons."""
    sets = [a for o in overrides for a in ("--set", o)]
    py = sys.executable
    deepspeed = shutil.which("deepspeed", path=str(Path(py).parent)) or "deepspeed"
    runs = workdir / "runs"
    # The launcher's own INFO lines (its environment, the world info) only with --verbose.
    launcher_log = [] if engines_verbose() else ["--log_level", "warning"]

    def train(kind: str, *extra: str, name: str = "") -> list[str]:
        return [deepspeed, "--num_gpus", str(nproc), *launcher_log, "launch/train.py", "--config", config, *sets,
                "--set", f"model.kind={kind}", "--set", f"train.name={name or kind}", *extra]

    def generate(kind: str) -> list[str]:
        # Greedy: each model's most likely continuation, not one draw that a seed picks.
        return [py, "launch/generate.py", "--config", config, *sets, "--checkpoint", str(runs / kind),
                "--prompt", PROMPT, "--max-new-tokens", "96", "--temperature", "0", "--show-neighbours"]

    edition = edition_path(workdir)
    return [
        ("write a second edition of the corpus", [py, "bench/corpora/twin_corpus.py", "--corpus", corpus, "--edited-only",
                                                  "--seed", str(EDITION_SEED), "--out", str(edition)]),
        ("prepare data", [py, "launch/prepare_data.py", "--config", config, *sets]),
        ("build the retrieval database", [py, "launch/build_index.py", "--config", config, *sets]),
        ("train the GPT-2 baseline", train("gpt2")),
        ("train RETRO from the baseline's weights", train("retro", "--set", f"train.init_from={runs / 'gpt2' / 'model'}")),
        *([("train GPT-2 with neighbours in context from the baseline's weights",
            train("gpt2", "--set", "model.in_context=1", "--set", f"train.init_from={runs / 'gpt2' / 'model'}",
                  name=IN_CONTEXT_RUN))] if in_context_trained else []),
        ("evaluate", [py, "launch/evaluate.py", "--config", config, *sets, "--checkpoint", str(runs / "gpt2"),
                      *(["--checkpoint", str(runs / IN_CONTEXT_RUN)] if in_context_trained else []),
                      "--checkpoint", str(runs / "retro")]),
        ("generate (baseline)", generate("gpt2")),
        ("generate (RETRO)", generate("retro")),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(__doc__, progress=False)
    parser.set_defaults(config="configs/tiny.yaml")
    parser.add_argument("--nproc", type=int, default=2, help="DeepSpeed processes (CPU: over gloo)")
    args = parser.parse_args(argv)
    quiet_engines(args.verbose)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    refused = nproc_refused(args.nproc, cfg)
    if refused:  # before any stage: training would refuse it only after the database is built
        print(f"demo: error: {refused}", file=sys.stderr)
        return 2
    workdir = Path(cfg.workdir).resolve()
    # The user's --set win over the demo's; the stages agree on one absolute workdir.
    overrides = [*demo_overrides(workdir), *args.overrides, f"workdir={workdir}"]
    config = str(Path(args.config).resolve())
    demo_cfg = load_config(config, overrides)
    plan = stages(config, str(cfg.data.corpus), overrides, args.nproc, workdir,
                  "in_context_trained" in demo_cfg.eval.rivals)
    older = older_runs(config, plan)
    if older:
        print(f"demo: error: {older}", file=sys.stderr)
        return 2
    return run_stages(plan, workdir, demo_cfg.reports_dir / "report.md", grace=demo_cfg.train.preempt_grace)


def nproc_refused(nproc: int, cfg) -> str | None:
    """Why --nproc cannot train this config, or None."""
    if nproc % cfg.train.pipeline_stages:
        return f"--nproc {nproc} is not a multiple of train.pipeline_stages ({cfg.train.pipeline_stages})"
    crowded = too_few_gpus(nproc, torch.cuda.device_count()) if torch.cuda.is_available() else None
    return f"--nproc {nproc}: {crowded}" if crowded else None


def run_stages(plan: list[tuple[str, list[str]]], workdir: Path, report: Path,
               grace: float = TrainConfig.preempt_grace) -> int:
    """Each stage's command in turn, timed; the first that fails stops the demo (exit code 1, or
    75 where a signal stopped it; a training stage's ranks get `grace` seconds, train.preempt_grace)."""
    # Not offline mode: the defaults need no network (bundled files), and a hub name given with
    # --set is fetched as the user asked.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    began = time.perf_counter()
    for name, cmd in plan:
        print(f"\n=== {name}: {' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}", flush=True)
        start = time.perf_counter()
        code = run_stage(cmd, env, grace)
        if code == PREEMPTED:
            print(f"demo: stopped by a signal in stage '{name}'; rerun the same command to resume: "
                  f"{' '.join(sys.argv)}", file=sys.stderr)
            return PREEMPTED
        if code != 0:
            print(f"demo: stage '{name}' failed (its output is above); rerun the same command to resume: "
                  f"{' '.join(sys.argv)}", file=sys.stderr)
            return 1
        print(f"=== {name}: done in {time.perf_counter() - start:.0f}s", flush=True)
    print(f"\ndemo: done in {(time.perf_counter() - began) / 60:.1f} min; everything is under {workdir}")
    print(f"report: {report}")
    return 0


def run_stage(cmd: list[str], env: dict, grace: float) -> int:
    """The stage's exit code; PREEMPTED where a signal to the demo stopped it.

    The stage runs in a session of its own, and a scheduler's signal or Ctrl-C to the demo goes
    on to it: it stops as it would by itself (its work kept), and the demo waits for it, so that
    no stage is left running without its demo. DeepSpeed's launcher passes nothing on from one
    node's runner, so a training stage's every process gets the signal; a Ray stage's driver alone,
    which then stops its local Ray (a raylet that got it too would take the driver down first)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    launcher, came = Path(cmd[0]).name == "deepspeed", []

    def forward(signum, frame):
        came.append(signum)
        os.killpg(proc.pid, signum) if launcher else proc.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (*SCHEDULER_SIGNALS, signal.SIGINT)}
    try:
        code = proc.wait()
        if came and launcher:
            wait_for_group(proc.pid, timeout=grace)  # the ranks write their checkpoint
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return PREEMPTED if came else code


def wait_for_group(pgid: int, timeout: float) -> None:
    """Until no process of the group `pgid` is left (or timeout seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
