"""retropipe.training.run: one training run, engine-free. The `train` config section; the run
directory and how a run starts (fresh, resumed, extended, branched); training sequences in a
resumable order; the loop that drives a pipeline through its methods; metrics, RNG state and
hardware (precision, threads, the matmul peak). Imports models/ and retropipe.data; the pipeline
comes in as an object (launch/train.py builds it), so nothing here imports deepspeed.

Its error, `TrainingError`, is defined here, at the package's root: this package, the pipeline
(training/pipeline/) and launch/train.py raise it, and each of them may import this one.
"""


class TrainingError(RuntimeError):
    """A problem found before or during training, with a message meant for the user."""
