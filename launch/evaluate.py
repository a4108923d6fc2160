"""Evaluate trained models in bits per byte: baseline, RETRO[ON], RETRO[OFF], RETRO[SHUFFLED], leakage α.

    python launch/evaluate.py --config configs/tiny.yaml --checkpoint runs/tiny/runs/gpt2 \\
        --checkpoint runs/tiny/runs/retro [--split validation] [--out DIR]
    python launch/evaluate.py --config configs/tiny.yaml --checkpoint runs/tiny/runs/retro --corpus other.jsonl
    python launch/evaluate.py --config configs/tiny.yaml --checkpoint runs/tiny/runs/retro --database OTHER/retrieval

A checkpoint is a run directory (its model/ is read) or a model directory. `--device cuda` (or
`auto` with a GPU visible, the default) loads the models, scores, and (a dense or hybrid database)
embeds the queries there.
Writes report.md,
report.json, config.yaml and PNG plots into --out (default <workdir>/reports) and prints a table.
`--corpus PATH` evaluates any held-out corpus (prepared with the training tokenizer, every
document held out); `--database DIR` retrieves from another database built by
launch/build_index.py (a bigger one, say) instead of <workdir>/retrieval: no retraining.
`eval.database_curve` adds the database-size curve. The rules (rows, α) are training/evaluation/report_rows.py's.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from retropipe.data.cpu import cpu_has_bf16, emulated_bf16
from retropipe.data.database_reader import DATABASE_FILE
from retropipe.data.errors import ConfigError, DataError
from retropipe.data.stage import fingerprint, path_tag, read_json, sha256_file, write_json
from retropipe.data.store import ChunkStore
from retropipe.data.tokenizer import get_tokenizer
from retropipe.launch.cli import config_from_args, entry_parser, quiet_engines, resolve_device
from retropipe.launch.config import save_config
from retropipe.launch.report import how_trained, table, write_report
from retropipe.retrieval.heldout import evaluation_neighbours, prepare_heldout
from retropipe.retrieval.index import faiss_module
from retropipe.training.evaluation.report_rows import RivalInputs, evaluate_models
from retropipe.training.evaluation.scoring import token_byte_lengths
from retropipe.training.models.io import load_model
from retropipe.training.run.hardware import gpu_has_bf16


# Keys up to which the kNN-LM's datastore is searched exactly.
EXACT_KEYS = 200_000


def model_dir_of(path: Path) -> Path:
    return path / "model" if (path / "model" / "config.json").exists() else path


def scoring_precision_on(precision: str, device: str) -> str:
    """eval.precision on `device`: "auto" is bf16 where the device has bf16 matmuls in hardware (a
    CPU with AVX512-BF16 or AMX, a GPU of compute capability 8.0 or newer), else fp32."""
    if precision != "auto":
        return precision
    if device.startswith("cuda"):
        return "bf16" if gpu_has_bf16(torch.cuda.get_device_capability(torch.device(device))) else "fp32"
    return "bf16" if cpu_has_bf16() else "fp32"


def evaluate(cfg, checkpoints: list[Path], split: str, out: Path, corpus: str | None = None,
             database: Path | None = None, device: str = "cpu", progress: bool = True) -> dict:
    """Score every checkpoint on `split` (or on a held-out corpus); write the report files into out."""
    # "auto" as it stands on this device: the report, its fingerprint and config.yaml name the precision scored in.
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, precision=scoring_precision_on(cfg.eval.precision,
                                                                                                 device)))
    store, split = evaluation_store(cfg, split, out, corpus, progress)
    database = Path(database or cfg.retrieval_dir)
    models = [(p.name if p.name != "model" else p.parent.name, load_model(model_dir_of(p), device=device))
              for p in checkpoints]
    neighbours, curve = None, []
    if any(m.cfg.retrieves or m.cfg.in_context for _, m in models) or rivals_can_read(cfg, models, database):
        neighbours, curve = evaluation_neighbours(cfg, store, split, out, database, device)
    inputs = evaluation_inputs(cfg, models, checkpoints, store, split, neighbours, curve)
    done = read_json(out / "report.json")
    if done is not None and done.get("inputs") == inputs and (out / "report.md").exists():
        print(f"evaluate: {out / 'report.json'} is complete for these models, data and settings; nothing to do "
              f"(delete it to score again)")
        return done
    report, trained = score(cfg, models, checkpoints, store, split, neighbours, curve, device, progress)
    report.update(split=split, corpus=corpus or str(cfg.data.corpus), heldout_corpus=bool(corpus), database=str(database),
                  checkpoints=[str(p) for p in checkpoints], inputs=inputs, trained=trained)
    out.mkdir(parents=True, exist_ok=True)
    write_report(report, [p for p in checkpoints], out)
    save_config(cfg, out)
    write_json(out / "report.json", report)  # last: the report is complete
    return report


def rivals_can_read(cfg, models: list, database: Path) -> bool:
    """Whether the rivals (eval.rivals) have a GPT-2 to read with and a database to read from; a
    GPT-2 evaluated alone before any database is built is scored without them (and told so)."""
    if not cfg.eval.rivals or all(m.cfg.retrieves or m.cfg.in_context for _, m in models):
        return False
    if not (database / DATABASE_FILE).exists():
        print(f"evaluate: eval.rivals skipped: no retrieval database at {database} (build it: "
              f"python launch/build_index.py --config ...)", file=sys.stderr)
        return False
    return True


def knn_datastore_index(keys: np.ndarray):
    """The kNN-LM datastore's FAISS index over keys (N, d) → search(queries, n) -> (D, I): exact up
    to EXACT_KEYS keys, else IVF with √N lists in fp16 (kNN-LM's own is IVF-PQ), probing 32."""
    faiss = faiss_module()
    n, d = keys.shape
    if n <= EXACT_KEYS:
        index = faiss.IndexFlatL2(d)
    else:
        nlist = 2 ** round(math.log2(math.sqrt(n)))
        index = faiss.index_factory(d, f"IVF{nlist},SQfp16")
        sample = np.sort(np.random.default_rng(0).choice(n, size=min(n, 40 * nlist), replace=False))
        index.train(keys[sample].astype(np.float32))
        faiss.extract_index_ivf(index).nprobe = 32
    for start in range(0, n, 65536):  # fp32 a block at a time: the keys stay fp16 in memory
        index.add(keys[start:start + 65536].astype(np.float32))
    return lambda queries, fetch: index.search(queries, fetch)


def evaluation_store(cfg, split: str, out: Path, corpus: str | None, progress: bool) -> tuple[ChunkStore, str]:
    """The chunks to score and their split: the training data's `split`, or a held-out corpus
    prepared into out/data (all of it, as its validation split)."""
    train_store = ChunkStore(cfg.data_dir)
    if not corpus:
        return train_store, split
    return prepare_heldout(cfg.data, corpus, out / "data", train_store, progress=progress), "validation"


def evaluation_inputs(cfg, models: list, checkpoints: list[Path], store: ChunkStore, split: str, neighbours,
                      curve: list) -> str:
    """The evaluation's manifest: what the report is computed from. report.json, written last,
    records it; a rerun with the same inputs reads the report back instead of scoring again."""
    return fingerprint({"models": [(name, sha256_file(model_dir_of(p) / "model.safetensors"),
                                    sha256_file(model_dir_of(p) / "config.json"))
                                   for (name, _), p in zip(models, checkpoints)],
                        "chunk_store": store.fingerprint, "split": split, "eval": vars(cfg.eval),
                        "reading": neighbours.reading.settings() if neighbours else None,
                        "neighbours": neighbours.manifest["fingerprint"] if neighbours else None,
                        "curve": [n.manifest["fingerprint"] for _, _, n in curve]})


def score(cfg, models: list, checkpoints: list[Path], store: ChunkStore, split: str, neighbours, curve: list,
          device: str, progress: bool) -> tuple[dict, dict]:
    """Every model scored on the split's chunks → (the report's rows and the rest evaluate_models
    gives, how each model was trained), warning first where bf16 is only emulated here."""
    slow = emulated_bf16("eval.precision", cfg.eval.precision, device)
    if slow:
        print(f"evaluate: warning: {slow}", file=sys.stderr, flush=True)
    trained = {name: how_trained(p, model.cfg.kind) for (name, model), p in zip(models, checkpoints)}  # before scoring
    chunks = store.split(split)
    bar = (lambda name: lambda xs: tqdm(xs, desc=f"eval {name}", leave=False, dynamic_ncols=True)) if progress else None
    rivals = RivalInputs(store.text_hashes(split), knn_datastore_index)
    report = evaluate_models(models, chunks, token_byte_lengths(get_tokenizer(store.manifest["tokenizer"])), cfg.eval,
                             neighbours, curve, progress=bar, device=device, rivals=rivals)
    return report, trained


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(__doc__, device=True)
    parser.add_argument("--checkpoint", action="append", required=True, type=Path,
                        help="a run directory or a model directory (repeatable)")
    parser.add_argument("--split", default=None, choices=["validation", "train"], help="default: validation")
    parser.add_argument("--corpus", default=None,
                        help="evaluate on this held-out corpus (file, directory or glob) instead of a split; "
                             "it is prepared with the training tokenizer and retrieves from the database")
    parser.add_argument("--database", default=None, type=Path,
                        help="retrieve from this database (a <workdir>/retrieval built by launch/build_index.py) "
                             "instead of the config's")
    parser.add_argument("--out", type=Path, default=None, help="report directory (default <workdir>/reports)")
    args = parser.parse_args(argv)
    quiet_engines(args.verbose)
    if args.corpus and args.split:
        parser.error("--corpus evaluates a whole held-out corpus; --split applies to the training data only")
    try:
        cfg = config_from_args(args)  # --print-config exits here, before any model is read
        if cfg.eval.retro_knn_lm and (args.corpus or args.database):
            raise ConfigError("eval.retro_knn_lm", "RETRO + kNN-LM is tuned on the training split with RETRO reading "
                                                   "its neighbours, which only the build's own database holds: "
                                                   "evaluate without --corpus and --database")
        device = resolve_device(args.device)
        for path in args.checkpoint:
            if not (model_dir_of(path) / "config.json").exists():
                raise DataError(f"--checkpoint {path}: no model there (expected a run directory with model/, "
                                f"or a directory with config.json and model.safetensors)")
        out = args.out or cfg.reports_dir
        if args.out is None and args.corpus:
            out = cfg.reports_dir / f"heldout-{path_tag(args.corpus)}"
        if args.out is None and args.database:
            out = out / f"database-{path_tag(str(args.database))}"
        report = evaluate(cfg, args.checkpoint, args.split or "validation", out, args.corpus, args.database,
                          device=device, progress=not args.no_progress)
    except (ConfigError, DataError, ValueError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    print(table(report))
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
