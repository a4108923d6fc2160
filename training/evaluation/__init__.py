"""retropipe.training.evaluation: a trained model used. The `eval` config section; bits per byte
with a sliding window (`scoring`); leakage α (`leakage`); the report's rows, RETRO ON / OFF /
SHUFFLED (`evaluate`); sampling with retrieval at every chunk boundary (`sampling`). Imports
models/ and retropipe.data; retrieval comes in as callbacks and neighbour sources.
"""
