"""bench/corpora/twin_corpus.py: the twin documents behind the RETRO[ON] vs RETRO[OFF] goal (docs/results.md)."""

import json
import random
import sys

from tests.distributed import ROOT

sys.path.insert(0, str(ROOT / "bench" / "corpora"))
from twin_corpus import edited, main  # noqa: E402

TEXT = "Booting needs a loader.\nIt runs first.  It sets up RAM.\n\nThen it calls\nthe kernel. Done!\n"


def test_a_twin_drops_whole_sentences_and_keeps_every_other_byte():
    for seed in range(20):
        twin = edited(TEXT, 0.3, random.Random(seed))
        assert twin != TEXT and len(twin) < len(TEXT)
        # What is left is the original minus whole sentences: each kept sentence with its own
        # whitespace (newlines included), so the twin tokenizes like the original around it.
        kept = [s for s in ("Booting needs a loader.\n", "It runs first.  ", "It sets up RAM.\n\n",
                            "Then it calls\nthe kernel. ", "Done!\n") if s in twin]
        assert "".join(kept) == twin and 2 <= len(kept) <= 4
    # --reflow: the first version's twins (one space between sentences), reproduced exactly.
    assert edited(TEXT, 0.3, random.Random(0), reflow=True) == "Booting needs a loader. It runs first. It sets up RAM."
    # One sentence: one word dropped, never an exact copy.
    assert edited("a single sentence of words", 0.3, random.Random(0)) != "a single sentence of words"


def test_long_document_twins_are_drawn_by_length(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": TEXT * (i + 1)}) + "\n" for i in range(6)))
    out = tmp_path / "twins.jsonl"
    assert main(["--corpus", str(corpus), "--min-chars", str(2 * len(TEXT)), "--max-chars", str(5 * len(TEXT)),
                 "--max-documents", "3", "--out", str(out)]) == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    originals = {i for i in ids if not i.endswith("#twin")}
    assert len(ids) == 6 and len(originals) == 3 and originals <= {"d1", "d2", "d3", "d4"}
    assert {f"{i}#twin" for i in originals} == set(ids) - originals
