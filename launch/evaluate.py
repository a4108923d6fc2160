"""Evaluate trained models in bits per byte: baseline, RETRO[ON], RETRO[OFF], more neighbours, leakage.

    python launch/evaluate.py --config configs/tiny.yaml --checkpoint runs/tiny/runs/gpt2 \\
        --checkpoint runs/tiny/runs/retro [--split validation] [--out DIR]

A checkpoint is a run directory (its model/ is read) or a model directory. Writes report.md,
report.json and PNG plots into --out (default <workdir>/reports) and prints a short table.
`--corpus PATH` evaluates any held-out corpus instead (prepared with the training tokenizer,
retrieving from the training database; default --out <workdir>/reports/heldout-<name>-<hash>).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from data.config import ConfigError
from data.readers import DataError
from launch.config import add_config_args, config_from_args


def model_dir_of(path: Path) -> Path:
    return path / "model" if (path / "model" / "config.json").exists() else path


def evaluate(cfg, checkpoints: list[Path], split: str, out: Path, store=None, neighbours=None,
             corpus: str | None = None) -> dict:
    """Score every checkpoint on `split` of `store` (default: the training data's chunk store)."""
    import torch
    from tqdm import tqdm

    from data.neighbours import NeighbourStore
    from data.store import ChunkStore
    from data.tokenizer import get_tokenizer
    from training import load_model
    from training.evaluate import alpha_buckets, overlap_ratios, score_split, token_byte_lengths

    store = store if store is not None else ChunkStore(cfg.data_dir)
    chunks = store.split(split)
    byte_lengths = token_byte_lengths(get_tokenizer(store.manifest["tokenizer"]))
    e = cfg.eval
    models = [(p, load_model(model_dir_of(p))) for p in checkpoints]
    if neighbours is None and any(m.cfg.kind == "retro" for _, m in models):
        neighbours = NeighbourStore(cfg.retrieval_dir, store)
    rows, per_chunk = [], {}

    @torch.no_grad()
    def run(name, model, nbrs, k):
        bar = lambda xs: tqdm(xs, desc=f"eval {name}", leave=False, dynamic_ncols=True)  # noqa: E731
        scores = score_split(model, chunks, byte_lengths, e.window, e.stride, nbrs, k, e.batch_size, progress=bar,
                             max_chunks=e.max_chunks)
        per_chunk[name] = scores
        rows.append({"model": name, "bits_per_byte": scores.bits_per_byte(), "perplexity": scores.perplexity(),
                     "tokens": int(scores.tokens.sum()), "bytes": int(scores.bytes.sum())})

    for path, model in models:
        label = path.name if path.name != "model" else path.parent.name
        if model.cfg.kind == "gpt2":
            run(f"{label} (baseline)", model, None, 0)
        else:
            run(f"{label} RETRO[ON] k={e.neighbours}", model, neighbours, e.neighbours)
            run(f"{label} RETRO[OFF]", model, None, 0)
            if e.more_neighbours > e.neighbours:
                run(f"{label} RETRO[ON] k={e.more_neighbours}", model, neighbours, e.more_neighbours)

    report = {"split": split, "corpus": corpus or str(cfg.data.corpus), "window": e.window, "stride": e.stride, "rows": rows, "alpha": None}
    if neighbours is not None:
        # α(u): chunk u against the neighbours of chunk u - 1, the ones it is predicted with.
        ids = np.arange(len(next(iter(per_chunk.values())).nll))
        nb, mask = neighbours.neighbour_tokens(split, np.maximum(ids - 1, 0), k=e.neighbours)
        mask[0] = False
        alpha = overlap_ratios(chunks.tokens(ids), chunks.lengths, nb, mask, store.chunk_len)
        buckets = []
        for label, sel in alpha_buckets(alpha):
            buckets.append({"bucket": label, "chunks": int(sel.sum()),
                            **{name: s.bits_per_byte(sel) for name, s in per_chunk.items()}})
        report["alpha"] = {"buckets": buckets, "mean": float(alpha.mean())}
    out.mkdir(parents=True, exist_ok=True)
    from data.prepare import atomic_write
    atomic_write(out / "report.json", json.dumps(report, indent=1).encode())
    from launch.report import write_report
    write_report(report, [p for p, _ in models], out)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--checkpoint", action="append", required=True, type=Path,
                        help="a run directory or a model directory (repeatable)")
    parser.add_argument("--split", default=None, choices=["validation", "train"], help="default: validation")
    parser.add_argument("--corpus", default=None,
                        help="evaluate on this held-out corpus (file, directory or glob) instead of a split; "
                             "it is prepared with the training tokenizer and retrieves from the training database")
    parser.add_argument("--out", type=Path, default=None, help="report directory (default <workdir>/reports)")
    args = parser.parse_args(argv)
    if args.corpus and args.split:
        parser.error("--corpus evaluates a whole held-out corpus; --split applies to the training data only")
    args.split = args.split or "validation"
    try:
        cfg = config_from_args(args)
        for path in args.checkpoint:
            if not (model_dir_of(path) / "config.json").exists():
                raise DataError(f"--checkpoint {path}: no model there (expected a run directory with model/, "
                                f"or a directory with config.json and model.safetensors)")
        out = args.out or cfg.reports_dir
        store = neighbours = None
        if args.corpus:
            import hashlib
            tag = hashlib.blake2b(str(Path(args.corpus).resolve()).encode(), digest_size=4).hexdigest()
            import re
            name = re.sub(r"[^\w-]+", "_", Path(args.corpus).name.split(".")[0]).strip("_") or "corpus"
            out = args.out or cfg.reports_dir / f"heldout-{name}-{tag}"
            from launch.heldout import describe, prepare_heldout
            from training.model_io import read_config

            retro = any(read_config(model_dir_of(p)).kind == "retro" for p in args.checkpoint)
            store, neighbours = prepare_heldout(cfg, args.corpus, out, need_neighbours=retro)
            print(f"held-out corpus {args.corpus}: {describe(out)}")
        report = evaluate(cfg, args.checkpoint, args.split, out, store, neighbours, args.corpus)
    except (ConfigError, DataError, ValueError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    from launch.report import table
    print(table(report))
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
