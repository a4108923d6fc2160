"""The errors every package may raise (ConfigError, DataError), and those of data's own stages.

An entry point catches RetroPipe's errors and prints one line (`<entry>: error: <message>`, exit
code 2); the message names the file, line or config key and what to run. Anything else is a bug
and keeps its traceback.

    ConfigError       a config key's value is unknown, of the wrong type or impossible
    DataError         bad input data, or a stage's files missing or made for other inputs
      StageError        a stage file missing, corrupt or stale
    TokenizerError    the tokenizer's files are missing or altered

The other packages' errors live with the code that raises them:

    RetrievalError    (a DataError) a bad retrieval input or file    retrieval/__init__.py
    ModelFormatError  a model directory not ours, or not its config  training/models/io.py
      HFFormatError     a Hugging Face GPT-2 we cannot read           training/models/hf_interop.py
    TrainingError     a run cannot start or continue as asked        training/run/__init__.py
    ClusterError      joining a Ray cluster failed                   launch/ray_utils.py

`BUILD_DATABASE`, the command to name when the retrieval database is missing or stale, is here
because data's read side of the database (database_reader.py, neighbour_store.py) says it too.
"""

from __future__ import annotations

# What to run when the retrieval database (or part of it) is missing or stale.
BUILD_DATABASE = "python launch/build_index.py --config <your config>"


class ConfigError(ValueError):
    """A config value is unknown, of the wrong type or impossible. `key` is dotted (data.chunk_len),
    or a command-line flag (--device) for a setting that only the command line gives."""

    def __init__(self, key: str, message: str, source: str | None = None):
        self.key, self.source = key, source
        where = f" in {source}" if source else ""
        what = f"flag '{key}'" if key.startswith("--") else f"config key '{key}'"
        super().__init__(f"{what}{where}: {message}")


class DataError(ValueError):
    """Bad input data or a bad data directory; the message names the file (and line)."""


class StageError(DataError):
    """A stage file is missing, corrupt or stale; the message names the file and what to rerun."""


class TokenizerError(RuntimeError):
    """The tokenizer cannot be loaded as asked (a missing package, altered files, an unknown name)."""
