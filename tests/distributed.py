"""Run launch/train.py on N local CPU processes over gloo, as the `deepspeed` launcher would, and
read back what a run wrote: TensorBoard's records, the MFU of metrics.jsonl.

Spawning the ranks directly (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) skips the
launcher's own start-up (~10 s); one test still goes through the real `deepspeed` CLI.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(nproc: int, args: list[str], log_dir: Path, env: dict | None = None,
          rank_env: dict[int, dict] | None = None) -> list[subprocess.Popen]:
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "LOCAL_SIZE": str(nproc), "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(nproc):
        log = open(log_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "launch/train.py", *args], cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                           **(rank_env or {}).get(rank, {})}))
    return procs


def kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait(procs: list[subprocess.Popen], timeout: float = 300) -> int:
    """Exit code of the first failing rank (the others are killed), or 0."""
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                return bad[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
        return 124
    finally:
        kill(procs)


# free_port() returns a port that was free a moment ago; on a shared machine another process can
# take it before rank 0 listens on it. Rank 0 then fails at once, before any work: start again.
PORT_TAKEN = "EADDRINUSE"


def train(nproc: int, args: list[str], log_dir: Path, timeout: float = 300, env: dict | None = None,
          rank_env: dict[int, dict] | None = None) -> tuple[int, str]:
    """Exit code and the ranks' logs of launch/train.py on nproc processes; env adds variables
    or overrides spawn's (TORCHDYNAMO_DISABLE=0 lets a run compile), rank_env one rank's."""
    for _ in range(3):
        code = wait(spawn(nproc, args, log_dir, env, rank_env), timeout)
        log = "\n".join((log_dir / f"rank{r}.log").read_text() for r in range(nproc))
        if code == 0 or PORT_TAKEN not in log:
            break
    return code, log


def changed_layer_tensors(checkpoints: Path, before: str, after: str) -> tuple[set[str], set[str]]:
    """(the names that differ, all names) of the tensors in DeepSpeed's per-layer files
    (layer_NN-model_states.pt) of checkpoint `before` against checkpoint `after` of the same run."""
    import torch

    changed, names = set(), set()
    for old_file in sorted((checkpoints / before).glob("layer_*-model_states.pt")):
        old, new = (torch.load(f, weights_only=True) for f in (old_file, checkpoints / after / old_file.name))
        changed |= {name for name in old if not torch.equal(old[name], new[name])}
        names |= set(old)
    return changed, names


def read_tensorboard(log_dir):
    """(hyperparameters, config text, {tag: [(step, value)]}) read back from a run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    hparams = {k: (v.number_value if v.HasField("number_value") else v.bool_value if v.HasField("bool_value")
                   else v.string_value) for k, v in start.hparams.items()}
    (text,) = acc.Tensors("config/text_summary")
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return hparams, text.tensor_proto.string_val[0].decode(), scalars


def launch_nodes(nodes: int, per_node: int, args: list[str], log_dir: Path, env: dict | None = None,
                 node_env: dict[int, dict] | None = None, node_args: dict[int, list[str]] | None = None
                 ) -> list[subprocess.Popen]:
    """Start `nodes` DeepSpeed launchers on this machine, each a node of `per_node` processes, as a
    cluster without passwordless ssh starts them (docs/cluster.md): the same hostfile on every
    node, `--no_ssh --node_rank R`, rank 0's address and a port. node_env adds variables to one
    node's launcher (and so to its ranks); node_args gives one node other arguments."""
    log_dir.mkdir(parents=True, exist_ok=True)
    hostfile = log_dir / "hostfile"
    hostfile.write_text("".join(f"node{n} slots={per_node}\n" for n in range(nodes)))
    port = free_port()
    launcher = str(Path(sys.executable).parent / "deepspeed")
    base = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for n in range(nodes):
        log = open(log_dir / f"node{n}.log", "w")
        cmd = [launcher, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(n), "--master_addr", "127.0.0.1",
               "--master_port", str(port), "--log_level", "warning", "launch/train.py", *(node_args or {}).get(n, args)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**base, **((node_env or {}).get(n, {}))}))
    return procs


def train_nodes(nodes: int, per_node: int, args: list[str], log_dir: Path, timeout: float = 300,
                node_env: dict[int, dict] | None = None) -> tuple[list[int], str]:
    """Exit codes of every node's launcher and their logs (a port taken meanwhile: start again)."""
    for _ in range(3):
        procs = launch_nodes(nodes, per_node, args, log_dir, node_env=node_env)
        deadline = time.time() + timeout
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        kill(procs)
        log = "\n".join((log_dir / f"node{n}.log").read_text() for n in range(nodes))
        if PORT_TAKEN not in log:
            break
    return [p.returncode for p in procs], log


def rank_pids(marker: str) -> dict[int, int]:
    """{rank: pid} of the running launch/train.py processes whose command line holds `marker`."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"launch/train.py" in cmd and marker.encode() in cmd and b"deepspeed.launcher" not in cmd:
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None and b"-m\0deepspeed" not in cmd:
                found[rank] = int(pid)
    return found


def assert_mfu_counts_the_heads_work_on_targets_only(run_dir: Path) -> None:
    """The fused head skips tokens without a target, so a step's MFU counts the head's FLOPs for
    that step's tokens with a target only: the peak each step's record implies
    (FLOPs per token of the step × tokens/s ÷ MFU) is the same in every step, while the steps'
    shares of such tokens differ."""
    import json

    import numpy as np

    from retropipe.data.store import ChunkStore
    from retropipe.launch.config import load_config
    from retropipe.training.models.flops import flops_per_token, step_flops_per_token
    from retropipe.training.run.batches import SequenceBatches, micro_batches

    cfg = load_config(run_dir / "config.yaml")
    t = cfg.train
    batches = micro_batches(SequenceBatches(ChunkStore(cfg.data_dir), "train", t.seq_len), 0, t.micro_batch_size,
                            0, 1, t.seed)
    records = sorted(map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()), key=lambda r: r["step"])
    shares, implied = [], []
    for r in records:
        labels = np.concatenate([next(batches)["labels"] for _ in range(t.micro_batches)])
        shares.append(float((labels != -100).mean()))
        fpt = step_flops_per_token(flops_per_token(cfg.model, t.seq_len), cfg.model, shares[-1], t.fused_head)
        implied.append(fpt * r["tokens_per_s"] / r["mfu"])
    assert max(shares) - min(shares) > 0.01, shares
    assert max(implied) / min(implied) < 1 + 1e-9, implied
