"""Every error RetroPipe reports to its users, in one module that every package may import.

An entry point catches these and prints one line (`<entry>: error: <message>`, exit code 2); the
message names the file, line or config key and what to run. Anything else is a bug and keeps
its traceback.

    ConfigError       a config key's value is unknown, of the wrong type or impossible
    DataError         bad input data, or a stage's files missing or made for other inputs
      StageError        a stage file missing, corrupt or stale
      RetrievalError    a bad retrieval input or a stale or corrupt retrieval file
    TokenizerError    the tokenizer's files are missing or altered
    ModelFormatError  a model directory that is not ours, or does not match its config
      HFFormatError     a Hugging Face GPT-2 directory we cannot read or compute the same
    TrainingError     a training run cannot start or continue as asked
    ClusterError      joining a Ray cluster failed
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


class RetrievalError(DataError):
    """A bad retrieval input or a stale/corrupt retrieval file; the message names the file or key."""


class TokenizerError(RuntimeError):
    """The tokenizer cannot be loaded as asked (a missing package, altered files, an unknown name)."""


class ModelFormatError(ValueError):
    """A model directory that is not a RetroPipe model, or whose weights do not match its config."""


class HFFormatError(ModelFormatError):
    """A Hugging Face GPT-2 directory that cannot be read, or a variant we do not compute the same."""


class TrainingError(RuntimeError):
    """A problem found before or during training, with a message meant for the user."""


class ClusterError(RuntimeError):
    """Joining a Ray cluster failed; the message says what to set."""
