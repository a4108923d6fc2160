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
import contextlib
import logging
import os
import signal
import sys
from typing import Callable

import yaml

from retropipe.data.errors import ConfigError
from retropipe.data.stage import PREEMPTED, SCHEDULER_SIGNALS
from retropipe.launch.config import Config, load_config


def entry_parser(doc: str | None, config: bool = True, progress: bool = True, device: bool = False,
                 ray: bool = False, **kwargs) -> argparse.ArgumentParser:
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
    if ray:
        parser.add_argument("--address", default=None,
                            help="join this Ray cluster (HOST:PORT, or auto: the one `ray start` runs here); default: "
                                 "RAY_ADDRESS, else a private local Ray. With token authentication: RAY_AUTH_MODE=token")
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
    import torch  # local: every entry point imports this module, and prepare_data never needs torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", "cuda was asked for, but torch sees no GPU here (use --device cpu)")
    return name


# The environment variable that carries --verbose to every process started from an entry point
# (Ray workers, DeepSpeed ranks, the demo's stages), which read it through `engines_verbose`.
VERBOSE_ENV = "RETROPIPE_VERBOSE"


def engines_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_engines(verbose: bool) -> None:
    """The engines' console output at WARNING unless --verbose, so RetroPipe's own lines and bars stand out.

    Quiet means: Ray, Ray Data and DeepSpeed log warnings and errors only (their full
    logs stay in their files: Ray's session logs, ray-data.log); Ray Data's progress blocks and bars
    give way to RetroPipe's bars (retrieval/ray_embed.py); model-loading bars are hidden
    (retrieval/embedder.py). Everything is set through loggers here and environment variables that
    the processes started from here inherit.
    """
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    verbose = engines_verbose()
    level = logging.INFO if verbose else logging.WARNING
    for name in ("ray", "ray.data", "ray.train", "deepspeed", "DeepSpeed", "torch.distributed"):
        logging.getLogger(name).setLevel(level)
    if not verbose:
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")  # one line for what every worker prints alike
        # A local Ray's notice that it turned token authentication on (it listens on this machine
        # only and stops with the command): news to nobody running a RetroPipe CLI.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


class Stopped(KeyboardInterrupt):
    """A scheduler's signal (SIGTERM, SIGUSR1) ended a data or retrieval stage, raised in the main
    thread where it was when the signal came. Everything on disk is whole (data/stage.py writes
    through temp files) and the finished work units are kept: the same command resumes.

    A KeyboardInterrupt, as Ctrl-C's is: Ray's waits (ray.get, ray.wait) end at once for one and
    for nothing else, raising a plain KeyboardInterrupt in its place (`stopped` finds the signal
    behind it), and no `except Exception` on the way takes a stop for an error."""

    def __init__(self, signum: int):
        self.signum, self.signal_name = int(signum), signal.Signals(signum).name
        super().__init__(self.signal_name)

    def line(self, entry: str) -> str:
        return (f"{entry}: stopped by {self.signal_name}; the finished work is kept: rerun the same command "
                f"to resume (exit {PREEMPTED})")


_stops: list[Stopped] = []   # the stop requested within stop_on_signals, for `stopped`


def request_stop(signum: int) -> Stopped:
    """Record a stop (the first signal's) and return it to raise; later signals are ignored, so
    that they cannot cut the clean-up short."""
    for each in SCHEDULER_SIGNALS:
        signal.signal(each, signal.SIG_IGN)
    if not _stops:
        _stops.append(Stopped(signum))
    return _stops[0]


def stop_requested() -> bool:
    return bool(_stops)


def stopped(error: BaseException) -> Stopped | None:
    """The stop behind `error`: itself, or the KeyboardInterrupt a Ray wait raised in its place;
    None for Ctrl-C."""
    if isinstance(error, Stopped):
        return error
    return _stops[0] if isinstance(error, KeyboardInterrupt) and _stops else None


@contextlib.contextmanager
def stop_on_signals():
    """Within: SIGTERM and SIGUSR1 raise `Stopped` in the main thread (enter from it; the Ray
    executor takes them back from ray.init, launch/ray_utils.py). The handlers before are restored."""
    def stop(signum, frame):
        raise request_stop(signum)

    _stops.clear()
    previous = {signum: signal.getsignal(signum) for signum in SCHEDULER_SIGNALS}
    for signum in SCHEDULER_SIGNALS:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def run_stopping(entry: str, work: Callable[[], int]) -> int:
    """work()'s exit code, within stop_on_signals; a stop is one line and PREEMPTED."""
    try:
        with stop_on_signals():
            return work()
    except KeyboardInterrupt as e:
        stop = stopped(e)
        if stop is None:
            raise
        print(stop.line(entry), file=sys.stderr)
        return PREEMPTED
