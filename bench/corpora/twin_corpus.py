"""Write a corpus of twin documents: every document of a corpus twice, the second an edited copy.

    python bench/corpora/twin_corpus.py [--corpus corpus/jargon_devil.jsonl.gz] [--drop 0.15] --out /tmp/twins.jsonl
    python bench/corpora/twin_corpus.py --corpus long.jsonl --min-chars 3000 --max-chars 12000 --max-documents 500 ...

The twin of a document drops a seeded random `--drop` share of its sentences (at least one when
it has two or more), so it is never an exact copy (those the retrieval database keeps out of a
document's own neighbours) but shares most of its text: where RETRO reads its neighbours, the
twin in the training split predicts the document in the validation split almost perfectly.
Documents and twins are written in a shuffled order under their own ids, so a document and its
twin seldom share a training sequence (whose documents neighbours may not come from).
docs/results.md ("Twin documents") reports RETRO[ON] vs RETRO[OFF] on long twins.

Only chunks after a document's first can be helped (chunk u reads the neighbours of chunk u − 1),
so a corpus of short documents (the embedded dictionaries: 2.7 chunks each) bounds what copying
can gain overall; `--min-chars` / `--max-chars` / `--max-documents` draw a twin corpus of long
documents instead (a seeded sample of those in the length range).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SENTENCE = re.compile(r"(?<=[.!?])\s+")
SENTENCE_KEEP = re.compile(r"(?<=[.!?])(\s+)")  # the same split, keeping each separator


def edited(text: str, drop: float, rng: random.Random, reflow: bool = False) -> str:
    """The text with a share of its sentences dropped (never all, at least one if there are two).

    Everything else stays as it was, whitespace included, so the twin tokenizes like the original
    except where a sentence is gone. `reflow` also joins the kept sentences with one space: every
    newline after a sentence then becomes a space, which shifts the twin's tokens against the
    original's at every such sentence end (a harder twin; `--reflow`).
    """
    if reflow:
        sentences = [s for s in SENTENCE.split(text.strip()) if s.strip()]
        if len(sentences) < 2:
            return _one_word_less(text, rng)
        n = max(1, round(drop * len(sentences)))
        gone = set(rng.sample(range(len(sentences)), min(n, len(sentences) - 1)))
        return " ".join(s for i, s in enumerate(sentences) if i not in gone)
    pieces = SENTENCE_KEEP.split(text)            # sentence, separator, sentence, ..., sentence
    sentences, separators = pieces[0::2], pieces[1::2] + [""]
    real = [i for i, s in enumerate(sentences) if s.strip()]
    if len(real) < 2:
        return _one_word_less(text, rng)
    n = max(1, round(drop * len(real)))
    gone = set(rng.sample(real, min(n, len(real) - 1)))
    return "".join(s + sep for i, (s, sep) in enumerate(zip(sentences, separators)) if i not in gone)


def _one_word_less(text: str, rng: random.Random) -> str:
    """A document of one sentence: one word dropped (or a tag added), never an exact copy."""
    words = text.split(" ")
    if len(words) < 4:
        return text + " (see also)"
    cut = rng.randrange(1, len(words) - 1)
    return " ".join(words[:cut] + words[cut + 1:])


def main(argv: list[str] | None = None) -> int:
    from retropipe.data.corpus_formats import BadRecords, read_documents

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(ROOT / "corpus" / "jargon_devil.jsonl.gz"))
    parser.add_argument("--drop", type=float, default=0.15, help="share of sentences the twin drops")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-chars", type=int, default=0, help="keep documents of at least this many characters")
    parser.add_argument("--max-chars", type=int, default=0, help="keep documents of at most this many (0 = any)")
    parser.add_argument("--max-documents", type=int, default=0, help="a seeded sample of this many (0 = all)")
    parser.add_argument("--reflow", action="store_true",
                        help="join the twin's sentences with one space (the first version's twins; see edited())")
    parser.add_argument("--edited-only", action="store_true",
                        help="write only the edited copies: a second edition to add to a database (retrieval.corpora)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    docs = [doc for doc in read_documents(args.corpus, bad=BadRecords("skip"))
            if len(doc.text) >= args.min_chars and (not args.max_chars or len(doc.text) <= args.max_chars)]
    if args.max_documents and len(docs) > args.max_documents:
        docs = rng.sample(docs, args.max_documents)
    if not docs:
        parser.error(f"no document of {args.corpus} is in the length range --min-chars/--max-chars")
    records = []
    for doc in docs:
        if not args.edited_only:
            records.append({"id": doc.source_id, "text": doc.text})
        records.append({"id": f"{doc.source_id}#twin", "text": edited(doc.text, args.drop, rng, args.reflow)})
    rng.shuffle(records)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(args.out)
    print(f"wrote {len(records):,} documents to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
