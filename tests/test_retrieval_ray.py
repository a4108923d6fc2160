"""Retrieval on a real Ray: a Ray worker killed mid-stage, and `ray job submit` to a local head."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from data.neighbours import NeighbourStore
from data.store import ChunkStore
from tests.corpora import CHUNK_LEN, PY, ROOT, SEQ_CHUNKS, neighbours_of
from tests.distributed import free_port


# --- Ray: a killed actor, and `ray job submit` ----------------------------------------------

def stop_ray_head(proc: subprocess.Popen, temp_dir: str) -> None:
    """Stop only the head these tests started (not `ray stop`, which would stop every Ray here)."""
    proc.terminate()  # `ray start --block` takes the processes it started down with it
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    for pid in os.listdir("/proc"):  # anything of this head that outlived it, by its own temp dir
        if pid.isdigit():
            try:
                if temp_dir.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


@pytest.fixture(scope="module")
def ray_head():
    """A real local Ray head (`ray start --head`), shared by the Ray tests; yields (gcs, dashboard, env)."""
    ray = str(Path(PY).parent / "ray")
    port, dash = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rpray")  # short: Ray's socket paths have a length limit
    # Ray >= 2.5x heads default to token auth; this head listens on 127.0.0.1 only, so no token.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen([ray, "start", "--head", "--block", "--port", str(port), "--dashboard-host", "127.0.0.1",
                             "--dashboard-port", str(dash), "--num-cpus", "2", "--temp-dir", temp_dir,
                             "--include-dashboard", "true"], env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # for the drivers this process connects
    try:
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except OSError:
                if time.time() > deadline or head.poll() is not None:
                    pytest.fail("the Ray head did not come up")
                time.sleep(1)
        yield f"127.0.0.1:{port}", address, env
    finally:
        stop_ray_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


# The driver of the killed-actor run: a fresh process, as a user's driver is (a pytest process
# that already hosted another Ray cluster keeps Ray state that makes new actors die at init).
KILLED_DRIVER = """
import json, os, signal, sys
from pathlib import Path
from data.store import ChunkStore
from launch.ray_utils import RayExecutor
from retrieval.embed import embed_store
from retrieval.ray_embed import EmbedChunks, RayEmbedRunner

address, data_dir, out, marker = sys.argv[1:5]

class KillsItselfOnce(EmbedChunks):
    def __call__(self, batch):
        if not Path(marker).exists():
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dying mid-stage, not an exception
        return super().__call__(batch)

executor = RayExecutor(address=address)
try:
    manifest = embed_store(ChunkStore(data_dir), Path(out), "", 8, RayEmbedRunner(executor, actors=1, udf=KillsItselfOnce))
finally:
    executor.close()
print("MANIFEST " + json.dumps(manifest["shards"]))
"""


@pytest.mark.slow
def test_killed_ray_actor_is_retried_without_corrupting_output(built, tmp_path, ray_head):
    ref_root, store, ref = built
    marker = tmp_path / "killed-once"
    proc = subprocess.run([PY, "-c", KILLED_DRIVER, ray_head[0], str(ref_root / "data"), str(tmp_path / "embeddings"),
                           str(marker)], cwd=ROOT, env={**ray_head[2], "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker.exists()  # the worker was killed; Ray Data or the runner's retry redid its jobs
    shards = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("MANIFEST "))[9:])
    for split in ("train", "validation"):
        for name in shards[split]:
            ours = np.load(tmp_path / "embeddings" / split / name, allow_pickle=False)
            theirs = np.load(ref_root / "retrieval" / "embeddings" / split / name, allow_pickle=False)
            assert ours.shape == theirs.shape
            np.testing.assert_allclose(ours.astype(np.float32), theirs.astype(np.float32), atol=2e-3)


@pytest.mark.slow
def test_ray_job_submit_to_a_local_head(built, tmp_path, ray_head):
    ref_root, store, _ = built
    shutil.copytree(ref_root / "data", tmp_path / "data")
    _, address, env = ray_head
    job = subprocess.run([str(Path(PY).parent / "ray"), "job", "submit", "--address", address, "--working-dir", ".",
                          "--", PY, "launch/build_index.py", "--config", "configs/tiny.yaml", "--no-progress",
                          "--set", f"workdir={tmp_path}", "--set", f"data.chunk_len={CHUNK_LEN}",
                          "--set", "train.seq_len=32", "--set", "retrieval.embed_batch_size=8",
                          "--set", "retrieval.recall_queries=10", "--set", "retrieval.train_sample=0",
                          "--set", "retrieval.k=2", "--set", "eval.more_neighbours=0"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "retrieval database in" in job.stdout and "recall@2" in job.stdout
    reader = NeighbourStore.of(tmp_path / "retrieval", ChunkStore(tmp_path / "data"), chunks_per_seq=SEQ_CHUNKS)
    for split in ("train", "validation"):
        ours, theirs = reader.ids(split), neighbours_of(ref_root)[split]
        assert ours.shape == theirs.shape and (ours == theirs).mean() > 0.9  # same up to float ties
