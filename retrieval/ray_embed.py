"""The thin Ray Data adapter of the embedding stage: a class UDF around `retrieval.embed_job.embed_job`.

Jobs (part, split, shard, start, stop, the copies to skip) go in as rows, every part of the database in one pass;
`EmbedChunks` actors load the model once each (a GPU per actor when the cluster has GPUs and
retrieval.embed_device allows it) and return one row per chunk. When a worker dies, the jobs not
yet delivered run again; a job's output only reaches the driver once it completed, and the driver
writes a shard only when all its jobs are in, so a retry cannot leave half a shard behind. The
chunk stores and the retrieval dir must be on storage every node sees (a shared filesystem on a
multi-node cluster).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from typing import Iterator

import numpy as np

from retropipe.data.chunking import SPLITS
from retropipe.data.errors import ConfigError, DataError, StageError, TokenizerError
from retropipe.data.stage import KILL_NODE_ENV
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.embed_job import EmbedJob, EmbedSpec


class EmbedChunks:
    """Ray Data class UDF: one model per actor; a batch is a few jobs, each embedded whole."""

    def __init__(self, spec: EmbedSpec, device: str, threads: int):
        import ray

        from retropipe.data.store import ChunkStore
        from retropipe.data.tokenizer import get_tokenizer
        from retropipe.retrieval.embedder import load_embedder, local_model_path

        self.spec = spec
        self.model = load_embedder(local_model_path(spec.model_path, spec.hub_name), device=device, threads=threads,
                                   precision=spec.precision, backend=spec.backend)
        self.stores, self.encoding = [ChunkStore(d) for d in spec.data_dirs], get_tokenizer(spec.tokenizer)
        self.node = ray.get_runtime_context().get_node_id()
        self.jobs_done = 0

    def embed_one(self, job: EmbedJob) -> np.ndarray:
        from retropipe.retrieval.embed_job import embed_job

        return embed_job(self.model, self.stores[job.part], self.encoding, job, self.spec.sub_batch)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        parts, splits, chunks, vectors = [], [], [], []
        for part, split, shard, start, stop, skip in zip(batch["part"], batch["split"], batch["shard"], batch["start"],
                                                         batch["stop"], batch["skip"]):
            # skip: a variable-length column, one int64 array (or an object holding it) per row.
            job = EmbedJob(SPLITS[int(split)], int(shard), int(start), int(stop), int(part),
                           tuple(np.asarray(skip, dtype=np.int64).ravel().tolist()))
            vectors.append(self.embed_one(job))                      # (n, d) float16
            chunks.append(np.arange(job.start, job.stop, dtype=np.int64))
            splits.append(np.full(job.stop - job.start, split, dtype=np.int8))
            parts.append(np.full(job.stop - job.start, part, dtype=np.int32))
            self.jobs_done += 1
            # Tests of losing a node: RETROPIPE_KILL_NODE_AFTER=embed:N (in one node's environment)
            # kills this node's raylet, with every worker on it, once an actor there has embedded N jobs.
            if os.environ.get(KILL_NODE_ENV) == f"embed:{self.jobs_done}":
                os.kill(os.getppid(), signal.SIGKILL)
        rows = sum(len(c) for c in chunks)
        return {"part": np.concatenate(parts), "split": np.concatenate(splits), "chunk": np.concatenate(chunks),
                "embedding": np.concatenate(vectors), "node": np.full(rows, self.node)}


def quiet_ray_data() -> None:
    """Ray Data's console at WARNING (its progress blocks are INFO; ray-data.log keeps everything),
    and no advice about the progress bars the runner turns off on purpose (RetroPipe's bar shows)."""
    from ray.util.debug import log_once

    for handler in logging.getLogger("ray.data").handlers:
        if handler.name == "console":
            handler.setLevel(logging.WARNING)
    log_once("ray_data_progress_manager_disabled")  # the key of that advice: taken, so it is not given


def node_cpus(ray) -> list[int]:
    """CPUs of every node alive."""
    return [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]


# RetroPipe's own errors an actor's constructor may raise: the model cannot be loaded on that node,
# or its chunk stores are not there (a node without the shared mount). Not a lost worker.
REFUSALS = (RetrievalError, StageError, TokenizerError, DataError, ConfigError)


def init_refusal(error: Exception) -> str | None:
    """The message of the RetroPipe error (REFUSALS) an actor's constructor raised, or None when
    the actor died of something else.

    Ray hands the driver an ActorDiedError whose message holds the constructor's traceback, not
    the error itself; its last line is that error's own."""
    if not getattr(error, "actor_init_failed", False):
        return None
    markers = [f"{cls.__module__}.{cls.__qualname__}: " for cls in REFUSALS]
    lines = [line.split(m, 1)[1] for line in str(error).splitlines() for m in markers if m in line]
    return lines[-1].strip() if lines else None


class RayEmbedRunner:
    """An `EmbedRunner` on Ray Data: `actors` EmbedChunks actors, CPU threads split between them.

    A worker or node dying fails the Ray Data execution (restarting an actor pool member is not
    reliable when its constructor arguments live in the object store, ray#53727); the runner then
    runs the jobs not yet delivered again, up to `max_retries` times. Delivered jobs are final
    (the caller writes whole shards), so a retry never duplicates or tears output.
    """

    def __init__(self, executor, actors: int, device: str = "auto", udf: type = EmbedChunks,
                 progress: bool = False, max_retries: int = 3, log=print):
        self.executor, self.actors, self.device, self.udf, self.progress = executor, actors, device, udf, progress
        self.max_retries, self.log = max_retries, log
        self.placements: Counter = Counter()  # jobs embedded per Ray node id
        self._threads: int | None = None

    def resources(self, ray) -> tuple[str, dict, int]:
        """(device, Ray resources per actor, torch threads per actor).

        Each actor owns an equal share of the cluster's cores (threads beyond it only contend), no
        more than one node holds. Decided once: a retry after a node died runs fewer actors of as
        many threads, so every job is embedded by the same kernels and the bytes do not change."""
        total = ray.cluster_resources()
        if self.device == "cuda" or (self.device == "auto" and total.get("GPU", 0) >= 1):
            return "cuda", {"num_gpus": 1, "num_cpus": 1}, 1
        if self._threads is None:
            cpus = node_cpus(ray)
            self._threads = max(1, min(sum(cpus) // self.actors, max(cpus, default=1)))
        return "cpu", {"num_cpus": self._threads}, self._threads

    def embed_device(self) -> str:
        """"cuda" or "cpu": what this runner's actors embed on."""
        return self.resources(self.executor.ensure_started())[0]

    def pool_size(self, ray, device: str, threads: int) -> int:
        """Actors to start: no more than the nodes alive now can hold (one GPU each, or `threads`
        CPUs each), or the pool would wait forever for a node that died."""
        if device == "cuda":
            return max(1, min(self.actors, int(ray.cluster_resources().get("GPU", 1))))
        return max(1, min(self.actors, sum(c // threads for c in node_cpus(ray))))

    def __call__(self, spec: EmbedSpec, jobs: list[EmbedJob]) -> Iterator[tuple[EmbedJob, np.ndarray]]:
        from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError

        pending = list(jobs)
        for attempt in range(self.max_retries + 1):
            delivered = set()
            try:
                for job, vectors in self._run(spec, pending):
                    delivered.add((job.part, job.split, job.start))
                    yield job, vectors
                return
            except (RayActorError, WorkerCrashedError, NodeDiedError) as e:
                refused = init_refusal(e)
                if refused is not None:  # the configured model or data, not the worker: a retry fails alike
                    raise RetrievalError(refused) from None
                pending = [j for j in pending if (j.part, j.split, j.start) not in delivered]
                if attempt == self.max_retries:
                    raise
                self.log(f"embed: a Ray worker died ({type(e).__name__}); retrying {len(pending)} "
                         f"unfinished jobs (attempt {attempt + 2} of {self.max_retries + 1})")
                time.sleep(2.0 * (attempt + 1))  # let Ray reap the dead worker and free its resources

    def _run(self, spec: EmbedSpec, jobs: list[EmbedJob]) -> Iterator[tuple[EmbedJob, np.ndarray]]:
        if not jobs:
            return
        ray = self.executor.ensure_started()
        from ray.data import DataContext

        ctx = DataContext.get_current()
        if os.environ.get("RETROPIPE_VERBOSE") != "1":  # launch/cli.py quiet_engines: RetroPipe's bars only
            quiet_ray_data()
        ctx.enable_progress_bars = os.environ.get("RETROPIPE_VERBOSE") == "1" and self.progress
        ctx.print_on_execution_start = False
        # A replacement actor that dies while loading the model is replaced again, a few times.
        ctx.max_consecutive_actor_init_deaths = max(ctx.max_consecutive_actor_init_deaths, 2)
        device, resources, threads = self.resources(ray)
        by_key = {(j.part, SPLITS.index(j.split), j.start): j for j in jobs}
        rows = [{"part": j.part, "split": SPLITS.index(j.split), "shard": j.shard, "start": j.start, "stop": j.stop,
                 "skip": np.asarray(j.skip, dtype=np.int64)} for j in jobs]
        ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), 4 * self.actors * 8)))
        # A dead actor fails this execution; __call__ retries what was not delivered
        # (tests/retrieval/test_retrieval_ray.py kills an actor to check).
        ds = ds.map_batches(self.udf, fn_constructor_kwargs={"spec": spec, "device": device, "threads": threads},
                            batch_size=1, compute=ray.data.ActorPoolStrategy(size=self.pool_size(ray, device, threads)),
                            batch_format="numpy", **resources)
        # Output rows are per chunk; regroup them into whole jobs before handing them on.
        waiting: dict[tuple[int, int, int], list] = {}  # (part, split, start) → the job's pieces so far
        starts = {}
        for j in jobs:
            starts.setdefault((j.part, SPLITS.index(j.split)), []).append(j.start)
        starts = {s: np.array(sorted(v)) for s, v in starts.items()}
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for part, split in np.unique(np.stack([batch["part"], batch["split"]], 1), axis=0).tolist():
                sel = (batch["part"] == part) & (batch["split"] == split)
                chunk, vectors = batch["chunk"][sel], batch["embedding"][sel]
                owner = starts[(part, split)][np.searchsorted(starts[(part, split)], chunk, side="right") - 1]
                for start in np.unique(owner):
                    key = (part, split, int(start))
                    mine = owner == start
                    waiting.setdefault(key, []).append((chunk[mine], vectors[mine]))
                    job = by_key[key]
                    if sum(len(c) for c, _ in waiting[key]) == job.stop - job.start:
                        self.placements[str(batch["node"][sel][mine][0])] += 1
                        pieces = waiting.pop(key)
                        ids = np.concatenate([c for c, _ in pieces])
                        vecs = np.concatenate([v for _, v in pieces])[np.argsort(ids, kind="stable")]
                        yield job, vecs.astype(np.float16)
