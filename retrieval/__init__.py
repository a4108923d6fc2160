"""retropipe.retrieval: the retrieval database's build and query side: BERT embeddings of every
chunk, the FAISS index, each chunk's neighbours, retrieval for new text. Imports retropipe.data;
Ray only in its adapter (`ray_embed`); never retropipe.training.

Its one error, `RetrievalError`, is defined here, at the package's root, where each of its modules
and the entry point that builds the database (launch/build_index.py) import it from.
"""

from retropipe.data.errors import DataError


class RetrievalError(DataError):
    """A bad retrieval input or a stale/corrupt retrieval file; the message names the file or key.

    A DataError, so whatever catches DataError catches it. Raised by this package only: data's own
    read side of the database (data/database_reader.py, data/neighbour_store.py) raises plain
    DataErrors, so the class is not data's."""
