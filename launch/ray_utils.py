"""The thin Ray adapter: a lazily started Ray session and a bounded, unordered task map.

The core (data/, retrieval/) only sees an executor `map_unordered(fn, jobs, max_in_flight)`;
this is the one place that knows about Ray tasks. `ray.init()` joins the cluster of a
`ray job submit` (RAY_ADDRESS is set there) or `--address`, and otherwise starts a local one.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Iterator


class RayExecutor:
    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        self.address, self.num_cpus, self.started = address, num_cpus, False

    def ensure_started(self):
        import ray

        if not ray.is_initialized():
            os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
            local = self.address is None and not os.environ.get("RAY_ADDRESS")
            ray.init(address=self.address, include_dashboard=False if local else None,
                     num_cpus=self.num_cpus if local else None,
                     logging_level=logging.WARNING, log_to_driver=True)
            self.started = True
        return ray

    def __call__(self, fn: Callable, jobs: Iterable[tuple], max_in_flight: int) -> Iterator:
        """Run fn(*args) for every args in jobs with at most max_in_flight tasks at once.

        Tasks are retried by Ray if a worker dies (max_retries); results come back in
        completion order, and jobs is consumed lazily so the input streams.
        """
        ray = None
        pending = []
        for args in jobs:
            if ray is None:
                ray = self.ensure_started()
                remote = ray.remote(num_cpus=1, max_retries=3)(fn)
            pending.append(remote.remote(*args))
            if len(pending) >= max_in_flight:
                ready, pending = ray.wait(pending, num_returns=1)
                yield ray.get(ready[0])
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            yield ray.get(ready[0])

    def close(self):
        if self.started:
            import ray

            ray.shutdown()
            self.started = False
