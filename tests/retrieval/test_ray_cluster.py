"""Data preparation and the retrieval build on a real two-node Ray cluster, rehearsed on one machine
as Ray's own multi-node tests do: a head (`ray start --head`) and a second raylet joining it
(`ray start --address`), one CPU each, token authentication on (docs/cluster.md).

- the entry points joined by --address spread their work over both nodes (each stage's run.json
  says which node ran what) and write exactly the bytes of an in-process build;
- the second node's raylet SIGKILLed in the middle of embedding (after its actor's second job):
  the build completes, byte-identical, with nothing half-written left behind.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.corpora import ROOT, build_workdir
from tests.distributed import free_port
from tests.retrieval.test_retrieval_ray import VENV_BIN, stop_ray_head

pytestmark = pytest.mark.slow

SETS = ["data.max_documents=150", "data.docs_per_shard=25", "data.num_workers=2", "retrieval.embed_batch_size=32",
        "retrieval.embed_actors=2"]
STAGES = ("embeddings", "index", "neighbours")


def alive_nodes(address: str, env: dict) -> int:
    probe = ("import ray; ray.init(address='%s', logging_level='ERROR'); "
             "print('ALIVE', sum(n['Alive'] for n in ray.nodes()))" % address)
    out = subprocess.run(["python", "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    found = re.findall(r"^ALIVE (\d+)$", out.stdout, re.MULTILINE)  # Ray may print its own lines around it
    return int(found[-1]) if out.returncode == 0 and found else 0


def listening(address: str, timeout: float = 60) -> None:
    host, port = address.split(":")
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)
    pytest.fail(f"nothing listens at {address}")


class TwoNodes:
    """A head and a worker node of one CPU each; `worker_env` goes to the worker's raylet (and its workers)."""

    def __init__(self, home: Path, worker_env: dict | None = None):
        self.temp_dir = tempfile.mkdtemp(prefix="/tmp/rp2n")  # short: Ray's socket paths have a length limit
        # A dead raylet refuses the GCS's health checks at once: 3 failures 1 s apart declare it
        # dead, where Ray's defaults (5, 3 s apart) spent 12 s more of the lost-node test waiting.
        # A busy live one still has each check's 10 s timeout to answer.
        self.env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token",
                    "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_failure_threshold": "3"}
        self.env.pop("RAY_ADDRESS", None)
        subprocess.run(["ray", "get-auth-token", "--generate"], env=self.env, capture_output=True, timeout=120)
        self.address = f"127.0.0.1:{free_port()}"
        common = ["--block", "--num-cpus", "1"]
        self.head = subprocess.Popen(["ray", "start", "--head", "--port", self.address.split(":")[1], *common,
                                      "--temp-dir", self.temp_dir, "--include-dashboard", "false"],
                                     env=self.env, cwd=ROOT, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        listening(self.address)   # the worker joins the head's GCS
        self.worker = subprocess.Popen(["ray", "start", "--address", self.address, *common],
                                       env={**self.env, **(worker_env or {})}, cwd=ROOT, start_new_session=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while alive_nodes(self.address, self.env) < 2:
            if time.time() > deadline:
                self.stop()
                pytest.fail("the two-node Ray cluster did not come up")
            time.sleep(2)

    def run(self, entry: str, workdir: Path) -> subprocess.CompletedProcess:
        """An entry point joining the cluster by address, as a user's shell runs it."""
        sets = [a for s in [f"workdir={workdir}", *SETS] for a in ("--set", s)]
        return subprocess.run(["python", f"launch/{entry}.py", "--config", "configs/tiny.yaml", "--no-progress",
                               "--address", self.address, *sets], env=self.env, cwd=ROOT, capture_output=True,
                              text=True, timeout=600)

    def stop(self) -> None:
        if self.worker.poll() is None:
            os.killpg(self.worker.pid, signal.SIGKILL)   # with the raylet it started (its process group)
            self.worker.wait()
        stop_ray_head(self.head, self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def fingerprints(workdir: Path) -> dict:
    out = {"data": json.loads((workdir / "data" / "manifest.json").read_text())["fingerprint"]}
    for stage in STAGES:
        out[stage] = json.loads((workdir / "retrieval" / stage / "manifest.json").read_text())["fingerprint"]
    return out


def nodes_that_worked(stage_dir: Path, kind: str) -> dict[str, int]:
    record = json.loads((stage_dir / "run.json").read_text())
    return {node: work[kind] for node, work in record["nodes"].items() if work.get(kind)}


@pytest.fixture(scope="module")
def in_process_build(tmp_path_factory, one_thread):
    """The reference: the same configuration prepared and built in-process, without Ray (the Ray
    one-node paths have their own tests: tests/retrieval/test_retrieval_ray.py), embedding on one
    thread as each of the cluster's one-CPU actors does (docs/cluster.md: the bytes depend on it)."""
    from retropipe.launch.config import load_config

    wd = tmp_path_factory.mktemp("in-process")
    build_workdir(load_config(ROOT / "configs" / "tiny.yaml", [f"workdir={wd}", *SETS]))
    return wd


def test_two_nodes_share_the_work_and_write_the_bytes_of_one_process(in_process_build, tmp_path):
    cluster = TwoNodes(tmp_path / "home")
    try:
        for entry in ("prepare_data", "build_index"):
            done = cluster.run(entry, tmp_path)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
            assert "ray: work per node:" in done.stdout
    finally:
        cluster.stop()
    assert len(nodes_that_worked(tmp_path / "data", "tasks")) == 2         # 6 blocks of 25 documents
    assert len(nodes_that_worked(tmp_path / "retrieval", "embed_jobs")) == 2
    assert fingerprints(tmp_path) == fingerprints(in_process_build)


def test_losing_a_node_while_embedding_still_gives_the_same_database(in_process_build, tmp_path):
    """The worker nodes embed (Ray Data actors) and add shards to the index (Ray tasks, which Ray
    reruns when their node dies: max_retries); the merge and the neighbour search run in the driver."""
    shutil.copytree(in_process_build / "data", tmp_path / "data")
    (tmp_path / "data" / "run.json").unlink(missing_ok=True)
    cluster = TwoNodes(tmp_path / "home", worker_env={"RETROPIPE_KILL_NODE_AFTER": "embed:2"})
    try:
        done = cluster.run("build_index", tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert alive_nodes(cluster.address, cluster.env) == 1   # the worker node did die
    finally:
        cluster.stop()
    worked = nodes_that_worked(tmp_path / "retrieval", "embed_jobs")
    assert len(worked) == 2, worked    # the lost node delivered some jobs before it died
    assert fingerprints(tmp_path) == fingerprints(in_process_build)
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
