"""retropipe.data: raw text → GPT-2 tokens → 64-token chunks in Arrow shards, and the read side of
what later stages write for them (the retrieval database's chunks, each chunk's neighbours, how a
chunk reads them). Plain numpy and pyarrow; imports nothing else of RetroPipe. Every error
RetroPipe shows its users is defined here (`errors`), the one module every package may import.
"""
