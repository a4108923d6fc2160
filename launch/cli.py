"""What every entry point's command line shares: the config flags, --print-config, --verbose,
--no-progress, --device, and quiet engine logs.

    parser = entry_parser(__doc__, device=True)
    parser.add_argument(...)              # the entry point's own flags
    args = parser.parse_args(argv)
    quiet_engines(args.verbose)
    cfg = config_from_args(args)          # prints the resolved config and exits with --print-config

`--help` shows the module docstring whole (its usage examples), not just its first line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

from data.config import ConfigError
from launch.config import Config, load_config


def entry_parser(doc: str | None, config: bool = True, progress: bool = True, device: bool = False,
                 **kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    if config:
        parser.add_argument("--config", default=None, help="YAML config (e.g. configs/tiny.yaml)")
        parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                            help="override one config key, e.g. --set data.chunk_len=32 (repeatable)")
        parser.add_argument("--print-config", action="store_true",
                            help="print the resolved config (YAML, after --set) and exit without running")
    parser.add_argument("--verbose", action="store_true",
                        help="show Ray's and DeepSpeed's own INFO logs (default: warnings and errors only)")
    if progress:
        parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    if device:
        parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                            help="where the model runs: auto = cuda when a GPU is visible, else cpu")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """The resolved config; with --print-config, print it as YAML and exit 0."""
    cfg = load_config(args.config, args.overrides)
    if getattr(args, "print_config", False):
        sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        raise SystemExit(0)
    return cfg


def resolve_device(name: str) -> str:
    """'auto' → 'cuda' where a GPU is visible, else 'cpu'; 'cuda' without one is a ConfigError."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", "cuda was asked for, but torch sees no GPU here (use --device cpu)")
    return name


def quiet_engines(verbose: bool) -> None:
    """Ray and DeepSpeed log at WARNING unless --verbose, so RetroPipe's own lines stand out.

    Sets environment variables too, so that Ray workers and DeepSpeed ranks started from here
    inherit the level (RETROPIPE_VERBOSE=1 is how --verbose reaches them).
    """
    if verbose:
        os.environ["RETROPIPE_VERBOSE"] = "1"
    verbose = verbose or os.environ.get("RETROPIPE_VERBOSE") == "1"
    level = logging.INFO if verbose else logging.WARNING
    for name in ("ray", "ray.data", "ray.train", "deepspeed", "DeepSpeed", "torch.distributed"):
        logging.getLogger(name).setLevel(level)
    if not verbose:
        os.environ.setdefault("RAY_LOG_TO_STDERR", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")
