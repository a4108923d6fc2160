"""Write a corpus of real documents in several real released versions: the source and documentation
files of a few Python libraries, each library in two or three releases from the package index.

    python bench/corpora/versions_corpus.py --out runs/versions/versions.jsonl [--packages SPEC] [--cache DIR]

SPEC: "name==v1,v2,v3;name==..." (default below). Every release is fetched as its source
distribution (`pip download --no-binary :all: --no-deps`, so this script needs the package index;
nothing else in RetroPipe does), and every text file of it (.py, .rst, .md, .txt; 200 B to 100 kB)
becomes one document with id "<name>-<version>:<path>" and fields package, version, path. Between
releases the authors edited these files: some are unchanged, most changed in places, some were
rewritten, added or removed. RetroPipe splits documents by a hash of their id, so the versions of
one file fall into the training and the validation split independently: a validation document's
other versions are in the training split, and so in the retrieval database built from it, as a
real database holds other versions of the text it is asked about (RETRO §2.6).

docs/results.md ("Real text in real versions") runs the demo's recipe on it:

    python launch/demo.py --set data.corpus=runs/versions/versions.jsonl --set workdir=runs/versions \\
        --set 'retrieval.corpora=[]' --set 'eval.database_curve=[]'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DEFAULT = "requests==2.20.0,2.25.1,2.31.0;click==7.1.2,8.0.4,8.1.7"  # e.g. also ";jinja2==2.11.3,3.0.3,3.1.4"
SUFFIXES = (".py", ".rst", ".md", ".txt")
MIN_BYTES, MAX_BYTES = 200, 100_000


def releases(spec: str) -> list[tuple[str, str]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, versions = item.split("==")
        out += [(name.strip(), v.strip()) for v in versions.split(",") if v.strip()]
    return out


def fetch(name: str, version: str, cache: Path) -> Path:
    """The release's source distribution, downloaded into cache once."""
    found = [p for p in cache.glob("*") if p.name.lower().replace("_", "-").startswith(f"{name.lower()}-{version}.")]
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"{name}=={version}", "-d", str(cache)], check=True)
    return fetch(name, version, cache)


def documents(name: str, version: str, archive: Path):
    """(path within the release, text) of every text file of the archive, sorted by path."""
    with tempfile.TemporaryDirectory() as tmp:
        if archive.suffix == ".zip":
            zipfile.ZipFile(archive).extractall(tmp)
        else:
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        for path in sorted(p for p in top.rglob("*") if p.is_file() and p.suffix in SUFFIXES):
            size = path.stat().st_size
            if MIN_BYTES <= size <= MAX_BYTES:
                text = path.read_text(encoding="utf-8", errors="replace")
                yield str(path.relative_to(top)), text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--packages", default=DEFAULT, help="name==v1,v2;name==...")
    parser.add_argument("--cache", type=Path, default=None, help="where releases are downloaded (default: beside --out)")
    args = parser.parse_args()
    cache = args.cache or args.out.parent / "releases"
    cache.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp, count = args.out.with_name(args.out.name + ".tmp"), 0
    with open(tmp, "w") as f:
        for name, version in releases(args.packages):
            for path, text in documents(name, version, fetch(name, version, cache)):
                f.write(json.dumps({"id": f"{name}-{version}:{path}", "text": text, "package": name,
                                    "version": version, "path": path}) + "\n")
                count += 1
    os.replace(tmp, args.out)
    print(f"{count} documents from {len(releases(args.packages))} releases in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
