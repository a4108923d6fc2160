"""retropipe.training.models: what the networks compute, in plain torch. The `model` config
section; GPT-2 (`gpt2`), RETRO as its subclass with its retrieval encoder (`retro`), its chunked
cross-attention and copy gate (`cca`) and the rotary attention both use (`rotary_attention`); the
layer list both models are built from (`layers`), which pipeline stages are cut from; the fused
output head (`lm_head`); FLOP estimates; our model directory and Hugging Face GPT-2 interchange
(`io`, `hf_interop`). Imports torch and retropipe.data only. A new model variant is a class here.

Its error, `ModelFormatError`, is defined here, at the package's root: io.py and hf_interop.py
(which io.py imports) both raise it, and each may import this one.
"""


class ModelFormatError(ValueError):
    """A model directory that is not a RetroPipe model, or whose weights do not match its config."""
