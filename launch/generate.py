"""Sample text from a trained GPT-2 or RETRO; RETRO retrieves at every chunk boundary.

    python launch/generate.py --config configs/tiny.yaml --checkpoint runs/tiny/runs/retro \\
        --prompt "A bore is" [--max-new-tokens 128] [--temperature 0.8] [--top-k 50] [--top-p 0.95] \\
        [--seed 0] [--neighbours K] [--show-neighbours] [--device auto|cpu|cuda]

A checkpoint is a run directory (its model/ is read) or a model directory. RETRO queries the
database in <workdir>/retrieval/ (launch/build_index.py) with its own embedder, for every chunk
it completes and once for the prompt's partial last chunk (the rule: training/sampling.py).
--neighbours 0 runs RETRO[OFF], without a database. Prints the prompt and its continuation on
stdout, a summary line on stderr; --show-neighbours adds, per retrieval, the chunk's text and
its neighbours (→ their continuations).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.config import ConfigError
from data.readers import DataError
from data.tokenizer import TokenizerError
from launch.cli import config_from_args, entry_parser, quiet_engines, resolve_device
from launch.evaluate import model_dir_of


@dataclass
class Result:
    out: object            # training.sampling.Generation
    ids: list              # (k,) neighbour names ("train chunk 12") of each retrieval, in the order of out.retrievals
    encoding: object       # the tiktoken encoding
    k: int                 # neighbours per chunk (0: GPT-2 or RETRO[OFF])
    chunk_len: int


def open_retrieval(cfg, model_cfg, k: int | None, device: str, database: Path | None = None):
    """(Retriever, k, tokenizer name) for a RETRO model, or a clear error; k None = eval.neighbours."""
    from data.neighbours import check_neighbour_count
    from retrieval.query import Retriever, check_database

    root = Path(database or cfg.retrieval_dir)
    check_database(root)  # first, so that a missing database names build_index
    retriever = Retriever(root, cfg.retrieval, device=device)
    if retriever.database.chunk_len != model_cfg.chunk_len:
        raise DataError(f"the model's chunk_len ({model_cfg.chunk_len}) differs from the database's "
                        f"({retriever.database.chunk_len}, {root}): it was trained on other data")
    asked = "eval.neighbours" if k is None else "--neighbours"
    k = check_neighbour_count(cfg.eval.neighbours if k is None else k, retriever.k, f"the database at {root}", asked)
    return retriever, k, retriever.database.tokenizer


def run(args) -> Result:
    """Load the model, wire retrieval to it, sample."""
    from data.tokenizer import get_tokenizer
    from training import load_model
    from training.sampling import check_sampling, generate

    cfg = config_from_args(args)  # --print-config exits here, before any model is read
    device = resolve_device(args.device)
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 0 or (args.neighbours or 0) < 0:
        raise ValueError("--max-new-tokens and --neighbours must be >= 0")
    model_dir = model_dir_of(args.checkpoint)
    if not (model_dir / "config.json").exists():
        raise DataError(f"--checkpoint {args.checkpoint}: no model there (expected a run directory with model/, "
                        f"or a directory with config.json and model.safetensors)")
    model = load_model(model_dir, device=device)
    retriever, k, tokenizer = None, 0, cfg.data.tokenizer
    if model.cfg.kind == "retro" and args.neighbours != 0:
        retriever, k, tokenizer = open_retrieval(cfg, model.cfg, args.neighbours, device, args.database)
    elif model.cfg.kind == "gpt2" and args.neighbours:
        raise ValueError(f"--neighbours {args.neighbours}: {model_dir} is a GPT-2 model, which takes no neighbours")
    encoding = get_tokenizer(tokenizer)
    eot_id = encoding.eot_token
    prompt = encoding.encode_ordinary(args.prompt) or [eot_id]  # no prompt: start a new document
    if max(prompt) >= model.cfg.vocab_size:
        raise ValueError(f"tokenizer {tokenizer!r} gives id {max(prompt)}, beyond the model's vocab_size "
                         f"({model.cfg.vocab_size})")
    ids = []

    def retrieve(chunk_tokens: list[int], chunk: int):
        from retrieval.query import query_text

        query = np.full((1, model.cfg.chunk_len), -1, dtype=np.int64)
        tokens = chunk_tokens[:model.cfg.chunk_len]
        query[0, :len(tokens)] = tokens
        found, tokens = retriever.query([query_text(chunk_tokens, encoding, eot_id)], k, query)  # (1, k), (1, k, r)
        ids.append([chunk_name(retriever.database, i) for i in found[0]])
        return tokens[0]

    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, eot_id=eot_id, retrieve=retrieve if retriever else None)
    return Result(out, ids, encoding, k, model.cfg.chunk_len)


def chunk_name(database, db_id: int) -> str:
    """A database id as its part and chunk: "train chunk 12" (the training split), "<corpus> chunk 3"."""
    if db_id < 0:
        return "none"
    part, local = database.locate(np.array([db_id]))
    return f"{database.parts[int(part[0])].name} chunk {int(local[0])}"


def shorten(text: str, width: int) -> str:
    """One quoted line: newlines shown as ⏎, cut to width characters with an ellipsis."""
    text = text.replace("\n", "⏎")
    return repr(text if len(text) <= width else text[:width - 1] + "…")


def show(encoding, tokens, width: int) -> str:
    """A query or neighbour for --show-neighbours; end-of-text stays visible (a document's end)."""
    ids = [int(t) for t in tokens if t >= 0]
    return shorten(encoding.decode(ids), width) if ids else "(none)"


def print_retrievals(r: Result) -> None:
    m = r.chunk_len
    print(f"\n--- neighbours: {r.k} per chunk; chunk u's neighbours steer the tokens from its last token on")
    for event, ids in zip(r.out.retrievals, r.ids):
        u = event.chunk
        query = r.out.tokens[u * m:u * m + event.query_len]
        partial = f", partial ({event.query_len} of {m} tokens)" if event.query_len < m else ""
        print(f"chunk {u} (tokens {u * m}-{(u + 1) * m - 1}{partial}), retrieved at length {event.seq_len}: "
              f"{show(r.encoding, query, 72)}")
        for j, (where, row) in enumerate(zip(ids, event.neighbours)):
            print(f"  {j + 1}. {where}: {show(r.encoding, row[:m], 48)} → {show(r.encoding, row[m:], 48)}")


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(__doc__, device=True)
    parser.add_argument("--checkpoint", required=True, type=Path, help="a run directory or a model directory")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50, help="0 = off")
    parser.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--neighbours", type=int, default=None,
                        help="RETRO neighbours per chunk (default eval.neighbours; 0 = RETRO[OFF], no database)")
    parser.add_argument("--show-neighbours", action="store_true", help="print the neighbours of every retrieval")
    parser.add_argument("--database", type=Path, default=None,
                        help="retrieve from this database (a <workdir>/retrieval built by launch/build_index.py) "
                             "instead of the config's")
    args = parser.parse_args(argv)
    quiet_engines(args.verbose)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        r = run(args)
    except (ConfigError, DataError, TokenizerError, ValueError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    print(r.encoding.decode([t for t in r.out.tokens if t != r.encoding.eot_token]))
    stop = "end-of-text" if r.out.stop == "eot" else f"--max-new-tokens {args.max_new_tokens}"
    print(f"[{len(r.out.new_tokens)} new tokens, stopped at {stop}, {len(r.out.retrievals)} retrievals]",
          file=sys.stderr)
    if args.show_neighbours and r.out.retrievals:
        print_retrievals(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
