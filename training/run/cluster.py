"""What a run on several nodes guards against: a run directory that is not shared between the
nodes (`check_shared_run_dir`), and a lost or hung rank (`Watchdog`: the whole job ends within
train.dist_timeout).

Not shared, the nodes would each decide alone whether the run starts fresh or resumes, and hang
when they disagree; so right after the process group forms, rank 0 writes a file there that every
rank must see.

A rank that is killed leaves its peers a reset socket, but one that hangs (a stuck GPU, a stalled
filesystem, a stopped process, a partitioned host) leaves them waiting in their next collective,
silent, for as long as the process group's timeout. So every rank runs a daemon thread that,
every `interval` seconds, bumps its own counter in the job's rendezvous store (the TCPStore at
MASTER_ADDR:MASTER_PORT, which rank 0 hosts and every rank joined), reads the counters of the
ranks it watches and the job's abort flag:
  - a watched counter that has not moved for `timeout` seconds (by this rank's own clock, so
    hosts' clocks need not agree): that rank is lost; this rank raises the abort flag naming it,
    prints one line and exits 1;
  - the abort flag raised: print its line and exit 1 (within `interval` of the first detection);
  - the store unreachable for `timeout` seconds: rank 0, which hosts it, is lost.
Each rank watches the next WATCHED ranks around the ring, so every rank has watchers and the
store's load grows with the world, not its square. A rank whose collective fails first (a peer's
socket reset) asks `culprit()` which rank stopped, to say so in one line.

Plain torch.distributed (the watchdog has a TCPStore client of its own, so its thread never shares
a socket with the process group); launch/train.py calls both right after the process group forms.
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from retropipe.training.run import TrainingError

PREFIX = "retropipe/watchdog/"
WATCHED = 8          # ranks each rank watches (the next ones around the ring)


def check_shared_run_dir(run_dir: Path, device: str = "cpu") -> None:
    """Every rank sees what rank 0 writes into run_dir; a TrainingError on every rank otherwise."""
    rank = dist.get_rank()
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = Path(run_dir) / f".shared-{token[0]}"
    if rank == 0:
        marker.write_text(socket.gethostname())
    dist.barrier()
    blind = torch.tensor([0 if rank == 0 or sees_file(marker, shared_wait()) else 1], device=device)
    seen = [torch.zeros_like(blind) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, blind)
    dist.barrier()
    if rank == 0:
        marker.unlink(missing_ok=True)
    missing = [r for r, b in enumerate(seen) if int(b)]
    if missing:
        raise TrainingError(f"{run_dir} is not shared between the nodes: rank(s) {missing} do not see the file rank 0 "
                            f"wrote there; put workdir on storage every node mounts at the same path "
                            f"(docs/cluster.md)")


def shared_wait() -> float:
    """Seconds a rank waits to see rank 0's file: an NFS client caches "no such file" for up to
    30-60 s (acdirmin/acdirmax), and every rank looked into the run directory before rank 0 made
    it. RETROPIPE_SHARED_WAIT shortens it where a test refuses an unshared directory."""
    return float(os.environ.get("RETROPIPE_SHARED_WAIT", 60))


def sees_file(path: Path, wait: float) -> bool:
    """path is a file, now or within `wait` seconds. Listing its directories asks the server again
    where a network filesystem answers a lookup from its cache."""
    deadline = time.monotonic() + wait
    while True:
        for folder in (path.parent.parent, path.parent):
            try:
                os.listdir(folder)
            except OSError:
                pass
        if path.is_file():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))


def set_collective_timeout(seconds: float) -> int:
    """Every process group of this rank (the world's and those DeepSpeed made for its stages,
    replicas and tied weights, which torch gives its 10 or 30 minute default) fails a collective
    after `seconds`; the number of groups set. Call it once the groups exist."""
    from torch.distributed import distributed_c10d as c10d

    groups = list(getattr(getattr(c10d, "_world", None), "pg_map", {}) or [])
    for group in groups:
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    return len(groups)


def collective_timeout(timeout: float) -> float:
    """The process groups' collective timeout for a watchdog of `timeout`: late enough that the
    watchdog names a lost rank first. A healthy wait lasts under `timeout` (train.dist_timeout's
    contract), so a peer lost during a collective is named at most 2 × timeout + a beat after the
    collective began. NCCL aborts the whole process when a collective times out (torch's own
    watchdog thread, SIGABRT), before the line naming the lost rank could be printed."""
    return 2 * timeout + 2 * interval_for(timeout) + 10


def interval_for(timeout: float) -> float:
    """Seconds between beats: several beats per timeout, at most 5 s."""
    return min(5.0, max(timeout / 5, 0.5))


class Watchdog:
    def __init__(self, rank: int, world: int, timeout: float, host: str | None = None, port: int | None = None,
                 exit_fn=os._exit, log=None, on_signal=None):
        self.rank, self.world, self.timeout = rank, world, float(timeout)
        self.on_signal = on_signal  # called with a signal number that came while the main thread waits
        self.interval = interval_for(self.timeout)
        self.exit_fn, self.log = exit_fn, log or (lambda line: print(line, file=sys.stderr, flush=True))
        host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(port or os.environ.get("MASTER_PORT", 29500))
        self.store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(self.interval, 1.0)))
        node = os.environ.get("CROSS_RANK") or os.environ.get("GROUP_RANK") or "?"
        self.store.set(f"{PREFIX}where/{rank}", f"node {node}, host {socket.gethostname()}")
        self.store.set(f"{PREFIX}pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self.watched = [(rank + d) % world for d in range(1, min(world, WATCHED + 1))]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="retropipe-watchdog", daemon=True)
        self._wake = None
        # Store calls go through one worker thread with a deadline: a TCPStore call to a stopped
        # host never returns (its socket stays open), and the watchdog must notice that too.
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="retropipe-store")
        self._exiting = threading.Lock()
        self._pids: dict[int, str] = {}     # "host pid" of the watched ranks and rank 0, once known

    def _call(self, fn, *args):
        """store.fn(*args), or TimeoutError after two beats."""
        return self._calls.submit(fn, *args).result(timeout=2 * self.interval)

    def start(self) -> "Watchdog":
        """Beat, and watch from a thread of its own; call from the main thread (it sets the wakeup fd)."""
        self._beat()
        self._read_signals()
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank is done (its watchers stop expecting beats from it); the thread ends."""
        self._stop.set()
        try:
            self._call(self.store.set, f"{PREFIX}done/{self.rank}", "1")
        except Exception:  # rank 0 finished first and took the store with it: nothing to tell
            pass

    # -- the store --
    def _beat(self) -> None:
        self._call(self.store.add, f"{PREFIX}beat/{self.rank}", 1)

    def _counters(self, ranks) -> dict[int, int]:
        return {r: self._call(self.store.add, f"{PREFIX}beat/{r}", 0) for r in ranks}

    def _done(self, rank: int) -> bool:
        return self._call(self.store.check, [f"{PREFIX}done/{rank}"])

    def _aborted(self) -> str | None:
        """The cause another rank has ended the job for, or None."""
        if self._call(self.store.check, [f"{PREFIX}abort"]):
            return self._call(self.store.get, f"{PREFIX}abort").decode()
        return None

    def where(self, rank: int) -> str:
        try:
            return self._call(self.store.get, f"{PREFIX}where/{rank}").decode()
        except Exception:  # the store is gone, or that rank never got so far
            return "where unknown"

    # -- ending the job --
    def abort(self, cause: str, lost: int | None = None) -> None:
        """Tell every rank to exit for this cause (the first one set wins), end the lost rank if it
        runs on this host, then exit."""
        try:
            self._call(self.store.compare_set, f"{PREFIX}abort", "", cause)
            cause = self._aborted() or cause
            if lost is not None:
                self._end_if_here(lost)
        except Exception:
            pass
        self._exit(cause)

    def _learn_pids(self) -> None:
        """Where the watched ranks and rank 0 run, kept: rank 0 may be lost with the store."""
        for r in {0, *self.watched} - set(self._pids) - {self.rank}:
            if self._call(self.store.check, [f"{PREFIX}pid/{r}"]):
                self._pids[r] = self._call(self.store.get, f"{PREFIX}pid/{r}").decode()

    def _end_if_here(self, rank: int) -> None:
        """SIGKILL a lost rank that runs on this host. A stopped or hung process ignores the
        SIGTERM its launcher sends when a sibling exits, and the launcher waits 30 s before it
        kills; killed now, its node's launcher exits as soon as this rank does."""
        try:
            if rank not in self._pids:
                self._pids[rank] = self._call(self.store.get, f"{PREFIX}pid/{rank}").decode()
            host, pid = self._pids[rank].rsplit(" ", 1)
            if host != socket.gethostname():
                return
            with open(f"/proc/{pid}/cmdline", "rb") as f:   # still a rank, not a reused pid
                if b"train.py" in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except Exception:  # unknown, elsewhere, or gone already: its launcher ends it
            pass

    def _exit(self, cause: str) -> None:
        """One line, then exit 1 (once: the watchdog and the main thread may both get here)."""
        if not self._exiting.acquire(blocking=False):
            time.sleep(3600)  # the other thread is exiting the process
        self.log(f"train: error: {cause}; rank {self.rank} exits, and so does every other")
        if self.rank == 0:  # it hosts the store: the others read the abort flag before it goes
            time.sleep(4 * self.interval + 1)
        self.exit_fn(1)

    # -- the thread --
    def _read_signals(self) -> None:
        """SIGTERM and SIGUSR1 (training/run/preemption.py holds their handlers) are also read from
        a wakeup pipe by this thread: a Python handler runs only once the main thread leaves the
        collective it waits in, and a preempted rank must not wait for that to start its deadline."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._wake = read

    def _signals(self) -> list[int]:
        try:
            return list(os.read(self._wake, 64))
        except (BlockingIOError, TypeError):
            return []

    def _run(self) -> None:
        last_seen = {r: (-1, time.monotonic()) for r in self.watched}
        unreachable_since = None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                for signum in self._signals():
                    if self.on_signal and signum in (signal.SIGTERM, signal.SIGUSR1):
                        self.on_signal(signum)
                self._beat()
                self._learn_pids()
                cause = self._aborted()
                if cause:
                    self._exit(cause)
                    return
                for r, count in self._counters(self.watched).items():
                    if count != last_seen[r][0]:
                        last_seen[r] = (count, now)
                    elif now - last_seen[r][1] > self.timeout and not self._done(r):
                        self.abort(lost_cause(r, self.where(r), silent_for(now - last_seen[r][1])), lost=r)
                        return
                unreachable_since = None
            except Exception:  # the store (rank 0's) does not answer
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.timeout:
                    self._end_if_here(0)  # pid known from before
                    self._exit(lost_cause(0, "the rendezvous store's host", silent_for(now - unreachable_since)))
                    return

    def end(self, why: str) -> None:
        """The job failed here (a collective broke): exit naming the rank that
        stopped beating, or the cause another rank named already. Returns only when every rank
        still beats (the failure is this rank's own: the caller re-raises it)."""
        lost = None
        try:
            cause = self._aborted()
            if cause is None:
                lost = self._stopped_beating()
                cause = self._aborted()       # another rank may have named it meanwhile
            if cause is None:
                if lost is None:
                    return
                cause = lost_cause(lost, self.where(lost), why)
        except Exception:  # the store does not answer: rank 0, its host, is gone
            self._end_if_here(0)
            self._exit(lost_cause(0, "the rendezvous store's host", "it stopped answering"))
            return
        self.abort(cause, lost)

    def _stopped_beating(self) -> int | None:
        """The first rank whose counter does not move over 3 beats (an abort flag raised meanwhile
        ends the wait), or None."""
        everyone = [r for r in range(self.world) if r != self.rank]
        first = self._counters(everyone)
        for _ in range(3):
            time.sleep(self.interval)
            self._beat()  # this rank is alive while it looks (it may be the watchdog thread looking)
            if self._aborted():
                return None
        now = self._counters(everyone)
        stuck = [r for r in everyone if now[r] == first[r] and not self._done(r)]
        return stuck[0] if stuck else None


def lost_cause(rank: int, where: str, why: str) -> str:
    return f"lost rank {rank} ({where}): {why}"


def silent_for(seconds: float) -> str:
    return f"no sign of it for {seconds:.0f} s (killed, stopped or hung, or its host is gone)"
