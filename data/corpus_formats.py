"""Stream documents out of raw corpora: .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, and a
directory saved by Hugging Face `datasets` (`save_to_disk`).

Readers yield one `Document` at a time so memory does not grow with the corpus. Problems
with a record are reported through `BadRecords`: by default the first one raises
`DataError` naming the file and line; with `on_bad_record="skip"` it is counted instead.
Text is normalised once here (BOM dropped, CRLF → LF, NUL bytes removed, invalid UTF-8
replaced; with data.whitespace "collapse", every run of whitespace one space) so every later
stage sees exactly the bytes we count for bits per byte.
"""

from __future__ import annotations

import glob
import gzip
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from retropipe.data.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
# What `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` write at the top of a directory.
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
# The `corpora` extra holds the readers' optional libraries.
INSTALL_HINT = "pip install 'retropipe[corpora]'"


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
    if root.is_dir() and is_saved_dataset(root):
        return [(root, root.name)]  # one input: read through datasets.load_from_disk
    if root.is_dir():
        files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name.endswith(SUFFIXES)]
        found = [(p, p.relative_to(root).as_posix()) for p in files]
        if not found and any(root.glob("*.arrow")):
            raise DataError(f"data.corpus={corpus!r}: holds .arrow files but is not a directory saved by "
                            f"datasets' save_to_disk (no {' or '.join(SAVED_DATASET_FILES)})")
    else:
        found = [(Path(p), Path(p).name) for p in sorted(glob.glob(corpus, recursive=True))
                 if Path(p).is_file() and p.endswith(SUFFIXES)]
    if not found:
        raise DataError(f"data.corpus={corpus!r}: no input files found (expected a file, a directory or a glob "
                        f"of {', '.join(SUFFIXES)}, or a directory saved by datasets' save_to_disk)")
    return found


def is_saved_dataset(path: Path) -> bool:
    return any((Path(path) / name).is_file() for name in SAVED_DATASET_FILES)


def normalise(text: str, bad: BadRecords, whitespace: str = "keep") -> str:
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\x00" in text:
        bad.repaired("nul_bytes_removed")
        text = text.replace("\x00", "")
    if whitespace == "collapse":  # data.whitespace
        return " ".join(text.split())
    return text.replace("\r\n", "\n")


def _decode(raw: bytes, bad: BadRecords) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        bad.repaired("invalid_utf8_replaced")
        return raw.decode("utf-8", errors="replace")


def read_txt(path: Path, name: str, bad: BadRecords) -> Iterator[Document]:
    yield Document(name, _decode(path.read_bytes(), bad))


def zstd_lines(f) -> Iterator[bytes]:
    """The lines of a zstd stream, through the zstandard library, across every frame it holds (a .zst
    may be several frames end to end); a stream that ends inside a frame is a DataError (truncated),
    which zstandard's stream reader would not report."""
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{getattr(f, 'name', 'a .zst file')}: reading .jsonl.zst needs the zstandard package: "
                        f"{INSTALL_HINT}") from None
    # 2 GiB: files compressed with `zstd --long` use windows beyond zstandard's default limit.
    dctx = zstandard.ZstdDecompressor(max_window_size=2 ** 31)
    frame, in_frame, tail = dctx.decompressobj(), False, b""
    block = f.read(1 << 20)
    while block:
        try:
            out = frame.decompress(block)
        except zstandard.ZstdError as e:
            raise DataError(f"{f.name}: not a readable zstd file ({e})") from None
        in_frame = True
        *lines, tail = (tail + out).split(b"\n")
        yield from (line + b"\n" for line in lines)
        if frame.eof:  # this frame is complete; what is left starts the next one
            block, frame, in_frame = frame.unused_data, dctx.decompressobj(), False
        else:
            block = b""
        block = block or f.read(1 << 20)
    if in_frame and not frame.eof:
        raise DataError(f"{f.name}: truncated zstd file (it ends inside a frame)")
    if tail:
        yield tail


def read_jsonl(path: Path, name: str, bad: BadRecords, text_field: str, id_field: str) -> Iterator[Document]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for line_no, raw in enumerate(zstd_lines(f) if path.name.endswith(".zst") else f, start=1):
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
    batches = (batch.to_pydict() for batch in pf.iter_batches(batch_size=1024, columns=wanted))
    yield from column_rows(batches, str(path), name, bad, text_field, id_field)


def column_rows(batches: Iterator[dict], where: str, prefix: str, bad: BadRecords, text_field: str,
                id_field: str) -> Iterator[Document]:
    """Documents from batches of columns ({column: values}); a row without an id is `prefix:row`."""
    row = 0
    for batch in batches:
        ids = batch.get(id_field, [None] * len(batch[text_field]))
        for text, rid in zip(batch[text_field], ids):
            row += 1
            if not isinstance(text, str):
                bad.bad("non_string_text", f"{where}:row {row}", f"column {text_field!r} is not a string")
                continue
            yield Document(str(rid) if rid is not None else f"{prefix}:{row}", text)


def read_saved_dataset(path: Path, name: str, bad: BadRecords, text_field: str, id_field: str) -> Iterator[Document]:
    """Rows of a directory saved by `datasets` (a Dataset, or every split of a DatasetDict in its order)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: a saved Hugging Face dataset; reading it needs the datasets package: "
                        f"{INSTALL_HINT}") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # whatever load_from_disk finds wrong with the directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: not a readable saved Hugging Face dataset (datasets.load_from_disk: {first})") \
            from None
    splits = list(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split, ds in splits:
        where = f"{path}" + (f" (split {split!r})" if split else "")
        if text_field not in ds.column_names:
            raise DataError(f"{where}: no column {text_field!r} (data.text_field); columns are {ds.column_names}")
        wanted = [text_field] + ([id_field] if id_field in ds.column_names and id_field != text_field else [])
        prefix = f"{name}/{split}" if split else name
        yield from column_rows(ds.select_columns(wanted).iter(batch_size=1024), where, prefix, bad, text_field, id_field)


def read_documents(corpus: str, text_field: str = "text", id_field: str = "id", bad: BadRecords | None = None,
                   max_documents: int = 0, whitespace: str = "keep") -> Iterator[Document]:
    """Every non-empty document of the corpus, normalised (whitespace: data.whitespace), in a
    deterministic order."""
    bad = bad if bad is not None else BadRecords()
    kept = 0
    for path, name in resolve_inputs(corpus):
        if path.is_dir():
            docs = read_saved_dataset(path, name, bad, text_field, id_field)
        elif path.name.endswith(".txt"):
            docs = read_txt(path, name, bad)
        elif path.name.endswith(".parquet"):
            docs = read_parquet(path, name, bad, text_field, id_field)
        else:
            docs = read_jsonl(path, name, bad, text_field, id_field)
        for doc in docs:
            doc.text = normalise(doc.text, bad, whitespace)
            if not doc.text.strip():
                bad.repaired("empty_documents_skipped")
                continue
            yield doc
            kept += 1
            if max_documents and kept >= max_documents:
                return
