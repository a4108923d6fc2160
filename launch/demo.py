"""The main job, end to end on the embedded corpus: `make demo`.

    python launch/demo.py [--config configs/tiny.yaml] [--set key=value ...] [--nproc 2]

prepare data → build the retrieval database (Ray) → train the GPT-2 baseline and its RETRO twin
(DeepSpeed, `--nproc` processes, `train.pipeline_stages` stages) → evaluate both (bits per byte,
RETRO on/off, leakage) → generate a sample from each.

Each stage is the command a user would type, run as a subprocess, so the demo shows the real
entry points; each skips work that is already complete, so rerunning the demo is cheap.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "The hacker ethic"


def stages(config: str, overrides: list[str], nproc: int, workdir: Path) -> list[tuple[str, list[str]]]:
    from launch.cli import engines_verbose

    sets = [a for o in overrides for a in ("--set", o)]
    py = sys.executable
    deepspeed = shutil.which("deepspeed", path=str(Path(py).parent)) or "deepspeed"
    runs = workdir / "runs"
    # The launcher's own INFO lines (its environment, the world info) only with --verbose.
    launcher_log = [] if engines_verbose() else ["--log_level", "warning"]

    def train(kind: str) -> list[str]:
        return [deepspeed, "--num_gpus", str(nproc), *launcher_log, "launch/train.py", "--config", config, *sets,
                "--set", f"model.kind={kind}", "--set", f"train.name={kind}"]

    def generate(kind: str) -> list[str]:
        return [py, "launch/generate.py", "--config", config, *sets, "--checkpoint", str(runs / kind),
                "--prompt", PROMPT, "--max-new-tokens", "96", "--seed", "0", "--show-neighbours"]

    return [
        ("prepare data", [py, "launch/prepare_data.py", "--config", config, *sets]),
        ("build the retrieval database", [py, "launch/build_index.py", "--config", config, *sets]),
        ("train the GPT-2 baseline", train("gpt2")),
        ("train RETRO", train("retro")),
        ("evaluate", [py, "launch/evaluate.py", "--config", config, *sets,
                      "--checkpoint", str(runs / "gpt2"), "--checkpoint", str(runs / "retro")]),
        ("generate (baseline)", generate("gpt2")),
        ("generate (RETRO)", generate("retro")),
    ]


def main(argv: list[str] | None = None) -> int:
    from launch.cli import config_from_args, entry_parser, quiet_engines
    from launch.config import load_config

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
    if args.nproc % cfg.train.pipeline_stages:
        print(f"demo: error: --nproc {args.nproc} is not a multiple of train.pipeline_stages "
              f"({cfg.train.pipeline_stages})", file=sys.stderr)
        return 2
    workdir = Path(cfg.workdir).resolve()
    overrides = [*args.overrides, f"workdir={workdir}"]  # stages agree on one absolute workdir
    config = str(Path(args.config).resolve())
    report = load_config(config, overrides).reports_dir / "report.md"
    # Not offline mode: the defaults need no network (bundled files), and a hub name given with
    # --set is fetched as the user asked.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    began = time.perf_counter()
    for name, cmd in stages(config, overrides, args.nproc, workdir):
        print(f"\n=== {name}: {' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
            print(f"demo: stage '{name}' failed (its output is above); rerun the same command to resume: "
                  f"{' '.join(sys.argv)}", file=sys.stderr)
            return 1
        print(f"=== {name}: done in {time.perf_counter() - start:.0f}s", flush=True)
    print(f"\ndemo: done in {(time.perf_counter() - began) / 60:.1f} min; everything is under {workdir}")
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
