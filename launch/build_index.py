"""Build the retrieval database with Ray: chunk embeddings, FAISS index, neighbours of every chunk.

    python launch/build_index.py --config configs/tiny.yaml [--set retrieval.index=IVF1024,PQ32] [--address ...]

    # on a running cluster (workdir absolute: the job runs in a copy of --working-dir)
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python launch/build_index.py --config configs/tiny.yaml --set workdir=$PWD/runs/tiny

Reads <workdir>/data/ (launch/prepare_data.py), writes <workdir>/retrieval/ (see
docs/retrieval.md). Every stage is skipped when complete and resumes after a crash.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from retropipe.data.errors import ConfigError, DataError, TokenizerError
from retropipe.data.store import ChunkStore
from retropipe.launch.cli import config_from_args, entry_parser, quiet_engines, run_stopping
from retropipe.launch.config import save_config
from retropipe.launch.ray_utils import ClusterError, RayExecutor, record_work, work_summary
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.build_database import build_retrieval, summary
from retropipe.retrieval.ray_embed import RayEmbedRunner


def open_chunk_store(data_dir: Path, workdir: str) -> ChunkStore:
    """The chunk store, or a DataError naming the file (KeyError/IndexError from a damaged manifest too)."""
    try:
        store = ChunkStore(data_dir)
        for split in ("train", "validation"):
            store.split(split)
        return store
    except DataError as e:
        hint = ""
        if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # set in the entrypoint of a `ray job submit`
            if not Path(workdir).is_absolute():
                hint = (f" (this is a `ray job submit` job running in a copy of --working-dir: give an absolute "
                        f"workdir, e.g. --set workdir=$PWD/{workdir})")
        raise DataError(f"{e}{hint}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{data_dir / 'manifest.json'}: corrupt chunk-store manifest ({e!r}); "
                        f"run launch/prepare_data.py again") from None


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(__doc__, ray=True)
    args = parser.parse_args(argv)
    quiet_engines(args.verbose)
    return run_stopping("build_index", lambda: build(args))


def build(args) -> int:
    """The database build; the exit code."""
    executor = None
    try:
        cfg = config_from_args(args)
        store = open_chunk_store(cfg.data_dir, cfg.workdir)
        executor = RayExecutor(args.address)
        runner = RayEmbedRunner(executor, cfg.retrieval.embed_actors, cfg.retrieval.embed_device,
                                progress=not args.no_progress)
        result = build_retrieval(cfg.retrieval, store, cfg.retrieval_dir,
                                 chunks_per_seq=cfg.train.seq_len // cfg.data.chunk_len, data_cfg=cfg.data,
                                 embed_runner=runner, executor=executor, workers=os.cpu_count() or 2,
                                 progress=not args.no_progress)
        save_config(cfg, cfg.retrieval_dir)
        work = record_work(cfg.retrieval_dir, tasks=executor.placements, embed_jobs=runner.placements)
    except (ConfigError, DataError, TokenizerError, RetrievalError, ClusterError) as e:
        if executor is not None:  # first: the last lines Ray forwards from its workers come before ours
            executor.close()
        print(f"build_index: error: {e}", file=sys.stderr)
        return 2
    finally:
        if executor is not None:
            executor.close()
    print(f"retrieval database in {cfg.retrieval_dir}")
    print(summary(result))
    print(work_summary(work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
