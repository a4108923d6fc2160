"""What a chunk reads: the one place that decides which tokens of its neighbours a chunk is given,
at training, evaluation and generation alike.

    reading = Reading.for_evaluation(cfg.retrieval)    # lined up, and only those that line up
    tokens = reading.tokens(database, ids, query)      # ids (..., k) → (..., k, r) int64, -1 = missing
    reading.settings()                                 # what a report's or a run's fingerprint records

The neighbour ids come from a source: `data.neighbour_store.NeighbourStore` (computed for every chunk
of a split by the retrieval build or an evaluation) or `retrieval.query.Retriever` (a live search
for new text); both hand them to their `Reading`, which decides the rest:
  - `align`: each neighbour window slides along its document to line up with the query chunk
    (below); off, a neighbour is the paper's [N, F], its chunk and the chunk after;
  - `aligned_only`: a neighbour that does not line up is dropped (all -1);
  - `shuffled`: chunk u reads the neighbours retrieved for chunk `shuffled_order(...)[u]`, a chunk
    of another document, as retrieved ([N, F]): neither lined up with u nor filtered, whatever
    `align` and `aligned_only` say. Evaluation's RETRO[SHUFFLED] row: text that does not belong,
    the same on every evaluation path (the training data, a held-out corpus, another database).
Training reads `Reading.for_training` (aligned, unfiltered: filtered there too, the trunk came
out worse, docs/results.md); evaluation and generation `Reading.for_evaluation`. Every field
enters `settings()`, so a new rule here changes every report's fingerprint by itself.

Alignment. RETRO feeds chunk u's neighbours [N, F] (neighbour chunk, continuation) to the tokens
that follow chunk u, so a neighbour helps most when F continues the text exactly where chunk u
stops. A near-duplicate in the database (another edition of a page, a quoted paragraph, a twin
document with a sentence dropped) is found by its embedding, but its chunk boundaries fall at
another phase of the shared text: N holds the query's tokens shifted by s, and F is s tokens off
too. A model as small as ours learns to copy a neighbour at a fixed offset quickly, and a
content-addressed copy at an arbitrary offset slowly (docs/results.md), so the window moves
instead of the model having to.

For each neighbour we take the 4 · chunk_len tokens of its document around it (the chunk before,
the chunk, and two after) and count, for every shift s in (-chunk_len, chunk_len), the tokens of
the query chunk that equal the window's tokens at the same position. A neighbour whose best shift
matches fewer than `MIN_MATCH_FRACTION` of chunk_len does not line up and stays as retrieved
(s = 0). Otherwise it becomes the 2 · chunk_len tokens starting s after its chunk's start, where
s lines up the *end* of the query chunk: the most matches among its last chunk_len / 8 tokens
(when some shift matches at least 3/8 of those), then the most matches overall, then the smallest
|s|. The end decides because F is read right after it: where the two texts differ by an inserted
or dropped phrase, the shift with the most matches overall can line up the query's first half and
leave F off by the phrase's length (on techdocs' dictionaries, 34% of the tokens of high-overlap
chunks lined up with their neighbour that way, 54% this way; docs/results.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

MIN_MATCH_FRACTION = 0.25    # of chunk_len: 16 of 64 tokens; unrelated text matches ~3 by chance
TAIL_FRACTION = 1 / 8        # of chunk_len: the query's last 8 of 64 tokens decide the shift ...
TAIL_MIN_FRACTION = 3 / 8    # ... when some shift matches 3 of those 8 (a single token matches by chance)
# The alignment rule's name in evaluation reports' fingerprints and training runs' rules.json (another
# rule, another report, another run): change it with any constant above.
ALIGNMENT_RULE = "end-first/8"
# The seed of the SHUFFLED permutation.
SHUFFLE_SEED = 0


def best_shifts(query: np.ndarray, region: np.ndarray, min_match: int) -> tuple[np.ndarray, np.ndarray]:
    """query (n, m) tokens (-1 = none), region (n, 4m) tokens (-1 = none) whose [m, 2m) is the retrieved
    chunk: (n,) int64 shift s in (-m, m) by the rule above (matches at s: #{t : query[t] ==
    region[m + s + t] >= 0}), 0 where no shift has min_match matches; and (n,) bool: whether one has
    (the neighbour lines up)."""
    n, m = query.shape
    tail = max(1, round(TAIL_FRACTION * m))
    shifts = np.arange(-(m - 1), m)                               # (S,)
    index = m + shifts[:, None] + np.arange(m)[None, :]           # (S, m) positions in region
    matches = np.zeros((n, len(shifts)), dtype=np.int64)
    tail_matches = np.zeros((n, len(shifts)), dtype=np.int64)
    for start in range(0, n, 256):                                # bounds the (rows, S, m) temporary
        q = query[start:start + 256, None, :]                     # (rows, 1, m)
        window = region[start:start + 256][:, index]              # (rows, S, m)
        equal = (window == q) & (q >= 0)
        matches[start:start + 256] = equal.sum(-1)
        tail_matches[start:start + 256] = equal[..., -tail:].sum(-1)
    # Where no shift lines up the end well enough, the tail counts nothing and matches decide alone.
    end_lines_up = tail_matches.max(axis=1, keepdims=True) >= max(1, round(TAIL_MIN_FRACTION * tail))
    tail_matches = np.where(end_lines_up, tail_matches, 0)
    # Lexicographic (tail matches, matches, -|s|): each term's range is below the weight of the one before.
    score = (tail_matches * (m + 1) + matches) * (2 * m) - np.abs(shifts)[None, :]
    best = np.argmax(score, axis=1)
    lined_up = matches.max(axis=1) >= min_match
    return np.where(lined_up, shifts[best], 0), lined_up


def aligned_windows(region: np.ndarray, shifts: np.ndarray, r: int) -> np.ndarray:
    """region (n, 4m), shifts (n,) -> (n, r) tokens region[m + s : m + s + r]."""
    m = region.shape[1] // 4
    index = m + shifts[:, None] + np.arange(r)[None, :]
    return np.take_along_axis(region, index, axis=1)


def shuffled_order(doc_index: np.ndarray, seed: int = SHUFFLE_SEED) -> np.ndarray:
    """A permutation p of the chunks with doc_index[p[u]] != doc_index[u] for every u (seeded), as long
    as no document holds more than half of the chunks: chunks are laid out document by document
    (documents in random order) and each takes the chunk half the layout away."""
    n = len(doc_index)
    rng = np.random.default_rng(seed)
    docs, inverse = np.unique(doc_index, return_inverse=True)
    rank = rng.permutation(len(docs))[inverse]                       # each chunk's document's random place
    layout = np.lexsort((np.arange(n), rank))                        # chunks, grouped by document
    order = np.empty(n, dtype=np.int64)
    order[layout] = layout[(np.arange(n) + n // 2) % n]
    return order


def in_context_tokens(read: np.ndarray, text: np.ndarray) -> np.ndarray:
    """What a GPT-2 reads when its neighbours go in its context (In-Context RALM, and the
    in-context-trained GPT-2): read (k, r) the neighbours of the chunk before the scored one, best
    first, -1 = missing; text (n,) the text ending with the scored chunk. The neighbours' present
    tokens, the best one last (next to the text it continues), then the text: (≤ k·r + n,) int64."""
    return np.concatenate([*(row[row >= 0] for row in read[::-1]), np.asarray(text, dtype=np.int64)])


def in_context_text_chunks(window: int, chunk_len: int, k: int, key: str) -> int:
    """T: the whole chunks of text a window of `window` tokens holds beside k neighbours of
    2 · chunk_len tokens; at least 2 (the scored chunk and the one its neighbours were retrieved for)."""
    T = (window - k * 2 * chunk_len) // chunk_len
    if T < 2:
        raise ValueError(f"{key} {k}: {k} neighbours of {2 * chunk_len} tokens leave {max(T, 0)} chunks of a "
                         f"{window}-token window for the text; at least 2 are needed (the chunk scored and the "
                         f"one its neighbours were retrieved for)")
    return T


@dataclass(frozen=True)
class Reading:
    """How a chunk reads its neighbours (see the module docstring)."""

    align: bool = False
    aligned_only: bool = False
    shuffled: bool = False

    def __post_init__(self):
        if self.aligned_only and not self.align:
            raise ValueError("Reading: aligned_only keeps the neighbours that line up, so it needs align")

    @classmethod
    def for_training(cls, retrieval_cfg) -> "Reading":
        """What training reads: lined up (retrieval.align_neighbours), never filtered."""
        return cls(align=retrieval_cfg.align_neighbours)

    @classmethod
    def for_evaluation(cls, retrieval_cfg) -> "Reading":
        """What evaluation and generation read: lined up, and only those that line up (retrieval.aligned_only)."""
        return cls(align=retrieval_cfg.align_neighbours,
                   aligned_only=retrieval_cfg.align_neighbours and retrieval_cfg.aligned_only)

    def but(self, **changes) -> "Reading":
        """This reading with some fields changed (e.g. shuffled=True for the SHUFFLED row)."""
        return dataclasses.replace(self, **changes)

    @property
    def alignment_rule(self) -> str | None:
        """The name of the alignment rule applied, None when neighbours are not aligned."""
        return ALIGNMENT_RULE if self.align else None

    def settings(self) -> dict:
        """Every field and the alignment rule's name: for fingerprints of what was computed."""
        return {**dataclasses.asdict(self), "alignment_rule": self.alignment_rule}

    def source_chunks(self, chunk_ids: np.ndarray, order: np.ndarray | None) -> np.ndarray:
        """The chunks whose neighbours chunk_ids (...) read: themselves, or when shuffled another
        document's, by `order` (the split's `shuffled_order`, which the caller computes once)."""
        chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        return order[chunk_ids] if self.shuffled else chunk_ids

    def tokens(self, database, ids: np.ndarray, query: np.ndarray | None = None) -> np.ndarray:
        """Neighbour tokens of database ids (..., k), -1 = none: (..., k, r) int64, -1 = missing.

        query (..., chunk_len) int64, -1 = none: the tokens of the chunks the neighbours were
        retrieved for; needed to line them up (without it, or with align off, [N, F] as retrieved).
        database: a data.database_reader.Database.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if not self.align or self.shuffled or query is None:
            return database.neighbour_tokens(ids)
        m, k = database.chunk_len, ids.shape[-1]
        region = database.regions(ids).reshape(-1, 4 * m)                                 # (.. k, 4m)
        q = np.repeat(np.asarray(query, dtype=np.int64).reshape(-1, m), k, axis=0)       # (.. k, m)
        shifts, lined_up = best_shifts(q, region, min_match=int(MIN_MATCH_FRACTION * m))
        shifts[ids.reshape(-1) < 0] = 0
        windows = aligned_windows(region, shifts, database.r)                            # (.. k, r)
        if self.aligned_only:
            windows[~lined_up] = -1
        return windows.reshape(*ids.shape, database.r)
