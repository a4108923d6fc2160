"""Retrieval and data preparation on a real Ray cluster, as a user runs them (README, 'On a Ray cluster').

One local head, started with Ray's token authentication on, as the README's sequence does:

    export RAY_AUTH_MODE=token
    ray get-auth-token --generate
    ray start --head --dashboard-host 127.0.0.1
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python launch/build_index.py ...
    python launch/prepare_data.py ... --address 127.0.0.1:6379

The commands run in a private HOME (its own ~/.ray/auth_token) and temp dir, on free ports, with the
virtual environment first on PATH, as if activated; the machine's ~/.ray is never touched.
"""

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from retropipe.data.neighbour_store import NeighbourStore
from retropipe.data.store import ChunkStore
from retropipe.launch.config import load_config
from retropipe.retrieval.build_database import build_retrieval
from tests.corpora import CHUNK_LEN, PY, ROOT, SEQ_CHUNKS, neighbours_of
from tests.distributed import free_port

pytestmark = pytest.mark.slow

# What a user's shell holds after `source .venv/bin/activate` and `export RAY_AUTH_MODE=token`.
VENV_BIN = str(Path(PY).parent)


def stop_ray_head(proc: subprocess.Popen, temp_dir: str) -> None:
    """Stop only the head these tests started (not `ray stop`, which would stop every Ray here)."""
    proc.terminate()  # `ray start --block` takes the processes it started down with it...
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        # ...in 2 s when nothing ever connected; after drivers or jobs it outwaited a 20 s grace at
        # every stop. The head is the test's own: killed with its process group.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in os.listdir("/proc"):  # anything of this head that outlived it, by its own temp dir
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                if temp_dir.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real local Ray head with token authentication; yields (gcs address, dashboard URL, user's env)."""
    home = tmp_path_factory.mktemp("home")
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rpray")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token", "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    token = subprocess.run(["ray", "get-auth-token", "--generate"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert token.returncode == 0 and (home / ".ray" / "auth_token").is_file(), token.stderr
    port, dash = free_port(), free_port()
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--port", str(port), "--dashboard-host", "127.0.0.1",
                             "--dashboard-port", str(dash), "--num-cpus", "2", "--temp-dir", temp_dir,
                             "--include-dashboard", "true"], env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:  # the dashboard answers (a refusal without a token is an answer)
                break
            except OSError:
                if time.time() > deadline or head.poll() is not None:
                    pytest.fail("the Ray head did not come up")
                time.sleep(1)
        yield f"127.0.0.1:{port}", address, env
    finally:
        stop_ray_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_the_head_requires_a_token(ray_head):
    _, address, _ = ray_head
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{address}/api/jobs/", timeout=10)
    assert refused.value.code == 401  # token authentication is on: the tests below pass it as a user does


# The driver of the killed-actor run: a fresh process, as a user's driver is (a pytest process
# that already hosted another Ray cluster keeps Ray state that makes new actors die at init).
KILLED_DRIVER = """
import json, os, signal, sys
from pathlib import Path
from retropipe.data.store import ChunkStore
from retropipe.launch.ray_utils import RayExecutor
from retropipe.retrieval.embed_job import embed_stores, runner_precision
from retropipe.retrieval.ray_embed import EmbedChunks, RayEmbedRunner

address, data_dir, out, marker = sys.argv[1:5]

class KillsItselfOnce(EmbedChunks):
    def __call__(self, batch):
        if not Path(marker).exists():
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dying mid-stage, not an exception
        return super().__call__(batch)

executor = RayExecutor(address=address)
try:
    runner = RayEmbedRunner(executor, actors=1, udf=KillsItselfOnce)
    # Two parts with the same chunk ids (the same store twice): one pass must keep them apart.
    store = ChunkStore(data_dir)
    manifests = embed_stores([(store, Path(out) / "a"), (store, Path(out) / "b")], "", 8, runner,
                             precision=runner_precision(runner, "auto"))
finally:
    executor.close()
print("MANIFEST " + json.dumps(manifests[0]["shards"]))
"""


def test_killed_ray_actor_is_retried_without_corrupting_output(built, tmp_path, ray_head):
    """One pass over two parts whose chunk ids coincide, an actor killed midway: each part's
    shards are the reference's."""
    ref_root, store, ref = built
    marker = tmp_path / "killed-once"
    proc = subprocess.run(["python", "-c", KILLED_DRIVER, ray_head[0], str(ref_root / "data"),
                           str(tmp_path / "embeddings"), str(marker)], cwd=ROOT, env=ray_head[2],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker.exists()  # the worker was killed; Ray Data or the runner's retry redid its jobs
    shards = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("MANIFEST "))[9:])
    for part in ("a", "b"):
        for split in ("train", "validation"):
            for name in shards[split]:
                ours = np.load(tmp_path / "embeddings" / part / split / name, allow_pickle=False)
                theirs = np.load(ref_root / "retrieval" / "embeddings" / split / name, allow_pickle=False)
                assert ours.shape == theirs.shape
                np.testing.assert_allclose(ours.astype(np.float32), theirs.astype(np.float32), atol=2e-3)


# An actor whose node lacks the shared mount: its constructor raises RetroPipe's DataError.
REFUSED_DRIVER = """
import sys, time
from pathlib import Path
from retropipe.data.errors import DataError
from retropipe.data.store import ChunkStore
from retropipe.launch.ray_utils import RayExecutor
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.embed_job import embed_stores
from retropipe.retrieval.ray_embed import EmbedChunks, RayEmbedRunner

address, data_dir, out = sys.argv[1:4]

class WithoutTheMount(EmbedChunks):
    def __init__(self, *args, **kwargs):
        raise DataError(f"no prepared data at {data_dir} on this node (missing manifest.json)")

executor = RayExecutor(address=address)
begun = time.time()
try:
    runner = RayEmbedRunner(executor, actors=1, udf=WithoutTheMount, log=print)
    embed_stores([(ChunkStore(data_dir), Path(out))], "", 8, runner, precision="fp32")
except RetrievalError as e:
    print(f"REFUSED after {time.time() - begun:.0f} s: {e}")
finally:
    executor.close()
"""


def test_an_actor_refused_by_a_node_without_the_data_is_one_line_not_a_retry(built, tmp_path, ray_head):
    """RetroPipe's own error in an actor's constructor (here: the chunk store missing on its node)
    ends the embedding with that error; it is not taken for a lost worker and retried."""
    proc = subprocess.run(["python", "-c", REFUSED_DRIVER, ray_head[0], str(built[0] / "data"),
                           str(tmp_path / "embeddings")], cwd=ROOT, env=ray_head[2], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "REFUSED" in proc.stdout and "on this node (missing manifest.json)" in proc.stdout, proc.stdout[-3000:]
    assert "retrying" not in proc.stdout, proc.stdout[-3000:]


JOB_SETTINGS = [f"data.chunk_len={CHUNK_LEN}", "train.seq_len=32", "retrieval.embed_batch_size=8",
                "retrieval.recall_queries=10", "retrieval.train_sample=0", "retrieval.k=2", "eval.more_neighbours=0"]


def test_ray_job_submit_to_a_local_head(built, tmp_path, ray_head):
    ref_root, store, _ = built
    shutil.copytree(ref_root / "data", tmp_path / "data")
    _, address, env = ray_head
    sets = [a for s in [f"workdir={tmp_path}", *JOB_SETTINGS] for a in ("--set", s)]
    submit = ["ray", "job", "submit", "--address", address, "--working-dir", ".", "--",
              "python", "launch/build_index.py", "--config", "configs/tiny.yaml", "--no-progress", *sets]
    # The dashboard answers before the head's job agent has registered; Ray then refuses with
    # "No available agent ... try again later" (nothing was submitted), and a user tries again.
    for _ in range(12):
        job = subprocess.run(submit, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        if "No available agent to submit job" not in job.stdout + job.stderr:
            break
        time.sleep(5)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "retrieval database in" in job.stdout and "recall@2" in job.stdout
    assert "logging_progress" not in job.stdout and "Loading weights" not in job.stdout  # quiet by default
    # The job's embeddings are the reference's up to float rounding (Ray actors run other thread
    # counts), and its index and neighbours are exactly what an in-process build makes of them.
    for split in ("train", "validation"):
        for name in sorted((tmp_path / "retrieval" / "embeddings" / split).glob("*.npy")):
            ours = np.load(name, allow_pickle=False).astype(np.float32)
            theirs = np.load(ref_root / "retrieval" / "embeddings" / split / name.name, allow_pickle=False)
            np.testing.assert_allclose(ours, theirs.astype(np.float32), atol=2e-3)
    check = tmp_path / "in-process"
    shutil.copytree(tmp_path / "data", check / "data")
    shutil.copytree(tmp_path / "retrieval" / "embeddings", check / "retrieval" / "embeddings")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"workdir={check}", *JOB_SETTINGS])
    result = build_retrieval(cfg.retrieval, ChunkStore(check / "data"), check / "retrieval", SEQ_CHUNKS)
    assert result["embeddings"].get("skipped")  # the job's own embeddings, reused
    reader = NeighbourStore.of(tmp_path / "retrieval", ChunkStore(tmp_path / "data"), chunks_per_seq=SEQ_CHUNKS)
    for split in ("train", "validation"):
        np.testing.assert_array_equal(reader.ids(split), neighbours_of(check)[split])
        assert reader.ids(split).shape == neighbours_of(ref_root)[split].shape


def test_prepare_data_joins_a_cluster_by_address(tmp_path, ray_head):
    gcs, _, env = ray_head
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i} " * 20}) + "\n" for i in range(40)))
    cmd = ["python", "launch/prepare_data.py", "--config", "configs/tiny.yaml", "--no-progress", "--address", gcs,
           "--set", f"workdir={tmp_path}", "--set", f"data.corpus={corpus}", "--set", "data.docs_per_shard=10"]
    joined = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert ChunkStore(tmp_path / "data").manifest["splits"]["train"]["documents"] > 30
    # Without RAY_AUTH_MODE=token the head refuses the client: one line saying what to set.
    no_auth = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    cmd[cmd.index(f"workdir={tmp_path}")] = f"workdir={tmp_path / 'refused'}"
    refused = subprocess.run(cmd, env=no_auth, cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and last.startswith("prepare_data: error: cannot join the Ray cluster"), last
    assert "export RAY_AUTH_MODE=token" in last and not (tmp_path / "refused" / "data" / "manifest.json").exists()


def test_a_model_the_actors_cannot_load_is_one_line_naming_the_key(built, tmp_path, ray_head):
    """The driver reads the model's width from its files and never loads it; the embedding actors
    do. A model they cannot load (its weights cut short) ends the build with the actors' own error,
    naming the key, at once: not the retries meant for a worker that died."""
    from retropipe.retrieval.embedder import resolve_model_path

    gcs, _, env = ray_head
    shutil.copytree(built[0] / "data", tmp_path / "data")
    model = tmp_path / "model"
    shutil.copytree(resolve_model_path(""), model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    sets = [a for s in [f"workdir={tmp_path}", *JOB_SETTINGS, f"retrieval.embedder={model}"] for a in ("--set", s)]
    done = subprocess.run(["python", "launch/build_index.py", "--config", "configs/tiny.yaml", "--no-progress",
                           "--address", gcs, *sets], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("build_index: error: config key 'retrieval.embedder': cannot load "
                                                   f"{model}"), done.stdout[-2000:] + done.stderr[-3000:]
    assert "retrying" not in done.stdout and not (tmp_path / "retrieval" / "embeddings" / "manifest.json").exists()


def test_an_address_where_no_cluster_listens_fails_at_once(tmp_path):
    """ray.init would retry an unreachable GCS for minutes; the entry point says so in one line."""
    with socket.socket() as held:  # bound, never listening: no other process can take the port meanwhile
        held.bind(("0.0.0.0", 0))
        cmd = [PY, "launch/prepare_data.py", "--config", "configs/tiny.yaml", "--no-progress",
               "--address", f"127.0.0.1:{held.getsockname()[1]}", "--set", f"workdir={tmp_path}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("prepare_data: error: cannot reach the Ray cluster at 127.0.0.1:"), last
    assert "ray status --address" in last and not (tmp_path / "data" / "manifest.json").exists()


def test_an_address_where_an_http_server_listens_fails_at_once_naming_the_dashboard(tmp_path):
    """An HTTP server where the GCS belongs (the dashboard's port, which `ray job submit` takes, is
    the likely mix-up): something listens, so ray.init would wait for a GCS there for minutes."""
    server = http.server.HTTPServer(("0.0.0.0", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cmd = [PY, "launch/prepare_data.py", "--config", "configs/tiny.yaml", "--no-progress",
               "--address", f"127.0.0.1:{server.server_port}", "--set", f"workdir={tmp_path}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("prepare_data: error: something listens at 127.0.0.1:"), last
    assert "not a Ray cluster's GCS" in last and "the dashboard's http://HOST:8265" in last


# A driver waiting in ray.wait on tasks that run long, as a build's driver waits on its embedding.
WAITING_DRIVER = """
import os, signal, sys, threading, time
from pathlib import Path
from retropipe.launch.cli import run_stopping
from retropipe.launch.ray_utils import RayExecutor

def task(marker):
    Path(marker).touch()
    time.sleep(120)

def work():
    executor = RayExecutor(num_cpus=1)
    try:
        return len(list(executor(task, [(sys.argv[1],)], 1)))
    finally:
        executor.close()

def signal_when_running():
    while not Path(sys.argv[1]).exists():
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=signal_when_running, daemon=True).start()
sys.exit(run_stopping("driver", work))
"""


def test_a_sigterm_while_the_driver_waits_on_ray_stops_it_at_once(tmp_path):
    """Ray's waits end early for a KeyboardInterrupt alone (raising a plain one in its place): the
    stop is one, and is found behind it; the driver does not wait out its 120 s task."""
    begun = time.time()
    done = subprocess.run([PY, "-c", WAITING_DRIVER, str(tmp_path / "running")], cwd=ROOT, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 75, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("driver: stopped by SIGTERM; the finished work is kept")
    assert "Traceback" not in done.stderr and time.time() - begun < 60, done.stderr[-3000:]


def test_a_ray_client_address_is_left_to_ray(monkeypatch):
    """ray:// (Ray Client), given or read from RAY_ADDRESS for "auto", is not a host:port to check."""
    from retropipe.launch.ray_utils import check_reachable

    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:1")
    check_reachable("auto")
    check_reachable("ray://nowhere.invalid:10001")
