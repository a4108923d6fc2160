"""Benchmark the embedding pass of a built database with exact copies skipped against every chunk embedded.

    python bench/copies.py --workdir runs/demo [--rounds 2]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/copies.py --workdir runs/demo

Takes the parts of the database a build wrote under `<workdir>/retrieval/database.json` (after
`make demo`: the training split and the second edition) and embeds all of them in this process
(`retrieval.embed_job.embed_stores` with the serial runner, all cores, the embedder's precision on
this CPU), alternating `--rounds` times: as a build does, each chunk that copies an earlier one
taking its source's vector (`retrieval/copies.py`), and with every job told to skip nothing, so
every chunk goes through the model (its copies' rows are then overwritten with their sources'
all the same). Prints the copies found and how long finding them took, each variant's seconds
and chunks/s over all the chunks written, and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from retropipe.data.chunking import SPLITS  # noqa: E402
from retropipe.data.store import ChunkStore  # noqa: E402
from retropipe.retrieval.copies import find_copies  # noqa: E402
from retropipe.retrieval.embed_job import (cached_embedder, embed_stores, resolve_model_path, runner_precision,  # noqa: E402
                                       serial_embed_runner)


def every_chunk_runner(spec, jobs):
    """The serial runner, each job's copies embedded too."""
    yield from serial_embed_runner(spec, [dataclasses.replace(job, skip=()) for job in jobs])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a workdir whose database was built (make demo: runs/demo)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    database = Path(args.workdir) / "retrieval" / "database.json"
    if not database.exists():
        print(f"bench/copies.py: {database} not found: build the database first (make demo)", file=sys.stderr)
        return 2
    stores = [ChunkStore(part["data_absolute"]) for part in json.loads(database.read_text())["parts"]]
    chunks = sum(len(store.split(split)) for store in stores for split in SPLITS)
    began = time.perf_counter()
    copies = find_copies(stores)
    print(f"{len(stores)} parts, {chunks:,} chunks, {len(copies):,} exact copies ({len(copies) / chunks:.1%}), "
          f"found in {time.perf_counter() - began:.2f} s")
    precision = runner_precision(serial_embed_runner, "auto")
    cached_embedder(str(resolve_model_path("")), "cpu", precision)   # loaded once, before either is timed
    seconds: dict[str, list[float]] = {"copies skipped": [], "every chunk embedded": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, runner in (("copies skipped", serial_embed_runner), ("every chunk embedded", every_chunk_runner)):
                out = Path(tmp) / "embeddings"
                began = time.perf_counter()
                embed_stores([(store, out / str(p)) for p, store in enumerate(stores)], "", 1024, runner,
                             precision=precision)
                seconds[name].append(time.perf_counter() - began)
                shutil.rmtree(out)
                print(f"  {name:<22} {seconds[name][-1]:7.1f} s  {chunks / seconds[name][-1]:6.1f} chunks/s", flush=True)
    best = {name: min(s) for name, s in seconds.items()}
    print(f"{precision} embeddings, best of {args.rounds}: copies skipped {best['copies skipped']:.1f} s, every chunk "
          f"{best['every chunk embedded']:.1f} s: {best['every chunk embedded'] / best['copies skipped']:.2f}× faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
