"""Models (GPT-2 baseline, RETRO), their layer list for pipeline stages, and model I/O.

`load_model`, `save_model` and `retrofit` are imported lazily, so `training.config` (read by
launch/config.py for every stage) does not pull in torch.
"""

_EXPORTS = {"load_model": "training.model_io", "save_model": "training.model_io",
            "load_pretrained": "training.model_io", "retrofit": "training.retro"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
