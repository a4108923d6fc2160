"""Sample text from a trained GPT-2 or RETRO; RETRO retrieves at every chunk boundary.

    python launch/generate.py --config configs/tiny.yaml --checkpoint runs/tiny/runs/retro \\
        --prompt "A bore is" [--max-new-tokens 128] [--temperature 0.8] [--top-k 50] [--top-p 0.95] \\
        [--seed 0] [--num-samples 1] [--neighbours K] [--show-neighbours] [--device auto|cpu|cuda]
    python launch/generate.py --config configs/tiny.yaml --checkpoint runs/tiny/runs/gpt2 \\
        --prompt-file prompts.txt --num-samples 3 --temperature 0   # one prompt per line

A checkpoint is a run directory (its model/ is read) or a model directory. RETRO queries the
database in <workdir>/retrieval/ (launch/build_index.py) with its own embedder, for every chunk
it completes and once for the prompt's partial last chunk (the rule: training/evaluation/sampling.py).
--neighbours 0 runs RETRO[OFF], without a database. Decoding uses a key/value cache (same tokens
as without; --no-cache turns it off). Prints the prompt and its continuation on stdout, a summary
line on stderr; --show-neighbours adds, per retrieval, the chunk's text and its neighbours
(→ their continuations).

--prompt-file: one prompt per line, taken as written (no trailing newline); empty lines are
skipped, so a prompt cannot contain a newline (use --prompt for that). --num-samples N: N
samples of every prompt, computed as one batch; sample j is seeded with --seed + j, the same
tokens as a run with --num-samples 1 --seed <seed + j>. With more than one output, each is
headed by a line "=== prompt P of Q, sample J of N (seed S) ===".
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from retropipe.data.errors import ConfigError, DataError, TokenizerError
from retropipe.data.neighbour_store import check_neighbour_count
from retropipe.data.tokenizer import get_tokenizer
from retropipe.launch.cli import config_from_args, entry_parser, quiet_engines, resolve_device
from retropipe.launch.evaluate import model_dir_of
from retropipe.retrieval.query import Retriever, check_database, query_text
from retropipe.training.evaluation.sampling import check_sampling, generate_samples
from retropipe.training.models.io import load_model


@dataclass
class Result:
    prompts: list[str]
    outs: list             # per prompt: its samples, training.evaluation.sampling.Generation each
    names: dict            # (chunk, query tokens) → (k,) neighbour names ("train chunk 12")
    encoding: object       # the tiktoken encoding
    k: int                 # neighbours per chunk (0: GPT-2 or RETRO[OFF])
    chunk_len: int


def read_prompts(args) -> list[str]:
    """--prompt, or the lines of --prompt-file (empty ones skipped)."""
    if args.prompt_file is None:
        return [args.prompt]
    path = args.prompt_file
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"--prompt-file {path}: cannot read it ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"--prompt-file {path}, line {line}: not UTF-8 text") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise DataError(f"--prompt-file {path}: holds no prompt (one per line; empty lines are skipped)")
    return prompts


def open_retrieval(cfg, model_cfg, k: int | None, device: str, database: Path | None = None):
    """(Retriever, k, tokenizer name) for a RETRO model, or a clear error; k None = eval.neighbours."""
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
    cfg = config_from_args(args)  # --print-config exits here, before any model is read
    device = resolve_device(args.device)
    check_request(args)
    prompts = read_prompts(args)
    model, model_dir = load_checkpoint(args.checkpoint, device)
    retriever, k, tokenizer = None, 0, cfg.data.tokenizer
    if model.cfg.retrieves and args.neighbours != 0:
        retriever, k, tokenizer = open_retrieval(cfg, model.cfg, args.neighbours, device, args.database)
    elif not model.cfg.retrieves and args.neighbours:
        raise ValueError(f"--neighbours {args.neighbours}: {model_dir} is a GPT-2 model, which takes no neighbours")
    encoding = get_tokenizer(tokenizer)
    encoded = encode_prompts(prompts, encoding, tokenizer, model.cfg.vocab_size, args.prompt_file)
    names = {}
    retrieve = retrieval_for(retriever, k, encoding, model.cfg.chunk_len, names) if retriever else None
    bar = tqdm(encoded, desc="prompts", leave=False, dynamic_ncols=True,
               disable=args.no_progress or len(encoded) == 1)
    outs = [generate_samples(model, prompt, args.max_new_tokens, args.num_samples, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, eot_id=encoding.eot_token,
                             retrieve=retrieve, cache=not args.no_cache) for prompt in bar]
    return Result(prompts, outs, names, encoding, k, model.cfg.chunk_len)


def check_request(args) -> None:
    """The sampling flags' values, refused before anything is loaded."""
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 0 or (args.neighbours or 0) < 0:
        raise ValueError("--max-new-tokens and --neighbours must be >= 0")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")


def load_checkpoint(checkpoint: Path, device: str):
    """(model, its model directory) of --checkpoint: a run directory or a model directory."""
    model_dir = model_dir_of(checkpoint)
    if not (model_dir / "config.json").exists():
        raise DataError(f"--checkpoint {checkpoint}: no model there (expected a run directory with model/, "
                        f"or a directory with config.json and model.safetensors)")
    return load_model(model_dir, device=device), model_dir


def encode_prompts(prompts: list[str], encoding, tokenizer: str, vocab_size: int, prompt_file: Path | None):
    """Each prompt's token ids (an empty one: end-of-text, a new document); an id beyond the model's
    vocabulary is a ValueError naming the prompt."""
    eot_id = encoding.eot_token
    encoded = [encoding.encode_ordinary(p) or [eot_id] for p in prompts]  # no prompt: start a new document
    for i, prompt in enumerate(encoded):
        if max(prompt) >= vocab_size:
            where = f"--prompt-file {prompt_file}, prompt {i + 1}" if prompt_file else "--prompt"
            raise ValueError(f"{where}: tokenizer {tokenizer!r} gives id {max(prompt)}, beyond the model's "
                             f"vocab_size ({vocab_size})")
    return encoded


def retrieval_for(retriever, k: int, encoding, chunk_len: int, names: dict) -> Callable:
    """generate_samples' retrieve(chunk_tokens, chunk) → the (k, r) neighbour tokens of the chunk,
    their names recorded into `names` under (chunk, its tokens) for --show-neighbours."""
    eot_id = encoding.eot_token

    def retrieve(chunk_tokens: list[int], chunk: int):
        query = np.full((1, chunk_len), -1, dtype=np.int64)
        tokens = chunk_tokens[:chunk_len]
        query[0, :len(tokens)] = tokens
        found, tokens = retriever.query([query_text(chunk_tokens, encoding, eot_id)], k, query)  # (1, k), (1, k, r)
        names[chunk, tuple(chunk_tokens)] = [chunk_name(retriever.database, i) for i in found[0]]
        return tokens[0]

    return retrieve


NO_NEIGHBOUR = "none"  # the name of a missing neighbour (the database holds fewer than k)


def chunk_name(database, db_id: int) -> str:
    """A database id as its part and chunk: "train chunk 12" (the training split), "<corpus> chunk 3"."""
    if db_id < 0:
        return NO_NEIGHBOUR
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


def print_retrievals(r: Result, out) -> None:
    m = r.chunk_len
    print(f"\n--- neighbours: {r.k} per chunk; chunk u's neighbours steer the tokens from its last token on")
    for event in out.retrievals:
        u = event.chunk
        query = out.tokens[u * m:u * m + event.query_len]
        partial = f", partial ({event.query_len} of {m} tokens)" if event.query_len < m else ""
        print(f"chunk {u} (tokens {u * m}-{(u + 1) * m - 1}{partial}), retrieved at length {event.seq_len}: "
              f"{show(r.encoding, query, 72)}")
        for j, (where, row) in enumerate(zip(r.names[u, tuple(query)], event.neighbours)):
            if where != NO_NEIGHBOUR and (np.asarray(row) < 0).all():  # found, then not read
                print(f"  {j + 1}. {where}: not read, it does not line up with the chunk (retrieval.aligned_only)")
                continue
            print(f"  {j + 1}. {where}: {show(r.encoding, row[:m], 48)} → {show(r.encoding, row[m:], 48)}")


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(__doc__, device=True)
    parser.add_argument("--checkpoint", required=True, type=Path, help="a run directory or a model directory")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue (default: none, a new document)")
    prompt.add_argument("--prompt-file", type=Path, default=None, metavar="PATH",
                        help="UTF-8 file of prompts, one per line (empty lines skipped)")
    parser.add_argument("--num-samples", type=int, default=1, metavar="N",
                        help="samples per prompt, as one batch; sample j is seeded --seed + j")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="stop after N new tokens")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50, help="0 = off")
    parser.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first sample (sample j: seed + j)")
    parser.add_argument("--no-cache", action="store_true",
                        help="rerun the whole context at every step instead of the key/value cache (same tokens)")
    parser.add_argument("--neighbours", type=int, default=None, metavar="K",
                        help="RETRO neighbours per chunk (default eval.neighbours; 0 = RETRO[OFF], no database)")
    parser.add_argument("--show-neighbours", action="store_true", help="print the neighbours of every retrieval")
    parser.add_argument("--database", type=Path, default=None,
                        help="retrieve from this database (a <workdir>/retrieval built by launch/build_index.py) "
                             "instead of the config's")
    args = parser.parse_args(argv)
    quiet_engines(args.verbose)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        r = run(args)
    except (ConfigError, DataError, TokenizerError, ValueError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    many = len(r.outs) > 1 or args.num_samples > 1
    for p, samples in enumerate(r.outs):
        for j, out in enumerate(samples):
            if many:
                print(f"=== prompt {p + 1} of {len(r.outs)}, sample {j + 1} of {args.num_samples} "
                      f"(seed {args.seed + j}) ===")
            print(r.encoding.decode([t for t in out.tokens if t != r.encoding.eot_token]))
            stop = "end-of-text" if out.stop == "eot" else f"--max-new-tokens {args.max_new_tokens}"
            print(f"[{len(out.new_tokens)} new tokens, stopped at {stop}, {len(out.retrievals)} retrievals]",
                  file=sys.stderr)
            if args.show_neighbours and out.retrievals:
                print_retrievals(r, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
