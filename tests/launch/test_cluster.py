"""Training on two nodes, rehearsed on one machine: two DeepSpeed launchers with the same hostfile,
`--no_ssh --node_rank R --master_addr --master_port`, as on a cluster without passwordless ssh
(docs/cluster.md). World 4: 2 pipeline stages × 2 data-parallel replicas, 2 processes per node.

- the two-node run equals the same run on one node, exactly, and a single process (fp32);
- its checkpoints move between one node and two, both ways;
- a rank killed or stopped mid-step ends every process of both nodes within train.dist_timeout
  + 30 s, each saying which rank was lost; a node killed while writing a checkpoint leaves the
  checkpoint before it, and the rerun reproduces the uninterrupted loss curve bit for bit;
- a run directory the nodes do not share is refused; three replicas whose tied-embedding copies
  drift by rounding still finish.
"""

import json
import os
import re
import shutil
import signal
import time

import pytest

from tests.corpora import build_workdir
from tests.distributed import ROOT, kill, launch_nodes, rank_pids, train, train_nodes
from tests.launch.test_training import TINY, losses

pytestmark = pytest.mark.slow

COMMON = [*TINY, "data.max_documents=100", "train.micro_batch_size=1", "train.steps=4", "train.checkpoint_every=2",
          "train.keep_checkpoints=3"]


def args(workdir, config: str, name: str, *overrides: str) -> list[str]:
    sets = [f"workdir={workdir}", f"train.name={name}", *COMMON, *overrides]
    return ["--config", f"configs/{config}", *[a for o in sets for a in ("--set", o)]]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Prepared data and its retrieval database (real BERT embeddings, FAISS Flat)."""
    from retropipe.launch.config import load_config

    wd = tmp_path_factory.mktemp("cluster")
    build_workdir(load_config(ROOT / "configs" / "tiny-retro.yaml", [f"workdir={wd}", *COMMON]))
    return wd


def two_nodes(workdir, config, name, *overrides, timeout=300, node_env=None) -> tuple[list[int], str]:
    return train_nodes(2, 2, args(workdir, config, name, *overrides), workdir / f"logs-{name}", timeout, node_env)


@pytest.fixture(scope="module")
def four_steps(workdir):
    """run(config, nodes): the run directory and log of COMMON's 4 steps of `config` on two nodes
    or on one (4 processes either way), trained once: compared by one test, extended by another."""
    done = {}

    def run(config: str, nodes: int):
        if (config, nodes) not in done:
            name = f"{config.split('-')[1].split('.')[0]}-{('one', 'two')[nodes - 1]}"
            if nodes == 2:
                codes, log = two_nodes(workdir, config, name)
                assert codes == [0, 0], log[-3000:]
            else:
                code, log = train(4, args(workdir, config, name), workdir / f"logs-{name}")
                assert code == 0, log[-3000:]
            done[config, nodes] = workdir / "runs" / name, log
        return done[config, nodes]

    return run


@pytest.mark.parametrize("config", ["tiny-gpt2.yaml", "tiny-retro.yaml"])
def test_two_nodes_equal_one_node_and_one_process(workdir, four_steps, config):
    kind = config.split("-")[1].split(".")[0]
    (two_dir, log), (one_dir, _) = four_steps(config, 2), four_steps(config, 1)
    assert "pipeline: 2 stages × 2 data parallel" in log
    code, log = train(1, args(workdir, config, f"{kind}-single", "train.pipeline_stages=1", "train.micro_batches=4"),
                      workdir / f"logs-{kind}-single")
    assert code == 0, log[-3000:]
    two, one, single = (losses(d) for d in (two_dir, one_dir, workdir / "runs" / f"{kind}-single"))
    assert sorted(two) == [1, 2, 3, 4] and two == one  # the same ranks, the same sums: bit for bit
    for step in two:  # the same samples per step; sums in another order
        assert abs(two[step] - single[step]) < 1e-5, (step, two[step], single[step])


def test_checkpoints_move_between_one_node_and_two(workdir, four_steps):
    """A 2-node run extended on 1 node, a 1-node run extended on 2 nodes: the same steps 5 and 6."""
    for name, first, then in (("g2to1", 2, 1), ("g1to2", 1, 2)):
        shutil.copytree(four_steps("tiny-gpt2.yaml", first)[0], workdir / "runs" / name)  # its 4 steps
        if then == 2:
            codes, log = two_nodes(workdir, "tiny-gpt2.yaml", name, "train.steps=6")
            assert codes == [0, 0], log[-3000:]
        else:
            code, log = train(4, args(workdir, "tiny-gpt2.yaml", name, "train.steps=6"), workdir / f"logs-{name}-6")
            assert code == 0, log[-3000:]
        assert "resumed from step 4" in log, log[-2000:]
    a, b = losses(workdir / "runs" / "g2to1"), losses(workdir / "runs" / "g1to2")
    assert sorted(a) == list(range(1, 7)) and a == b


def back_to_step_2(run_dir, name):
    """A copy of a finished 4-step run as if it had stopped after its checkpoint of step 2."""
    copy = run_dir.parent / name
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step000004")
    (copy / "checkpoints" / "latest.json").write_text(json.dumps({"tag": "step000002", "step": 2}))
    (copy / "summary.json").unlink()
    return copy


def test_a_checkpoint_resumes_on_another_number_of_replicas_or_stages(workdir, four_steps):
    """Written by 2 stages × 2 replicas, step 2 resumes on 2 stages × 1 replica (twice the micro-batches:
    the global batch stays), on 1 stage and on 4 stages; the step-4 checkpoint of 2 processes then
    resumes on 4. Every loss is the undisturbed run's within 1e-4 (fp32)."""
    source, _ = four_steps("tiny-gpt2.yaml", 1)
    undisturbed = losses(source)
    for name, nproc, stages in (("e2", 2, 2), ("e1", 1, 1), ("e4", 4, 4)):
        run = back_to_step_2(source, f"elastic-{name}")
        code, log = train(nproc, args(workdir, "tiny-gpt2.yaml", run.name, f"train.pipeline_stages={stages}"),
                          workdir / f"logs-{run.name}")
        assert code == 0 and "resumed from step 2" in log, log[-3000:]
        assert f"train.micro_batches {4 // (nproc // stages)} × {nproc // stages} replicas" in log, log[-3000:]
        got = losses(run)
        assert sorted(got) == [1, 2, 3, 4] and all(abs(got[s] - undisturbed[s]) < 1e-4 for s in (3, 4)), (got, undisturbed)
    # 2 processes wrote elastic-e2's step 4: on 4 processes (2 × 2) it extends as the 4-process run
    # does (g2to1: the test above extends the same run on 4 processes; made here if it did not run).
    reference = workdir / "runs" / "g2to1"
    if sorted(losses(reference) if (reference / "summary.json").exists() else []) != list(range(1, 7)):
        shutil.rmtree(reference, ignore_errors=True)
        shutil.copytree(source, reference)
        code, log = train(4, args(workdir, "tiny-gpt2.yaml", "g2to1", "train.steps=6"), workdir / "logs-g2to1-6")
        assert code == 0, log[-3000:]
    elastic = source.parent / "elastic-e2"
    code, log = train(4, args(workdir, "tiny-gpt2.yaml", elastic.name, "train.steps=6"), workdir / "logs-e2-6")
    assert code == 0 and "resumed from step 4" in log, log[-3000:]
    a, b = losses(reference), losses(elastic)
    assert all(abs(a[s] - b[s]) < 1e-4 for s in (5, 6)), (a, b)


def wait_for_steps(run_dir, n: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    pytest.fail(f"{run_dir} did not reach step {n}")


@pytest.mark.parametrize("sig, victim", [(signal.SIGKILL, 3), (signal.SIGSTOP, 0)])
def test_a_lost_or_stopped_rank_ends_every_process_quickly(workdir, sig, victim):
    """SIGSTOP is what a hung GPU or a partitioned host looks like from the other ranks: no reset
    arrives. Rank 0 hosts the rendezvous store the watchdog beats into."""
    timeout = 10
    name = f"lost-{sig.name}-{victim}"
    procs = launch_nodes(2, 2, args(workdir, "tiny-gpt2.yaml", name, "train.steps=1000", "train.checkpoint_every=1000",
                                    f"train.dist_timeout={timeout}"), workdir / f"logs-{name}")
    try:
        wait_for_steps(workdir / "runs" / name, 2)
        ranks = rank_pids(f"train.name={name}")
        assert sorted(ranks) == [0, 1, 2, 3], ranks
        os.kill(ranks[victim], sig)
        begun = time.time()
        others = [pid for rank, pid in ranks.items() if rank != victim]
        while time.time() - begun < timeout + 60 and (any(p.poll() is None for p in procs)
                                                      or any(os.path.exists(f"/proc/{pid}") for pid in others)):
            time.sleep(0.2)
        took = time.time() - begun
    finally:
        kill(procs)
        if sig == signal.SIGSTOP:
            os.kill(ranks[victim], signal.SIGKILL) if os.path.exists(f"/proc/{ranks[victim]}") else None
    log = "\n".join((workdir / f"logs-{name}" / f"node{n}.log").read_text() for n in (0, 1))
    assert took < timeout + 30, (took, log[-3000:])
    assert all(p.returncode not in (0, None) for p in procs), [p.returncode for p in procs]
    lines = re.findall(r"train: error: lost rank \d+ .*? rank \d exits", log)  # a progress bar may precede one
    assert len(lines) == 3 and all(f"lost rank {victim} " in line for line in lines), lines
    assert "Traceback" not in log


def test_a_signalled_rank_checkpoints_the_step_and_every_process_exits_to_resume_there(workdir):
    """A scheduler's SIGTERM to one rank of one node: every rank stops after the same step, writes
    its checkpoint, and exits 75 within train.preempt_grace; the rerun resumes from that step.
    (That a resumed run trains the undisturbed run's losses: the test below.)"""
    name, steps = "preempted", "train.steps=12"
    procs = launch_nodes(2, 2, args(workdir, "tiny-gpt2.yaml", name, steps, "train.checkpoint_every=1000"),
                         workdir / f"logs-{name}")
    try:
        wait_for_steps(workdir / "runs" / name, 3)
        os.kill(rank_pids(f"train.name={name}")[1], signal.SIGTERM)
        begun = time.time()
        while time.time() - begun < 90 and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        took = time.time() - begun
    finally:
        kill(procs)
    log = "\n".join((workdir / f"logs-{name}" / f"node{n}.log").read_text() for n in (0, 1))
    assert took < 60 and [p.returncode for p in procs] == [75, 75], (took, [p.returncode for p in procs], log[-3000:])
    stopped = json.loads((workdir / "runs" / name / "checkpoints" / "latest.json").read_text())["step"]
    assert 3 <= stopped < 12 and sorted(losses(workdir / "runs" / name)) == list(range(1, stopped + 1))
    lines = re.findall(r"train: preempted .*", log)  # one a node
    assert len(lines) == 2 and all(f"(SIGTERM) after step {stopped}; " in line and
                                   f"resume from step {stopped} (" in line for line in lines), lines
    assert "Traceback" not in log
    codes, log = two_nodes(workdir, "tiny-gpt2.yaml", name, steps, "train.checkpoint_every=1000")
    assert codes == [0, 0] and f"resumed from step {stopped}" in log, log[-3000:]
    assert sorted(losses(workdir / "runs" / name)) == list(range(1, 13))


def test_a_node_killed_while_writing_a_checkpoint_resumes_from_the_one_before(workdir, four_steps):
    """Node 1's ranks die with their share of step 4's checkpoint on disk: step 2 stays the newest
    complete one, and the rerun of both nodes reproduces the uninterrupted curve bit for bit."""
    name = "killed-ckpt"
    codes, log = two_nodes(workdir, "tiny-gpt2.yaml", name, "train.dist_timeout=10",
                           node_env={1: {"RETROPIPE_KILL_AFTER": "checkpoint:4"}})
    assert codes[1] != 0 and codes[0] != 0, (codes, log[-3000:])
    ckpts = workdir / "runs" / name / "checkpoints"
    assert json.loads((ckpts / "latest.json").read_text())["step"] == 2
    assert (ckpts / "step000004").is_dir() and not (ckpts / "step000004" / "state.json").exists()
    codes, log = two_nodes(workdir, "tiny-gpt2.yaml", name, "train.dist_timeout=10")
    assert codes == [0, 0] and "resumed from step 2" in log, log[-3000:]
    uninterrupted = losses(four_steps("tiny-gpt2.yaml", 2)[0])
    assert sorted(uninterrupted) == [1, 2, 3, 4] and losses(workdir / "runs" / name) == uninterrupted


def test_a_run_directory_the_nodes_do_not_share_is_refused(workdir, tmp_path):
    """Node 1 sees another directory at the workdir's path (here: another path, the same data)."""
    shutil.copytree(workdir / "data", tmp_path / "data")
    procs = launch_nodes(2, 2, args(workdir, "tiny-gpt2.yaml", "unshared"), workdir / "logs-unshared",
                         node_args={1: args(tmp_path, "tiny-gpt2.yaml", "unshared")},
                         env={"RETROPIPE_SHARED_WAIT": "3"})  # not the 60 s an NFS client may need
    deadline = time.time() + 120
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    kill(procs)
    log = (workdir / "logs-unshared" / "node0.log").read_text()
    assert all(p.returncode == 2 for p in procs), ([p.returncode for p in procs], log[-3000:])
    assert "is not shared between the nodes: rank(s) [2, 3]" in log, log[-3000:]


def test_three_replicas_finish_with_rounding_drift_in_the_tied_embedding(workdir):
    """2 stages × 3 replicas: each stage's replicas all-reduce the tied embedding's gradient over
    their own group, in another order, and the copies differ in their last bits."""
    code, log = train(6, args(workdir, "tiny-gpt2.yaml", "three", "train.steps=3"), workdir / "logs-three")
    assert code == 0, log[-3000:]
    assert "pipeline: 2 stages × 3 data parallel" in log
    summary = json.loads((workdir / "runs" / "three" / "summary.json").read_text())
    assert 0 < summary["tied_embedding_max_diff"] < 1e-6, summary
    assert "differ by rounding at the end of training" in log
