"""What a run logs (rank 0): metrics.jsonl, and the same scalars plus the run's config in TensorBoard.

    log = MetricsLog(run_dir, start_step, cfg.to_dict())   # drops lines past start_step (a resume)
    log.write({"step": 1, "loss": 10.8, "lr": 0.0, ...})
    log.close()

TensorBoard (`<run>/tensorboard/`) gets every numeric field of a record as a scalar, the resolved
config as text (tag `config`) and as hyperparameters (the HPARAMS tab: every config key, e.g.
`train.lr`, against the metrics `loss`, `val_loss`, `val_bpb`), written into the run's own event
files so the HPARAMS tab lists the run under its own name.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from retropipe.training.run.run_dir import truncate_metrics

# The scalars the HPARAMS tab shows against the hyperparameters.
HPARAM_METRICS = ("loss", "val_loss", "val_bpb")


def hparams_of(cfg_dict: dict) -> dict:
    """The config as flat TensorBoard hyperparameters: "section.key" → number, string or bool
    (lists and mappings as their JSON text; None as "")."""
    flat = {}
    for section, values in cfg_dict.items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            name = f"{section}.{key}" if key else section
            if value is None:
                value = ""
            elif isinstance(value, (list, tuple, dict)):
                value = json.dumps(value, sort_keys=True)
            flat[name] = value
    return flat


def log_config(writer, cfg_dict: dict) -> None:
    """The resolved config as text and as hyperparameters, into `writer`'s own event file."""
    from torch.utils.tensorboard.summary import hparams

    text = yaml.safe_dump(cfg_dict, sort_keys=False)
    writer.add_text("config", "".join("    " + line + "\n" for line in text.splitlines()))  # markdown code
    # add_hparams would open a second event file in a subdirectory (a separate run in the UI).
    for summary in hparams(hparams_of(cfg_dict), {name: 0.0 for name in HPARAM_METRICS}):
        writer.file_writer.add_summary(summary)
    writer.flush()


class MetricsLog:
    def __init__(self, run_dir: Path, start_step: int, cfg_dict: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(run_dir) / "metrics.jsonl"
        truncate_metrics(self.path, start_step)  # lines after the checkpoint will be logged again
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        log_config(self.writer, cfg_dict)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and value is not None:
                self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()
