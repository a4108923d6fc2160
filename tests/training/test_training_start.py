"""Where a run starts (training/run/start.py): resume, extend, branch, warm start, complete. In-process:
run directories are written by hand here; tests/launch/test_training.py runs them for real."""

import json

import pytest
import yaml

from retropipe.data.errors import ConfigError
from retropipe.launch.config import load_config
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2
from retropipe.training.models.io import save_model
from retropipe.training.run import TrainingError
from retropipe.training.run.run_dir import claim_run_dir
from retropipe.training.run.start import check_branch, check_init_from, keep_global_batch, plan_start

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
SHAPE = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.n_positions=64", "data.chunk_len=16",
         "train.seq_len=64", "eval.window=64", "eval.stride=32", "train.steps=8"]
PARTS = [0, 4, 6]


def cfg(tmp_path, *overrides, config="tiny-gpt2.yaml"):
    return load_config(ROOT / "configs" / config, [f"workdir={tmp_path}", *SHAPE, *overrides])


def fake_run(run_dir, config, steps_done, checkpoints=(3, 6, 8), complete=True, ranks=2):
    """A run directory as launch/train.py leaves it (checkpoint files only by name)."""
    claim_run_dir(config, run_dir, write=True)
    (run_dir / "partition.json").write_text(json.dumps({"parts": PARTS}))
    for step in checkpoints:
        ckpt = run_dir / "checkpoints" / f"step{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"step": step}))
        for r in range(ranks):
            (ckpt / f"rng_rank{r:03d}.pt").write_bytes(b"")
    last = max(checkpoints)
    (run_dir / "checkpoints" / "latest.json").write_text(json.dumps({"tag": f"step{last:06d}", "step": last}))
    if complete:
        (run_dir / "summary.json").write_text(json.dumps({"complete": True, "steps": steps_done}))


def test_a_finished_run_is_complete_at_its_steps_and_extends_past_them(tmp_path):
    run = tmp_path / "runs" / "gpt2"
    fake_run(run, cfg(tmp_path), 8)
    assert plan_start(cfg(tmp_path), run, 2, PARTS).kind == "complete"
    longer = cfg(tmp_path, "train.steps=12")
    claim_run_dir(longer, run, write=False)  # more steps: the same run, extended
    start = plan_start(longer, run, 2, PARTS)
    assert (start.kind, start.step, start.tag, start.ckpt_dir) == ("resume", 8, "step000008", run / "checkpoints")
    with pytest.raises(ConfigError, match=r"train\.steps.*5, but .* has trained 8 steps already.*branch_from"):
        plan_start(cfg(tmp_path, "train.steps=5"), run, 2, PARTS)
    with pytest.raises(TrainingError, match=r"train\.lr"):  # another learning rate is another run
        claim_run_dir(cfg(tmp_path, "train.steps=12", "train.lr=0.5"), run, write=False)


def test_an_interrupted_run_resumes_and_a_new_one_starts_fresh(tmp_path):
    run = tmp_path / "runs" / "gpt2"
    assert plan_start(cfg(tmp_path), run, 2, PARTS).kind == "fresh"
    fake_run(run, cfg(tmp_path), 8, checkpoints=(3,), complete=False)
    assert plan_start(cfg(tmp_path), run, 2, PARTS).step == 3
    assert plan_start(cfg(tmp_path), run, 2, [0, 3, 6]).step == 3  # another cut of the same layers resumes
    with pytest.raises(TrainingError, match="hold a model of 6 pipeline layers, but this RetroPipe builds 7"):
        plan_start(cfg(tmp_path), run, 2, [0, 4, 7])  # checkpoints of another layer list never load
    (run / "summary.json").write_text(json.dumps({"steps": 4}))
    for path in (run / "checkpoints").rglob("*"):
        path.unlink() if path.is_file() else None
    with pytest.raises(TrainingError, match="holds no checkpoint to continue from"):
        plan_start(cfg(tmp_path, "train.steps=12"), run, 2, PARTS)


def test_a_branch_starts_from_another_runs_checkpoint(tmp_path):
    source = tmp_path / "runs" / "gpt2"
    fake_run(source, cfg(tmp_path), 8)
    branch = cfg(tmp_path, "train.name=b", "train.steps=12", "train.lr=0.01", f"train.branch_from={source}")
    start = plan_start(branch, tmp_path / "runs" / "b", 2, PARTS)
    assert (start.kind, start.step, start.ckpt_dir, start.tag) == ("branch", 8, source / "checkpoints", "step000008")
    at6 = cfg(tmp_path, "train.name=b", f"train.branch_from={source / 'checkpoints' / 'step000006'}")
    assert plan_start(at6, tmp_path / "runs" / "b", 2, PARTS).step == 6
    # Once the branch has a checkpoint of its own, it resumes from that.
    fake_run(tmp_path / "runs" / "b", branch, 12, checkpoints=(10,), complete=False)
    assert plan_start(branch, tmp_path / "runs" / "b", 2, PARTS).ckpt_dir == tmp_path / "runs" / "b" / "checkpoints"


@pytest.mark.parametrize("overrides,world,parts,message", [
    (["model.n_layer=4"], 2, PARTS, r"differs in model\.n_layer 2 vs 4"),
    (["train.precision=bf16"], 2, PARTS, r"train\.precision 'fp32' vs 'bf16'"),
    ([], 4, PARTS, r"2 processes vs 4"),
    ([], 2, [0, 2, 6], r"pipeline cut \[0, 4, 6\] vs \[0, 2, 6\]"),
    (["train.steps=6"], 2, PARTS, r"train\.steps.*6, but the checkpoint .* is at step 8: nothing to train"),
])
def test_a_branch_that_cannot_continue_the_checkpoint_is_refused(tmp_path, overrides, world, parts, message):
    source = tmp_path / "runs" / "gpt2"
    fake_run(source, cfg(tmp_path, "train.precision=fp32"), 8)
    branch = cfg(tmp_path, "train.name=b", "train.precision=fp32", f"train.branch_from={source}", *overrides)
    with pytest.raises(ConfigError, match=message):
        plan_start(branch, tmp_path / "runs" / "b", world, parts)


def test_branch_from_names_the_key_for_a_bad_path(tmp_path):
    run = tmp_path / "runs" / "gpt2"
    fake_run(run, cfg(tmp_path), 8, complete=False)
    for path, message in ((tmp_path / "nowhere", "does not exist"), (tmp_path, "holds no complete checkpoint")):
        with pytest.raises(ConfigError, match=rf"train\.branch_from'.*{message}"):
            plan_start(cfg(tmp_path, "train.name=x", f"train.branch_from={path}"), tmp_path / "runs" / "x", 2, PARTS)
    with pytest.raises(ConfigError, match=r"train\.branch_from'.*is this run's own checkpoint"):
        check_branch(cfg(tmp_path, f"train.branch_from={run}"), run, 2, PARTS)
    with pytest.raises(ConfigError, match=r"train\.branch_from'.*not both"):
        cfg(tmp_path, f"train.branch_from={run}", f"train.init_from={run}")


def test_init_from_is_checked_before_any_work(tmp_path):
    model = cfg(tmp_path).model
    with pytest.raises(ConfigError, match=r"train\.init_from'.*nowhere: no such directory"):
        check_init_from(str(tmp_path / "nowhere"), model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"train\.init_from'.*no config\.json"):
        check_init_from(str(tmp_path / "empty"), model)
    save_model(GPT2(ModelConfig(kind="gpt2", n_layer=2, n_head=2, n_embd=64, n_positions=64)), tmp_path / "wide")
    with pytest.raises(ConfigError, match=r"another shape than this model \(model\.n_embd 32 vs 64\)"):
        check_init_from(str(tmp_path / "wide"), model)
    save_model(GPT2(ModelConfig(kind="gpt2", n_layer=2, n_head=2, n_embd=32, n_positions=64)), tmp_path / "good")
    check_init_from(str(tmp_path / "good"), model)
    check_init_from(str(tmp_path / "good"), cfg(tmp_path, config="tiny-retro.yaml").model)  # a RETRO-fit's trunk
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2,
                                                             "n_embd": 32, "n_positions": 1024, "vocab_size": 50257}))
    with pytest.raises(ConfigError, match=r"model\.n_positions 64 vs 1024"):
        check_init_from(str(tmp_path / "hf"), model)
    # plan_start checks it for a fresh run.
    with pytest.raises(ConfigError, match=r"train\.init_from"):
        plan_start(cfg(tmp_path, f"train.init_from={tmp_path / 'wide'}"), tmp_path / "runs" / "w", 2, PARTS)


def test_the_run_config_records_the_new_steps(tmp_path):
    run = tmp_path / "runs" / "gpt2"
    fake_run(run, cfg(tmp_path), 8)
    claim_run_dir(cfg(tmp_path, "train.steps=12"), run, write=True)
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 12


def test_a_run_trained_under_another_alignment_rule_is_another_run(tmp_path):
    import re

    from retropipe.data.reading import ALIGNMENT_RULE

    retro = cfg(tmp_path, config="tiny-retro.yaml")
    claim_run_dir(retro, tmp_path / "retro", write=True)
    rules = tmp_path / "retro" / "rules.json"
    assert json.loads(rules.read_text()) == {"alignment_rule": ALIGNMENT_RULE}
    rules.write_text(json.dumps({"alignment_rule": "most-matches"}))
    with pytest.raises(TrainingError, match=rf"another rule .*alignment_rule 'most-matches' → {re.escape(repr(ALIGNMENT_RULE))}"):
        claim_run_dir(retro, tmp_path / "retro", write=False)
    # A run directory older than rules.json resumes unchecked and is not labelled with this rule.
    rules.unlink()
    claim_run_dir(retro, tmp_path / "retro", write=True)
    assert not rules.exists()
    # GPT-2, and RETRO without alignment, follow no alignment rule.
    claim_run_dir(cfg(tmp_path), tmp_path / "gpt2", write=True)
    assert json.loads((tmp_path / "gpt2" / "rules.json").read_text()) == {"alignment_rule": None}
    unaligned = cfg(tmp_path, "retrieval.align_neighbours=false", "retrieval.aligned_only=false", config="tiny-retro.yaml")
    claim_run_dir(unaligned, tmp_path / "unaligned", write=True)
    assert json.loads((tmp_path / "unaligned" / "rules.json").read_text()) == {"alignment_rule": None}
    # rules.json left by a claim killed before config.yaml: the next claim starts the run afresh.
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "rules.json").write_text(json.dumps({"alignment_rule": "most-matches"}))
    claim_run_dir(retro, tmp_path / "killed", write=True)
    assert json.loads((tmp_path / "killed" / "rules.json").read_text()) == {"alignment_rule": ALIGNMENT_RULE}


def test_runs_and_models_from_before_the_copy_gate_are_read_as_without_it(tmp_path):
    """model.copy_gate defaults to on, but a run's config.yaml or a model's config.json written
    before the key existed had no gate: each is read as copy_gate false, so such a run is not
    resumed by a config with the gate, and such a model loads (training/models/config.py BEFORE_THE_FIELD)."""
    from retropipe.training.models.registry import build_model
    from retropipe.training.models.io import load_model, save_model

    retro = cfg(tmp_path, config="tiny-retro.yaml")
    assert retro.model.copy_gate
    run = tmp_path / "retro"
    claim_run_dir(retro, run, write=True)
    old = yaml.safe_load((run / "config.yaml").read_text())
    del old["model"]["copy_gate"]
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(TrainingError, match=r"model\.copy_gate False → True"):
        claim_run_dir(retro, run, write=False)
    claim_run_dir(cfg(tmp_path, "model.copy_gate=false", config="tiny-retro.yaml"), run, write=False)
    ungated = cfg(tmp_path, "model.copy_gate=false", config="tiny-retro.yaml").model
    save_model(build_model(ungated), tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    del saved["copy_gate"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(saved))
    assert not load_model(tmp_path / "m").cfg.copy_gate


def test_a_start_error_is_printed_by_rank_0_at_once_and_by_another_rank_only_if_it_outlives_the_grace(
        monkeypatch, capsys):
    """Every rank fails the same checks, and the launcher stops all ranks when the first exits: rank
    0 prints at once, another rank only after launch/train.py's ERROR_GRACE (by then rank 0 has ended
    the job if it failed too), naming itself, so a rank that fails alone still says why."""
    import time

    from retropipe.launch import train

    monkeypatch.setattr(train, "ERROR_GRACE", 0.3)
    began = time.perf_counter()
    train.report_start_error(0, "config key 'train.steps': 8, but ...")
    assert time.perf_counter() - began < 0.2
    assert capsys.readouterr().err == "train: error: config key 'train.steps': 8, but ...\n"
    began = time.perf_counter()
    train.report_start_error(1, "no chunk store")
    assert time.perf_counter() - began >= 0.3
    assert capsys.readouterr().err == "train: error (rank 1): no chunk store\n"


def test_another_world_shape_resumes_from_the_elastic_state_and_keeps_the_global_batch(tmp_path):
    """DeepSpeed's own load needs the shape (processes, stages) that wrote the checkpoint; another
    shape resumes from its elastic/ state, or is refused in one line where it has none (2 ranks wrote
    fake_run's checkpoints). The global batch it trained on stays, the micro-batches follow."""
    run = tmp_path / "runs" / "gpt2"
    fake_run(run, cfg(tmp_path), 8, checkpoints=(3,), complete=False)
    same = plan_start(cfg(tmp_path), run, 2, PARTS)
    assert (same.step, same.elastic, same.global_batch) == (3, False, 0)
    with pytest.raises(TrainingError, match=r"written by 2 processes \(2 pipeline stages × 1 data-parallel replicas\) "
                                            r"and holds no elastic/ state .* this job has 4 processes \(2 pipeline "
                                            r"stages × 2 .* Resume it on 2 processes"):
        plan_start(cfg(tmp_path), run, 4, PARTS)
    (run / "checkpoints" / "step000003" / "elastic").mkdir()
    (run / "checkpoints" / "step000003" / "state.json").write_text(json.dumps(
        {"step": 3, "processes": 2, "pipeline_stages": 2, "global_batch": 8}))  # as Trainer.save records it
    assert not plan_start(cfg(tmp_path), run, 2, PARTS).elastic
    for world, parts, micro_batches in ((4, PARTS, 2), (1, [0, 6], 4), (8, [0, 2, 3, 4, 6], 2)):
        start = plan_start(cfg(tmp_path, "train.micro_batch_size=2"), run, world, parts)
        assert (start.elastic, start.global_batch) == (True, 8)
        train = keep_global_batch(cfg(tmp_path, "train.micro_batch_size=2", f"train.pipeline_stages={len(parts) - 1}").train,
                                  world, start)
        assert (train.micro_batches, train.global_batch) == (micro_batches, 8)
    with pytest.raises(ConfigError, match=r"train.global_batch.*8 sequences a step do not split into micro-batches "
                                          r"of 2 .* over 3 data-parallel replicas"):
        keep_global_batch(cfg(tmp_path, "train.micro_batch_size=2", "train.pipeline_stages=1").train, 3, start)
    with pytest.raises(ConfigError, match=r"train.global_batch.*16, but the run being resumed trains on 8"):
        keep_global_batch(cfg(tmp_path, "train.global_batch=16").train, 2, start)
