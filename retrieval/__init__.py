"""retropipe.retrieval: the retrieval database's build and query side: BERT embeddings of every
chunk, the FAISS index, each chunk's neighbours, retrieval for new text. Imports retropipe.data;
Ray only in its adapter (`ray_embed`); never retropipe.training.
"""
