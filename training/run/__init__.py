"""retropipe.training.run: one training run, engine-free. The `train` config section; the run
directory and how a run starts (fresh, resumed, extended, branched); training sequences in a
resumable order; the loop that drives a pipeline through its methods; metrics, RNG state and
hardware (precision, threads, the matmul peak). Imports models/ and retropipe.data; the pipeline
comes in as an object (launch/train.py builds it), so nothing here imports deepspeed.
"""
