"""Stream documents out of raw corpora: .txt, .jsonl, .jsonl.gz and .parquet.

Readers yield one `Document` at a time so memory does not grow with the corpus. Problems
with a record are reported through `BadRecords`: by default the first one raises
`DataError` naming the file and line; with `on_bad_record="skip"` it is counted instead.
Text is normalised once here (BOM dropped, CRLF → LF, NUL bytes removed, invalid UTF-8
replaced) so every later stage sees exactly the bytes we count for bits per byte.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")


class DataError(ValueError):
    """Bad input data or a bad data directory; the message names the file (and line)."""


@dataclass
class Document:
    source_id: str  # the record's id field, or "<file>:<line>" when it has none
    text: str


@dataclass
class BadRecords:
    """Counts what was skipped or repaired; raises on the first bad record in 'error' mode."""

    mode: str = "error"
    counts: Counter = field(default_factory=Counter)

    def bad(self, kind: str, where: str, why: str) -> None:
        if self.mode == "error":
            raise DataError(f"{where}: {why} (set data.on_bad_record=skip to skip and count such records)")
        self.counts[kind] += 1

    def repaired(self, kind: str) -> None:
        self.counts[kind] += 1


def resolve_inputs(corpus: str) -> list[tuple[Path, str]]:
    """(path, name used in ids) of every input file named by a file, directory or glob, sorted."""
    root = Path(corpus)
    if root.is_file():
        return [(root, root.name)]
    if root.is_dir():
        files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name.endswith(SUFFIXES)]
        found = [(p, p.relative_to(root).as_posix()) for p in files]
    else:
        found = [(Path(p), Path(p).name) for p in sorted(glob.glob(corpus, recursive=True))
                 if Path(p).is_file() and p.endswith(SUFFIXES)]
    if not found:
        raise DataError(f"data.corpus={corpus!r}: no input files found "
                        f"(expected a file, a directory or a glob of {', '.join(SUFFIXES)})")
    return found


def normalise(text: str, bad: BadRecords) -> str:
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\x00" in text:
        bad.repaired("nul_bytes_removed")
        text = text.replace("\x00", "")
    return text.replace("\r\n", "\n")


def _decode(raw: bytes, bad: BadRecords) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        bad.repaired("invalid_utf8_replaced")
        return raw.decode("utf-8", errors="replace")


def read_txt(path: Path, name: str, bad: BadRecords) -> Iterator[Document]:
    yield Document(name, _decode(path.read_bytes(), bad))


def read_jsonl(path: Path, name: str, bad: BadRecords, text_field: str, id_field: str) -> Iterator[Document]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                if not raw.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    record = json.loads(_decode(raw, bad), strict=False)  # strict=False: raw control chars
                except json.JSONDecodeError as e:
                    bad.bad("malformed_json", where, f"malformed JSON ({e.msg} at column {e.colno})")
                    continue
                if not isinstance(record, dict) or text_field not in record:
                    bad.bad("missing_text", where, f"record has no text field {text_field!r} (data.text_field)")
                    continue
                text = record[text_field]
                if not isinstance(text, str):
                    bad.bad("non_string_text", where, f"field {text_field!r} is {type(text).__name__}, not a string")
                    continue
                rid = record.get(id_field)
                yield Document(str(rid) if rid is not None else f"{name}:{line_no}", text)
    except (OSError, EOFError) as e:  # truncated gzip, unreadable file
        raise DataError(f"{path}: cannot read ({e})") from None


def read_parquet(path: Path, name: str, bad: BadRecords, text_field: str, id_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path}: no column {text_field!r} (data.text_field); columns are {columns}")
    wanted = [text_field] + ([id_field] if id_field in columns else [])
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=wanted):
        data = batch.to_pydict()
        ids = data.get(id_field, [None] * batch.num_rows)
        for text, rid in zip(data[text_field], ids):
            row += 1
            if not isinstance(text, str):
                bad.bad("non_string_text", f"{path}:row {row}", f"column {text_field!r} is not a string")
                continue
            yield Document(str(rid) if rid is not None else f"{name}:{row}", text)


def read_documents(corpus: str, text_field: str = "text", id_field: str = "id",
                   bad: BadRecords | None = None, max_documents: int = 0) -> Iterator[Document]:
    """Every non-empty document of the corpus, normalised, in a deterministic order."""
    bad = bad if bad is not None else BadRecords()
    kept = 0
    for path, name in resolve_inputs(corpus):
        if path.name.endswith(".txt"):
            docs = read_txt(path, name, bad)
        elif path.name.endswith(".parquet"):
            docs = read_parquet(path, name, bad, text_field, id_field)
        else:
            docs = read_jsonl(path, name, bad, text_field, id_field)
        for doc in docs:
            doc.text = normalise(doc.text, bad)
            if not doc.text.strip():
                bad.repaired("empty_documents_skipped")
                continue
            yield doc
            kept += 1
            if max_documents and kept >= max_documents:
                return


def file_size(corpus: str) -> int:
    return sum(os.path.getsize(p) for p, _ in resolve_inputs(corpus))
