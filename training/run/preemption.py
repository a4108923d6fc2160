"""A scheduler's signal is an expected event: SIGTERM or SIGUSR1 saves a checkpoint and ends the job.

    preemption = Preemption(grace=cfg.train.preempt_grace).install()   # in the main thread, first thing
    ...
    if preemption.agreed(device):      # after every step, on every rank (one all-reduce of a flag)
        save(step); exit(PREEMPTED)

Slurm (`scancel`, preemption, `--signal`), Kubernetes evictions and spot reclaims all start with
SIGTERM (Slurm's `--signal=USR1@T` sends SIGUSR1 T seconds ahead), and DeepSpeed's launcher passes
a SIGTERM it gets on to its ranks. The signal may reach one rank, one node or all of them; a rank
that got it cannot stop alone (its peers would wait in the next step's collectives), so after each
step every rank adds its own flag into one all-reduce and all stop at the same step, write the
checkpoint of that step together, and exit with PREEMPTED. Rerun, the job resumes from that step.

A rank blocked in a collective runs no Python, so the signal is also read from a wakeup pipe by
the watchdog's thread (training/run/cluster.py), which calls `request`. Whatever happens after the
signal (a hung peer, a slow filesystem), every process is gone `grace` seconds after it came:
a deadline thread exits with PREEMPTED, saying which checkpoint the rerun resumes from.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from retropipe.data.stage import PREEMPTED  # the exit code of a preempted rank (and of any stopped stage)
from retropipe.data.stage import SCHEDULER_SIGNALS as SIGNALS


class Preemption:
    def __init__(self, grace: float, resume_hint=lambda: "its newest checkpoint", log=None, exit_fn=os._exit):
        self.grace, self.resume_hint, self.exit_fn = float(grace), resume_hint, exit_fn
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.signum, self.signal_name = 0, None
        self._requested = threading.Event()
        self._lock = threading.Lock()

    def install(self) -> "Preemption":
        """Take SIGTERM and SIGUSR1 (call from the main thread, before the work starts)."""
        for signum in SIGNALS:
            signal.signal(signum, lambda signum, frame: self.request(signum))
        return self

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def request(self, signum: int) -> None:
        """A signal came: stop at the end of this step; exit by the deadline whatever happens."""
        with self._lock:
            if self._requested.is_set():
                return
            self.signum, self.signal_name = int(signum), signal.Signals(signum).name
            self._requested.set()
        deadline = threading.Timer(self.grace, self._expire)
        deadline.daemon = True
        deadline.start()

    def agreed(self, device: str | torch.device) -> bool:
        """True on every rank when any rank was signalled (a collective: every rank calls it after
        every step). The signal's number travels, so every rank names it."""
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.requested:  # another rank's signal: this rank's deadline starts too
            self.request(int(flag.item()))
        return bool(flag.item())

    def _expire(self) -> None:
        self.log(f"train: preempted ({self.signal_name}) and not done within train.preempt_grace "
                 f"({self.grace:g} s); rerun the same command to resume from {self.resume_hint()}")
        time.sleep(0.2)
        self.exit_fn(PREEMPTED)
