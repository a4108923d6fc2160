"""Prepare a corpus into a chunk store with Ray.

    python launch/prepare_data.py --config configs/tiny.yaml [--set data.corpus=my.jsonl] [--address ...]

Reads data.corpus, tokenizes and chunks it in parallel Ray tasks, and writes
<workdir>/data/ (see data/prepare.py for the layout). Resumable: rerun after a crash.
"""

from __future__ import annotations

import sys

from retropipe.data.errors import ConfigError, DataError, TokenizerError
from retropipe.data.prepare import prepare, summary
from retropipe.launch.cli import config_from_args, entry_parser, quiet_engines, run_stopping
from retropipe.launch.config import save_config
from retropipe.launch.ray_utils import ClusterError, RayExecutor, record_work, work_summary


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(__doc__, ray=True)
    args = parser.parse_args(argv)
    quiet_engines(args.verbose)
    return run_stopping("prepare_data", lambda: prepare_stage(args))


def prepare_stage(args) -> int:
    """The preparation; the exit code."""
    executor = None
    try:
        cfg = config_from_args(args)
        executor = RayExecutor(args.address, num_cpus=cfg.data.num_workers or None)
        manifest = prepare(cfg.data, cfg.data_dir, executor=executor, progress=not args.no_progress)
        save_config(cfg, cfg.data_dir)
        work = record_work(cfg.data_dir, tasks=executor.placements)
    except (ConfigError, DataError, TokenizerError, ClusterError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    finally:
        if executor is not None:
            executor.close()
    print(f"prepared data in {cfg.data_dir}")
    print(summary(manifest))
    print(work_summary(work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
