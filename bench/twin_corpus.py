"""Write a corpus of twin documents: every document of a corpus twice, the second an edited copy.

    python bench/twin_corpus.py [--corpus corpus/jargon_devil.jsonl.gz] [--drop 0.15] --out /tmp/twins.jsonl

The twin of a document drops a seeded random `--drop` share of its sentences (at least one when
it has two or more), so it is never an exact copy (those the retrieval database keeps out of a
document's own neighbours) but shares most of its text: where RETRO reads its neighbours, the
twin in the training split predicts the document in the validation split almost perfectly.
Documents and twins are written in a shuffled order under their own ids, so a document and its
twin seldom share a training sequence (whose documents neighbours may not come from).
The RETRO[ON] vs RETRO[OFF] goal on this corpus is in docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SENTENCE = re.compile(r"(?<=[.!?])\s+")


def edited(text: str, drop: float, rng: random.Random) -> str:
    """The text with a share of its sentences dropped (never all, at least one if there are two)."""
    sentences = [s for s in SENTENCE.split(text.strip()) if s.strip()]
    if len(sentences) < 2:
        words = text.split(" ")
        if len(words) < 4:
            return text + " (see also)"
        cut = rng.randrange(1, len(words) - 1)
        return " ".join(words[:cut] + words[cut + 1:])
    n = max(1, round(drop * len(sentences)))
    gone = set(rng.sample(range(len(sentences)), min(n, len(sentences) - 1)))
    return " ".join(s for i, s in enumerate(sentences) if i not in gone)


def main(argv: list[str] | None = None) -> int:
    from data.readers import BadRecords, read_documents

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(ROOT / "corpus" / "jargon_devil.jsonl.gz"))
    parser.add_argument("--drop", type=float, default=0.15, help="share of sentences the twin drops")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--edited-only", action="store_true",
                        help="write only the edited copies: a second edition to add to a database (retrieval.corpora)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    records = []
    for doc in read_documents(args.corpus, bad=BadRecords("skip")):
        if not args.edited_only:
            records.append({"id": doc.source_id, "text": doc.text})
        records.append({"id": f"{doc.source_id}#twin", "text": edited(doc.text, args.drop, rng)})
    rng.shuffle(records)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(args.out)
    print(f"wrote {len(records):,} documents to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
