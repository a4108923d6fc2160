"""The thin Ray adapter: a lazily started Ray session and a bounded, unordered task map.

The core (data/, retrieval/) only sees an executor `map_unordered(fn, jobs, max_in_flight)`;
this is the one place that knows about Ray tasks. Where Ray runs:
  - no `--address` and no RAY_ADDRESS: a private local Ray, started and stopped here (never a
    cluster that `ray start` left running on this machine);
  - `--address HOST:PORT` (or `auto`: the cluster `ray start` started on this machine), or
    RAY_ADDRESS (set inside a `ray job submit` job): that cluster is joined.
Token authentication is Ray's (docs.ray.io, ray-security/token-auth): a local Ray writes
~/.ray/auth_token and uses it; a client joining a cluster by address needs RAY_AUTH_MODE=token and
the cluster's token (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN). Ray does not switch
it on by itself for an explicit address, so that a token is never sent to an address by surprise;
when a join fails, `ClusterError` says what to set.

Ray itself is imported inside the functions that use it: every Ray entry point imports this module
first thing, and loads no Ray until a session starts.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator

from retropipe.data.errors import ConfigError, DataError
from retropipe.data.stage import SCHEDULER_SIGNALS, write_json
from retropipe.launch.cli import request_stop, stop_requested


class ClusterError(RuntimeError):
    """Joining a Ray cluster failed; the message says what to set."""


def join_hint(address: str) -> str:
    """What to do when joining `address` failed, given this process's RAY_AUTH_MODE."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ("if the cluster uses token authentication (Ray's default for clusters started with a token), "
                "`export RAY_AUTH_MODE=token` here, with the cluster's token in ~/.ray/auth_token, "
                "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (README, 'On a Ray cluster')")
    return (f"RAY_AUTH_MODE=token is set: this machine's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            f"~/.ray/auth_token) must be the one the cluster at {address} was started with")


# Seconds to wait for a TCP connection to a cluster's GCS before saying it cannot be reached.
REACH_TIMEOUT = 10.0


def check_reachable(address: str) -> None:
    """Fail at once, in one line, where no Ray cluster listens at `address` (a host:port, or
    "auto": the cluster `ray start` last started here). ray.init would retry an unreachable GCS for
    minutes, printing only its own warnings. A Ray Client address (ray://...) is left to Ray."""
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]                        # what ray.init reads for "auto"
    if "://" in address:
        return
    try:  # "auto" resolved as ray.init resolves it (Ray's own function, not public API)
        from ray._private.services import canonicalize_bootstrap_address  # local: Ray (module docstring)
    except ImportError:
        return

    try:
        resolved = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as e:
        raise ClusterError(f"cannot join the Ray cluster at {address} ({str(e).strip().splitlines()[0]})") from None
    if resolved is None:  # "local": ray.init starts one
        return
    host, port = resolved.rsplit(":", 1)
    at = address if resolved == address else f"{address} ({resolved})"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT) as sock:
            grpc = speaks_http2(sock)
    except OSError as e:
        raise ClusterError(f"cannot reach the Ray cluster at {at}: {e.strerror or e}; is it running? "
                           f"(`ray status --address {resolved}`)") from None
    if not grpc:
        raise ClusterError(f"something listens at {at}, but not a Ray cluster's GCS (it does not answer as a gRPC "
                           f"server): is it the dashboard's port? --address takes the GCS address, HOST:6379 unless "
                           f"`ray start --head --port` chose another (`ray job submit --address` is the one that takes "
                           f"the dashboard's http://HOST:8265)")


# The client's opening of an HTTP/2 connection (RFC 9113 §3.4) and an empty SETTINGS frame.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def speaks_http2(sock: socket.socket) -> bool:
    """True where the server answers as gRPC servers (Ray's GCS) do: its first frame is SETTINGS.
    Anything else that listens (an HTTP/1 server such as the dashboard, a database) answers with
    something else or closes; one that says nothing within REACH_TIMEOUT raises TimeoutError. With
    TLS (RAY_USE_TLS) the check is left to Ray."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True
    sock.sendall(HTTP2_PREFACE)
    header = b""
    while len(header) < 9:
        more = sock.recv(9 - len(header))
        if not more:
            return False
        header += more
    return header[3] == 4  # the frame type: SETTINGS


def signal_handlers() -> dict:
    """This process's own Python handlers of the signals a scheduler sends (main thread only; the
    default actions are left as ray.init sets them)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {signum: signal.getsignal(signum) for signum in SCHEDULER_SIGNALS}
    return {signum: handler for signum, handler in handlers.items() if callable(handler)}


def _placed(fn: Callable, *args):
    """fn(*args) in a Ray task, with the id of the node that ran it."""
    import ray  # local: Ray (module docstring)

    return ray.get_runtime_context().get_node_id(), fn(*args)


class RayExecutor:
    """`placements`: tasks run per Ray node id, over this executor's life (the entry points record
    it in the stage's run.json, so a build says which nodes did its work)."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        self.address, self.num_cpus, self.started = address, num_cpus, False
        self.placements: Counter = Counter()

    def ensure_started(self):
        import ray  # local: Ray loads here, as the session starts (module docstring)

        if not ray.is_initialized():
            # ray.init makes SIGTERM a sys.exit as it begins, and its core worker prints a C++
            # stack dump for it: the entry point's own handlers (launch/cli.py) are put back after.
            handlers = signal_handlers()
            try:
                self._init(ray)
            except SystemExit as e:    # Ray's handler: a SIGTERM came during ray.init
                if e.code != signal.SIGTERM or signal.SIGTERM not in handlers:
                    raise
                ray.shutdown()
                raise request_stop(signal.SIGTERM) from None
            except KeyboardInterrupt:  # a stop (SIGUSR1) or Ctrl-C during ray.init
                ray.shutdown()
                raise
            finally:
                if not stop_requested():  # after a stop the signals stay ignored (launch/cli.py)
                    for signum, handler in handlers.items():
                        signal.signal(signum, handler)
            self.started = True
        return ray

    def _init(self, ray) -> None:
        from ray.exceptions import AuthenticationError

        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        address = self.address or os.environ.get("RAY_ADDRESS") or None
        quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
        if address is None:
            # No metrics: nothing here reads them (no dashboard), and Ray's metrics thread could
            # crash a worker as Ray reaped it, a segmentation fault printed mid-build
            # (ray-project/ray#36885 and its kin; seen once in `make demo`).
            ray.init(address="local", include_dashboard=False, num_cpus=self.num_cpus,
                     _system_config={"enable_metrics_collection": False}, **quiet)
            return
        check_reachable(address)
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, AuthenticationError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ClusterError(f"cannot join the Ray cluster at {address} ({reason}); "
                               f"{join_hint(address)}") from None

    def __call__(self, fn: Callable, jobs: Iterable[tuple], max_in_flight: int) -> Iterator:
        """Run fn(*args) for every args in jobs with at most max_in_flight tasks at once.

        Tasks are retried by Ray if a worker dies (max_retries); results come back in
        completion order, and jobs is consumed lazily so the input streams. max_in_flight 0: one
        task per CPU of the cluster.
        """
        ray = None
        pending = []
        for args in jobs:
            if ray is None:
                ray = self.ensure_started()
                # SPREAD, as Ray Data spreads its reads: short tasks would otherwise stay on the
                # driver's node, whose CPU frees up before the scheduler looks elsewhere.
                remote = ray.remote(num_cpus=1, max_retries=3, scheduling_strategy="SPREAD")(_placed)
                # 0: as many as the cluster has CPUs (data.num_workers 0)
                max_in_flight = max_in_flight or max(1, int(ray.cluster_resources().get("CPU", 1)))
            pending.append(remote.remote(fn, *args))
            if len(pending) >= max_in_flight:
                ready, pending = ray.wait(pending, num_returns=1)
                yield self._result(ray, fn, ready[0])
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            yield self._result(ray, fn, ready[0])

    def _result(self, ray, fn: Callable, ref):
        """A finished task's result; its failure as the error it raised, without Ray's traceback."""
        try:
            node, result = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            raise task_failure(fn, e.cause) from None
        self.placements[node] += 1
        return result

    def close(self):
        if self.started:
            import ray

            ray.shutdown()
            self.started = False


def task_failure(fn: Callable, cause: BaseException) -> Exception:
    """What a failed Ray task tells the user: RetroPipe's own error as it is (it names the file or
    key); anything else as a DataError naming the task, the cause and the likely fix."""
    if isinstance(cause, (ConfigError, DataError)):
        return cause
    hint = ("; is the workdir on storage every Ray node mounts at the same path? (docs/cluster.md)"
            if isinstance(cause, OSError) else "")
    return DataError(f"a Ray task ({getattr(fn, '__name__', fn)}) failed: {type(cause).__name__}: {cause}{hint}")


def record_work(stage_dir, **placements: Counter) -> dict | None:
    """<stage_dir>/run.json: how many units of each kind of work each Ray node ran
    ({"nodes": {node id: {"tasks": 5, "embed_jobs": 40}}}), the build's own record of where it
    ran; None (and nothing written) when this run did no work (the stage was complete)."""
    nodes: dict[str, dict[str, int]] = {}
    for kind, counts in placements.items():
        for node, n in counts.items():
            nodes.setdefault(node, {})[kind] = n
    if not nodes:
        return None
    record = {"nodes": nodes}
    write_json(Path(stage_dir) / "run.json", record)
    return record


def work_summary(record: dict | None) -> str:
    """One line: the work each node did."""
    if not record:
        return "ray: no work to do (complete)"
    return "ray: work per node: " + "; ".join(f"{node[:8]} " + ", ".join(f"{n} {kind}" for kind, n in kinds.items())
                                            for node, kinds in record["nodes"].items())
