"""DeepSpeed pipeline training on 2 CPU processes (gloo): real DeepSpeed, no mocks."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from retropipe.data.errors import ConfigError, DataError
from retropipe.data.prepare import prepare
from retropipe.launch.config import load_config
from retropipe.training.run.hardware import inductor_cxx
from tests.distributed import (PORT_TAKEN, ROOT, assert_mfu_counts_the_heads_work_on_targets_only, free_port,
                               read_tensorboard, train)

# A model small enough that a step takes a fraction of a second on one core.
TINY = ["data.chunk_len=16", "data.max_documents=300", "data.validation_fraction=0.1", "train.seq_len=64",
        "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.n_positions=64", "model.encoder_layers=1",
        "model.encoder_embd=16", "model.encoder_head=2", "train.micro_batch_size=2", "train.micro_batches=2",
        "train.steps=8", "train.precision=fp32", "train.eval_every=0", "train.eval_batches=2",
        "train.checkpoint_every=3", "train.warmup_steps=1", "train.lr=2e-2", "train.min_lr=2e-3",
        "eval.window=64", "eval.stride=32"]


def sets(*overrides):
    return [a for o in [*TINY, *overrides] for a in ("--set", o)]


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def logged_steps(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl in file order (a step logged twice shows twice)."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    wd = tmp_path_factory.mktemp("train")
    cfg = load_config(ROOT / "configs" / "tiny-gpt2.yaml", [f"workdir={wd}", *TINY])
    prepare(cfg.data, cfg.data_dir, progress=False)
    return wd


@pytest.fixture(scope="module")
def reference_run(workdir):
    """GPT-2, 2 pipeline stages on 2 processes, through the real `deepspeed` launcher."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    for _ in range(3):
        # A port of its own: the launcher's default (29500) may be taken by another run on the
        # machine (and a free port taken before rank 0 listens: then start again).
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               "launch/train.py", "--config", "configs/tiny-gpt2.yaml",
               *sets(f"workdir={workdir}", "train.name=ref")]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=400)
        if proc.returncode == 0 or PORT_TAKEN not in proc.stdout + proc.stderr:
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return workdir / "runs" / "ref", proc.stdout + proc.stderr


@pytest.mark.slow
def test_baseline_trains_on_two_pipeline_stages(reference_run):
    run_dir, stdout = reference_run
    assert "2 stages × 1 data parallel" in stdout and "stage 1:" in stdout
    # The ranks print RetroPipe's lines, not DeepSpeed's per-rank prints and repeated warnings.
    for noise in ("SEED_LAYERS", "Using topology", "before it has started", "c10d::broadcast_"):
        assert noise not in stdout, noise
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 9))
    assert curve[8] < curve[1] - 0.3, curve
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tied_embedding_max_diff"] == 0.0  # the head on stage 1 is still the embedding
    # Each rank's peak memory: two processes, each holding at least its stage (and torch itself).
    rss = summary["peak_memory_mb"]["host_rss_mb"]
    assert len(rss) == 2 and all(100 < mb < 20_000 for mb in rss), rss
    assert "train: peak memory per rank: " in stdout
    assert_mfu_counts_the_heads_work_on_targets_only(run_dir)
    from retropipe.training.models.io import load_model
    model = load_model(run_dir / "model")
    assert model(torch.zeros(1, 64, dtype=torch.int64)).shape == (1, 64, 50257)
    assert (run_dir / "tensorboard").is_dir() and (run_dir / "checkpoints" / "latest.json").exists()
    hparams, text, scalars = read_tensorboard(run_dir / "tensorboard")  # the config beside the curves
    assert hparams["train.lr"] == pytest.approx(0.02) and hparams["train.name"] == "ref" and "lr: 0.02" in text
    assert [step for step, _ in scalars["loss"]] == list(range(1, 9))
    ds_json = json.loads((run_dir / "deepspeed_config.json").read_text())  # what DeepSpeed was given
    assert ds_json["zero_optimization"] == {"stage": 1} and ds_json["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.slow
def test_two_stages_equal_one_stage(workdir, reference_run):
    # The 1-stage run also takes the plain output head (all logits, then the loss): the fused,
    # sliced head of the reference run must train exactly the same.
    code, log = train(1, ["--config", "configs/tiny-gpt2.yaml", "--verbose", "--no-progress",
                          *sets(f"workdir={workdir}", "train.name=one", "train.pipeline_stages=1",
                                "train.fused_head=false")],
                      workdir / "logs-one")
    assert code == 0, log[-3000:]
    assert "Using topology" in log  # --verbose: DeepSpeed's own output too
    assert "train one:" not in log and "it/s" not in log  # --no-progress: no bar
    one, two = losses(workdir / "runs" / "one"), losses(reference_run[0])
    assert one.keys() == two.keys()
    for step in one:
        assert abs(one[step] - two[step]) < 1e-4, (step, one[step], two[step])


@pytest.mark.slow
@pytest.mark.skipif(inductor_cxx() is None, reason="torch.compile on a CPU needs g++ (or $CXX)")
def test_compiled_blocks_train_as_the_eager_ones(workdir, reference_run, tmp_path):
    # train.compile: each stage's blocks through torch.compile (C++ from inductor on a CPU), the
    # rest eager; a uniform cut puts a block on each stage, the second behind the cut's unpacking.
    # The other runs here leave dynamo off (TORCHDYNAMO_DISABLE, to skip its import); this one
    # turns it on: the inductor cache shows kernels were built, and each rank's compile trace
    # (TORCH_TRACE, tlparse's log) that dynamo compiled its block, not ran it eager. The ranks
    # share one cache, as on one machine by default: a kernel both stages need is built once.
    cache, traces = tmp_path / "inductor", {rank: tmp_path / f"trace{rank}" for rank in (0, 1)}
    code, log = train(2, ["--config", "configs/tiny-gpt2.yaml", "--no-progress",
                          *sets(f"workdir={workdir}", "train.name=compiled", "train.compile=true",
                                "train.partition=uniform")],
                      workdir / "logs-compiled", timeout=400,
                      env={"TORCHDYNAMO_DISABLE": "0", "TORCHINDUCTOR_CACHE_DIR": str(cache)},
                      rank_env={rank: {"TORCH_TRACE": str(t)} for rank, t in traces.items()})
    assert code == 0, log[-3000:]
    assert "compile: stage 0: blocks.0 through torch.compile\n" in log, log[-2000:]
    assert "compile: stage 1: blocks.1 through torch.compile\n" in log, log[-2000:]
    assert any(cache.rglob("*.so")), "inductor built no kernel"
    for rank, trace in traces.items():
        traced = any('"dynamo_start"' in f.read_text() for f in trace.glob("*.log"))
        assert traced, f"rank {rank}: dynamo compiled nothing"
    compiled, eager = losses(workdir / "runs" / "compiled"), losses(reference_run[0])
    assert compiled.keys() == eager.keys()
    for step in compiled:  # the same training to float rounding (fused kernels sum in another order)
        assert abs(compiled[step] - eager[step]) < 1e-4, (step, compiled[step], eager[step])


@pytest.mark.slow
def test_two_data_parallel_replicas_train_and_export(workdir, reference_run):
    # 1 stage × 2 replicas: the export gathers ZeRO-1's sharded master weights, a collective every
    # replica must join (a replica that skipped it hung the run after its last step).
    code, log = train(2, ["--config", "configs/tiny-gpt2.yaml",
                          *sets(f"workdir={workdir}", "train.name=dp2", "train.pipeline_stages=1")],
                      workdir / "logs-dp2", timeout=240)
    assert code == 0, log[-3000:]
    assert "1 stages × 2 data parallel" in log
    curve = losses(workdir / "runs" / "dp2")
    assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1] - 0.3, curve
    from retropipe.training.models.io import load_model
    model = load_model(workdir / "runs" / "dp2" / "model")
    ref = load_model(reference_run[0] / "model")
    # Twice the tokens per step of the reference: the same initial weights, different trained ones.
    assert model.wte.weight.shape == ref.wte.weight.shape
    assert not torch.equal(model.wte.weight, ref.wte.weight)


@pytest.mark.slow
def test_kill_and_resume_reproduces_the_loss_curve(workdir, reference_run):
    from retropipe.data.stage import KILL_AFTER_ENV

    args = ["--config", "configs/tiny-gpt2.yaml", *sets(f"workdir={workdir}", "train.name=killed")]
    run_dir = workdir / "runs" / "killed"
    # Every rank SIGKILLs itself right after step 5, past the step-3 checkpoint (checkpoint_every=3).
    code, log = train(2, args, workdir / "logs-killed", env={KILL_AFTER_ENV: "train:5"})
    assert code == -signal.SIGKILL, log[-3000:]
    assert not (run_dir / "summary.json").exists()
    assert logged_steps(run_dir) == [1, 2, 3, 4, 5]
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] == 3
    code, log = train(2, args, workdir / "logs-resumed")
    assert code == 0, log[-3000:]
    assert "resumed from step 3" in log and "train killed" in log  # (the progress bar, by default)
    resumed, reference = losses(run_dir), losses(reference_run[0])
    assert logged_steps(run_dir) == list(range(1, 9))  # steps 4 and 5 were dropped, then logged again
    for step in resumed:
        assert abs(resumed[step] - reference[step]) < 1e-5, (step, resumed[step], reference[step])
    done = train(2, args, workdir / "logs-done")
    assert done[0] == 0 and "is complete" in done[1]  # idempotent


@pytest.mark.slow
def test_parameter_groups_train_on_two_stages_in_fp32_and_bf16(workdir, reference_run):
    """AdamW's decay and no-decay groups on every stage, ZeRO-1 in fp32 and in bf16 (DeepSpeed's
    BF16_Optimizer). train.partition=parameters puts the embeddings alone on stage 0: no vector
    there, so a placeholder keeps its no-decay group. Groups that differ between stages hang the
    pipelined ZeRO-1 (a timeout here); a placeholder that moved or counted would change the loss."""
    reference = losses(reference_run[0])
    for precision, tolerance in (("fp32", 1e-5), ("bf16", 0.05)):
        name = f"groups-{precision}"
        code, log = train(2, ["--config", "configs/tiny-gpt2.yaml",
                              *sets(f"workdir={workdir}", f"train.name={name}", "train.partition=parameters",
                                    f"train.precision={precision}")], workdir / f"logs-{name}")
        assert code == 0, log[-3000:]
        assert "stage 0: wte, wpe\n" in log, log[-2000:]
        curve = losses(workdir / "runs" / name)
        assert curve.keys() == reference.keys()
        for step in curve:  # bf16: the same curve within rounding (a lost gradient is off by ~1 nat)
            assert abs(curve[step] - reference[step]) < tolerance, (precision, step, curve[step], reference[step])
    # DeepSpeed without ZeRO, through the passthrough: its checkpoint holds no ZeRO partitions.
    code, log = train(2, ["--config", "configs/tiny-gpt2.yaml",
                          *sets(f"workdir={workdir}", "train.name=zero0", "train.grad_clip=0",
                                "train.deepspeed={zero_optimization: {stage: 0}}")], workdir / "logs-zero0")
    assert code == 0, log[-3000:]
    ckpt = workdir / "runs" / "zero0" / "checkpoints" / "step000008"
    assert list(ckpt.glob("mp_rank_*_model_states.pt")) and not list(ckpt.glob("zero_*")), sorted(ckpt.iterdir())
    assert (workdir / "runs" / "zero0" / "summary.json").exists()
    curve = losses(workdir / "runs" / "zero0")
    assert curve[8] < curve[1] - 0.3, curve


def scheduled_lrs(steps: int) -> list[float]:
    """lrs[i]: the learning rate after i + 1 optimizer steps, by DeepSpeed's WarmupCosineLR as the
    adapter configures it for a run of `steps` steps (TINY's lr and warmup)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from retropipe.training.pipeline.deepspeed_config import generated_config

    train_cfg = load_config(ROOT / "configs" / "tiny-gpt2.yaml", [*TINY, f"train.steps={steps}"]).train
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=train_cfg.lr)
    sched = WarmupCosineLR(opt, **generated_config(train_cfg)["scheduler"]["params"])
    lrs = []
    for _ in range(steps):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.slow
def test_a_finished_run_extends_to_more_steps(workdir, reference_run):
    import shutil

    run_dir = workdir / "runs" / "extended"
    shutil.copytree(reference_run[0], run_dir)  # a finished 8-step run (config.yaml says train.name=ref)
    args = ["--config", "configs/tiny-gpt2.yaml", *sets(f"workdir={workdir}", "train.name=extended", "train.steps=12")]
    code, log = train(2, args, workdir / "logs-extended")
    assert code == 0, log[-3000:]
    lrs, old = scheduled_lrs(12), scheduled_lrs(8)
    # Step 9 runs at the 12-step schedule's rate, not at the 8-step one's floor saved in the checkpoint.
    assert f"resumed from step 8; lr {lrs[7]:.6g} next, on a schedule of 12 steps" in log, log[-2000:]
    assert lrs[7] > 2 * old[7]
    assert logged_steps(run_dir) == list(range(1, 13))
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    reference = losses(reference_run[0])
    assert all(records[s]["loss"] == reference[s] for s in range(1, 9))
    for s in range(9, 13):
        assert records[s]["lr"] == pytest.approx(lrs[s - 1], rel=1e-9), (s, records[s]["lr"], lrs[s - 1])
    assert records[12]["loss"] < reference[1] - 0.3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["resumed_from"] == 8
    done = train(2, args, workdir / "logs-extended-done")
    assert done[0] == 0 and "is complete (12 steps" in done[1]
    code, log = train(2, [*args, "--set", "train.steps=8"], workdir / "logs-extended-fewer")
    assert code == 2 and "config key 'train.steps'" in log and "has trained 12 steps already" in log, log[-2000:]
    assert "Traceback" not in log


@pytest.mark.slow
def test_a_branch_continues_another_runs_checkpoint_exactly(workdir, reference_run):
    source = reference_run[0] / "checkpoints" / "step000006"
    run_dir = workdir / "runs" / "branch"
    args = ["--config", "configs/tiny-gpt2.yaml", *sets(f"workdir={workdir}", "train.name=branch",
                                                       f"train.branch_from={source}")]
    code, log = train(2, args, workdir / "logs-branch")
    assert code == 0, log[-3000:]
    assert f"branched from {source} at step 6" in log, log[-2000:]
    assert logged_steps(run_dir) == [7, 8]
    branch, reference = losses(run_dir), losses(reference_run[0])
    for step in (7, 8):  # weights, AdamW moments, schedule position and data order carried over
        assert abs(branch[step] - reference[step]) < 1e-5, (step, branch[step], reference[step])
    assert json.loads((run_dir / "summary.json").read_text())["branched_from"] == str(source)
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] == 8  # its own now


def test_misconfigurations_are_refused_before_any_work(workdir, monkeypatch):
    from retropipe.launch.train import preflight

    def cfg(*overrides, config="tiny-gpt2.yaml"):
        return load_config(ROOT / "configs" / config, [f"workdir={workdir}", *TINY, *overrides])

    with pytest.raises(ConfigError, match="world size 2 is not divisible by 3 pipeline stages"):
        preflight(cfg("train.pipeline_stages=3"), 2)
    with pytest.raises(ConfigError, match="40 stages for a model of 6 pipeline layers"):
        preflight(cfg("train.pipeline_stages=40"), 40)
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        preflight(cfg("train.precision=fp16"), 2)
    with pytest.raises(ConfigError, match=r"train\.deepspeed\.zero_optimization\.stage': 3: .*stage 0 or 1 only"):
        preflight(cfg("train.deepspeed={zero_optimization: {stage: 3}}"), 2)
    with pytest.raises(ConfigError, match=r"train\.deepspeed\.gradient_accumulation_steps': is set by train\.micro_batches"):
        preflight(cfg("train.deepspeed={gradient_accumulation_steps: 16}"), 2)
    with pytest.raises(DataError, match="no prepared data"):
        preflight(cfg(f"workdir={workdir / 'nowhere'}"), 2)
    with pytest.raises(ConfigError, match="prepared with chunk_len 16"):
        preflight(load_config(ROOT / "configs" / "tiny-gpt2.yaml", [f"workdir={workdir}", *TINY,
                                                                   "data.chunk_len=32"]), 2)
    with pytest.raises(DataError, match="neighbours"):
        preflight(cfg(config="tiny-retro.yaml"), 2)
    with pytest.raises(ConfigError, match="every stage a RETRO"):  # 2 layers hold a single CCA layer
        preflight(cfg("model.freeze_trunk=true", f"train.init_from={workdir}", config="tiny-retro.yaml"), 2)
    if not torch.cuda.is_available():  # inductor builds C++ on a CPU: no compiler, no compiling
        monkeypatch.setenv("CXX", str(workdir / "no-such-compiler"))
        monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
        with pytest.raises(ConfigError, match=r"'train\.compile': .*neither is on PATH"):
            preflight(cfg("train.compile=true"), 2)
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # dynamo off: the blocks run eager, nothing to refuse
        preflight(cfg("train.compile=true"), 2)
    # The command line: one line on stderr naming the key, exit code 2, no process group started,
    # nothing written.
    for bad, key in ((f"train.init_from={workdir / 'no-such-model'}", "train.init_from"),
                     (f"train.branch_from={workdir / 'no-such-run'}", "train.branch_from")):
        proc = subprocess.run([sys.executable, "launch/train.py", "--config", "configs/tiny-gpt2.yaml",
                               *sets(f"workdir={workdir}", "train.name=bad", bad)], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"})
        assert proc.returncode == 2 and f"config key '{key}'" in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert not (workdir / "runs" / "bad").exists()
    proc = subprocess.run([sys.executable, "launch/train.py", "--config", "configs/tiny-gpt2.yaml",
                           *sets(f"workdir={workdir}", "train.pipeline_stages=3")], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"})
    assert proc.returncode == 2 and "train.pipeline_stages" in proc.stderr


def test_a_run_directory_refuses_another_run_but_not_other_stage_settings(tmp_path):
    from retropipe.training.run import TrainingError
    from retropipe.training.run.run_dir import claim_run_dir

    def cfg(*overrides):
        return load_config(ROOT / "configs" / "tiny-retro.yaml", [f"workdir={tmp_path}", *TINY, *overrides])

    claim_run_dir(cfg(), tmp_path / "run", write=True)
    claim_run_dir(cfg("eval.stride=16", "retrieval.embed_actors=1", "data.num_workers=1"), tmp_path / "run", write=False)
    # Each section's RUNTIME_KEYS may change; so may what only watches or keeps the run.
    claim_run_dir(cfg("data.on_bad_record=skip", "train.eval_every=1", "train.keep_checkpoints=5"), tmp_path / "run",
                  write=False)
    with pytest.raises(TrainingError, match=r"retrieval\.align_neighbours True → False"):
        # Not a key that changes the retrieval files, but one that changes what training reads.
        claim_run_dir(cfg("retrieval.align_neighbours=false", "retrieval.aligned_only=false"), tmp_path / "run",
                      write=False)
    with pytest.raises(TrainingError, match=r"train\.lr 0\.02 → 0\.01"):
        claim_run_dir(cfg("train.lr=1e-2"), tmp_path / "run", write=False)
    with pytest.raises(TrainingError, match=r"retrieval\.k"):
        claim_run_dir(cfg("retrieval.k=1", "train.neighbours=1", "eval.neighbours=1", "eval.more_neighbours=0"),
                      tmp_path / "run", write=False)
    # A run made before a key existed (its config.yaml lacks it) had the key's default: it is still
    # this run; another value is not.
    import yaml
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    del saved["data"]["whitespace"]
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(saved))
    claim_run_dir(cfg("data.whitespace=keep"), tmp_path / "run", write=False)
    with pytest.raises(TrainingError, match=r"data\.whitespace 'keep' → 'collapse'"):
        claim_run_dir(cfg(), tmp_path / "run", write=False)      # configs/tiny.yaml collapses
