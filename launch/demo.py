"""The main job, end to end on the embedded corpus: `make demo`.

Runs each stage as the command a user would type, in order; every stage skips work that
is already complete, so rerunning the demo is cheap.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stages(config: str, overrides: list[str]) -> list[tuple[str, list[str]]]:
    sets = [a for o in overrides for a in ("--set", o)]
    py = sys.executable
    return [
        ("prepare data", [py, "launch/prepare_data.py", "--config", config, *sets]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    for name, cmd in stages(args.config, args.overrides):
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            print(f"demo: stage '{name}' failed", file=sys.stderr)
            return 1
        print(f"=== {name}: done in {time.perf_counter() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
