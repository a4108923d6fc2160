"""Config composition: YAML + --set overrides, unknown keys, types and cross-section rules."""

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retropipe.data.errors import ConfigError
from retropipe.launch.config import load_config, save_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_tiny_config_loads_and_overrides_apply(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["workdir=/tmp/x", "data.corpus=my.jsonl",
                                                      "data.chunk_len=32", "data.validation_fraction=0.1"])
    assert cfg.workdir == "/tmp/x" and cfg.data.corpus == "my.jsonl"
    assert cfg.data.chunk_len == 32 and cfg.data.validation_fraction == 0.1
    assert cfg.data_dir == Path("/tmp/x/data")


def test_unknown_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "data:\n  chunk_lenn: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "data.chunk_lenn" in str(e.value) and str(path) in str(e.value)


def test_unknown_section_and_override_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(write(tmp_path, "dataa: {}\n"))
    with pytest.raises(ConfigError, match="data.nope"):
        load_config(None, ["data.nope=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["data.chunk_len"])


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data.chunk_len.*expected int"):
        load_config(write(tmp_path, "data:\n  chunk_len: sixty-four\n"))
    with pytest.raises(ConfigError, match=r"data.num_workers.*expected int"):
        load_config(None, ["data.num_workers=true"])


def test_impossible_values_say_why(tmp_path):
    with pytest.raises(ConfigError, match=r"train.seq_len.*not a multiple of data.chunk_len"):
        load_config(None, ["train.seq_len=100", "data.chunk_len=64"])
    with pytest.raises(ConfigError, match=r"data.on_bad_record.*'error' or 'skip'"):
        load_config(None, ["data.on_bad_record=ignore"])
    with pytest.raises(ConfigError, match="data.validation_fraction"):
        load_config(None, ["data.validation_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"train.self_neighbours.*\[0, 1\]"):
        load_config(None, ["train.self_neighbours=1.5"])
    with pytest.raises(ConfigError, match=r"retrieval.aligned_only.*align_neighbours"):
        load_config(None, ["retrieval.aligned_only=true", "retrieval.align_neighbours=false"])
    with pytest.raises(ConfigError, match=r"eval.precision.*'auto', 'bf16' or 'fp32'"):
        load_config(None, ["eval.precision=fp16"])


def test_resolved_config_is_written(tmp_path):
    cfg = load_config(None, ["data.chunk_len=32", "train.seq_len=128"])
    out = save_config(cfg, tmp_path / "stage")
    again = load_config(out)
    assert again == cfg


def test_cli_reports_config_error_with_nonzero_exit(tmp_path):
    path = write(tmp_path, "data:\n  bogus: 1\n")
    proc = subprocess.run([sys.executable, "launch/prepare_data.py", "--config", str(path),
                           "--set", f"workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "data.bogus" in proc.stderr and str(path) in proc.stderr
    assert not (tmp_path / "data").exists()


def test_an_error_names_a_flag_as_a_flag_and_a_key_as_a_config_key():
    from retropipe.launch.cli import resolve_device

    assert str(ConfigError("data.chunk_len", "bad")) == "config key 'data.chunk_len': bad"
    assert str(ConfigError("--device", "bad")) == "flag '--device': bad"
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ConfigError, match=r"^flag '--device': cuda was asked for"):
            resolve_device("cuda")


def test_chunk_len_has_one_source_of_truth():
    cfg = load_config(None, ["data.chunk_len=32", "train.seq_len=128"])
    assert cfg.model.chunk_len == 32
    with pytest.raises(ConfigError, match="set data.chunk_len instead"):
        load_config(None, ["model.chunk_len=16"])


def test_cpu_threads_share_a_pipelines_cores_not_another_replicas(monkeypatch):
    from retropipe.training.run import hardware

    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 8)
    assert hardware.cpu_threads("shared", local_processes=2, stages=2) == 8    # one pipeline: its stages take turns
    assert hardware.cpu_threads("shared", local_processes=4, stages=2) == 4    # two replicas side by side
    assert hardware.cpu_threads("split", local_processes=4, stages=2) == 2
    assert hardware.thread_environment("shared", 2, 2) == {"OMP_NUM_THREADS": "8", "OMP_WAIT_POLICY": "PASSIVE"}


RETRO_STAGE = "train RETRO from the baseline's weights"


def test_demo_quiets_the_deepspeed_launcher_unless_verbose(monkeypatch, tmp_path):
    from retropipe.launch.demo import stages

    def train_cmd():
        return dict(stages("configs/tiny.yaml", "corpus/jargon_devil.jsonl.gz", [], 2, tmp_path))[RETRO_STAGE]

    monkeypatch.delenv("RETROPIPE_VERBOSE", raising=False)
    cmd = train_cmd()
    assert cmd[cmd.index("--log_level") + 1] == "warning" and cmd.index("--log_level") < cmd.index("launch/train.py")
    monkeypatch.setenv("RETROPIPE_VERBOSE", "1")
    assert "--log_level" not in train_cmd()


def test_demo_database_holds_the_second_edition_it_writes_first(tmp_path):
    """The demo writes a second edition of its corpus before anything else, puts it in the database
    and asks for the database-size curve; the user's --set still win."""
    from retropipe.launch.config import load_config
    from retropipe.launch.demo import demo_overrides, edition_path, stages

    plan = stages("configs/tiny.yaml", "corpus/jargon_devil.jsonl.gz", [], 2, tmp_path)
    assert plan[0][0] == "write a second edition of the corpus"
    assert plan[0][1][-1] == str(edition_path(tmp_path)) and "--edited-only" in plan[0][1]
    cfg = load_config("configs/tiny.yaml", [*demo_overrides(tmp_path), f"workdir={tmp_path}"])
    assert cfg.retrieval.corpora == [str(edition_path(tmp_path))]
    assert cfg.eval.database_curve == [0, 0.5, 1]
    # BM25 neighbours, the best measured, and RETRO's distractor lessons with them (auto)
    assert cfg.retrieval.method == "bm25"
    assert load_config("configs/tiny.yaml", [*demo_overrides(tmp_path), "model.kind=retro"]).train.lessons.distractor == 0.1
    mine = load_config("configs/tiny.yaml", [*demo_overrides(tmp_path), "eval.database_curve=[]",
                                             "retrieval.method=dense"])
    assert mine.eval.database_curve == [] and mine.retrieval.method == "dense"


def test_demo_trains_retro_from_the_baseline_it_trains_first(tmp_path):
    """RETRO's stage warm-starts from the model the baseline's stage writes, which runs before it."""
    from retropipe.launch.config import load_config
    from retropipe.launch.demo import stages

    plan = stages("configs/tiny.yaml", "corpus/jargon_devil.jsonl.gz", [f"workdir={tmp_path}"], 2, tmp_path)
    names = [name for name, _ in plan]
    baseline, retro = names.index("train the GPT-2 baseline"), names.index(RETRO_STAGE)
    assert baseline < retro

    def config_of(cmd):
        return load_config("configs/tiny.yaml", [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"])

    base_cfg, retro_cfg = config_of(plan[baseline][1]), config_of(plan[retro][1])
    assert base_cfg.model.kind == "gpt2" and retro_cfg.model.kind == "retro"
    assert not retro_cfg.model.freeze_trunk  # the trunk trains on: a warm start, not a frozen RETRO-fit
    assert Path(retro_cfg.train.init_from) == base_cfg.runs_dir / base_cfg.train.name / "model"


def test_demo_trains_the_in_context_rival_only_when_asked(tmp_path):
    """eval.rivals holding in_context_trained adds a GPT-2 that reads its neighbours in context,
    from the baseline's weights, for RETRO's steps; the evaluation scores it beside the others."""
    from retropipe.launch.config import load_config
    from retropipe.launch.demo import IN_CONTEXT_RUN, stages

    plain = stages("configs/tiny.yaml", "corpus/jargon_devil.jsonl.gz", [f"workdir={tmp_path}"], 2, tmp_path)
    plan = dict(stages("configs/tiny.yaml", "corpus/jargon_devil.jsonl.gz", [f"workdir={tmp_path}"], 2, tmp_path,
                       in_context_trained=True))
    assert len(plan) == len(plain) + 1
    cmd = plan["train GPT-2 with neighbours in context from the baseline's weights"]
    cfg = load_config("configs/tiny.yaml", [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"])
    assert cfg.model.kind == "gpt2" and cfg.model.in_context == 1 and cfg.train.name == IN_CONTEXT_RUN
    assert Path(cfg.train.init_from) == cfg.runs_dir / "gpt2" / "model" and cfg.train.steps == 100
    assert str(cfg.runs_dir / IN_CONTEXT_RUN) in plan["evaluate"]


def test_demo_refuses_an_older_demos_runs_before_any_stage(tmp_path, capsys):
    """An older demo trained RETRO from scratch, or both models with another embedding start;
    training would refuse those run directories only when its stage comes, with a hint the demo
    cannot follow, so the demo names them all before it starts. Its own runs (as training writes
    them: precision "auto" resolved) pass, so a rerun resumes."""
    import yaml

    from retropipe.launch.demo import demo_overrides, main, older_runs, stages
    from retropipe.launch.train import as_run, run_dir_of
    from retropipe.training.run.run_dir import claim_run_dir

    config = str(Path("configs/tiny.yaml").resolve())
    plan = stages(config, "corpus/jargon_devil.jsonl.gz", [*demo_overrides(tmp_path), f"workdir={tmp_path}"], 2,
                  tmp_path)
    runs = {}
    for name, cmd in plan:
        if "launch/train.py" in cmd:
            cfg = as_run(load_config(config, [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]))
            claim_run_dir(cfg, run_dir_of(cfg), write=True)  # what launch/train.py writes
            runs[cfg.train.name] = run_dir_of(cfg)
    assert sorted(runs) == ["gpt2", "retro"]
    assert yaml.safe_load((runs["gpt2"] / "config.yaml").read_text())["train"]["precision"] in ("bf16", "fp32")
    assert older_runs(config, plan) is None  # this demo's own runs: resumed or skipped as usual

    def older(name, section, key, value):
        written = yaml.safe_load((runs[name] / "config.yaml").read_text())
        written[section][key] = value
        (runs[name] / "config.yaml").write_text(yaml.safe_dump(written))

    older("retro", "train", "init_from", "")  # RETRO from scratch
    message = older_runs(config, plan)
    assert f"Delete {runs['retro']} to train again" in message and "train.init_from" in message
    older("gpt2", "model", "embedding_init_std", 0.02)  # before the tiny configs' embedding start
    message = older_runs(config, plan)
    assert "model.embedding_init_std 0.02 → 0.1" in message
    assert f"Delete {runs['gpt2']} and {runs['retro']} to train again" in message  # both at once

    assert main(["--set", f"workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"Delete {runs['gpt2']} and {runs['retro']}" in err and "--set workdir" in err
    assert not (tmp_path / "corpora").exists()  # no stage ran


def test_eval_precision_auto_follows_the_device(monkeypatch, kernels_unheld):
    """eval.precision auto: bf16 on a CPU with bf16 matmuls, fp32 on one without; a precision
    asked for is kept; evaluate_models takes only a resolved one."""
    from retropipe.data import cpu
    from retropipe.launch.evaluate import scoring_precision_on
    from retropipe.training.evaluation.config import EvalConfig
    from retropipe.training.evaluation.report_rows import evaluate_models

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert scoring_precision_on("auto", "cpu") == "fp32" and scoring_precision_on("bf16", "cpu") == "bf16"
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    assert scoring_precision_on("auto", "cpu") == "bf16" and scoring_precision_on("fp32", "cpu") == "fp32"
    with pytest.raises(ValueError, match="eval.precision 'auto'"):
        evaluate_models([], [], None, EvalConfig())


# A stage (or a training rank) that stops as RetroPipe's do on a scheduler's signal: it takes a
# moment (a checkpoint), notes the signal and exits 75.
STOPPING_STAGE = """
import signal, sys, time
from pathlib import Path
def stop(*_):
    time.sleep(1)
    Path(sys.argv[1]).write_text("got SIGTERM")
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
Path(sys.argv[1] + ".ready").touch()
time.sleep(60)
"""


@pytest.mark.parametrize("launcher", [False, True])
def test_a_signal_to_the_demo_stops_its_running_stage_and_the_demo_says_how_to_resume(tmp_path, launcher):
    """`kill <demo>` (the demo alone, as Kubernetes signals a container's first process): the stage
    running then gets the signal too and is waited for; the demo exits 75, leaving nothing running.
    A launcher named deepspeed that dies at the signal, passing nothing on (DeepSpeed's runner on
    one node): its rank gets the signal all the same, and the demo waits for its checkpoint."""
    marker = tmp_path / "stage"
    stage = [sys.executable, "-c", STOPPING_STAGE, str(marker)]
    if launcher:
        (tmp_path / "deepspeed").write_text(f"#!/bin/sh\n{' '.join(map(shlex.quote, stage))} &\nwait\n")
        (tmp_path / "deepspeed").chmod(0o755)
        stage = [str(tmp_path / "deepspeed")]
    driver = ("import sys; from pathlib import Path; from retropipe.launch.demo import run_stages; "
              f"sys.exit(run_stages([('a stage', {stage!r})], Path({str(tmp_path)!r}), Path({str(tmp_path)!r})))")
    demo = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "stage.ready").exists() and time.time() < deadline:
        time.sleep(0.1)
    demo.send_signal(signal.SIGTERM)
    _, err = demo.communicate(timeout=60)
    assert demo.returncode == 75 and marker.read_text() == "got SIGTERM", err  # the stage's stop is done
    assert "demo: stopped by a signal in stage 'a stage'; rerun the same command to resume" in err


@pytest.mark.parametrize("sets, share", [
    ([], 0.0),                                                              # GPT-2: no neighbours to learn from
    (["model.kind=retro"], 0.0),                                            # dense neighbours
    (["model.kind=retro", "retrieval.method=bm25"], 0.1),                   # lexical: LEXICAL_DISTRACTORS
    (["model.kind=retro", "retrieval.method=hybrid"], 0.1),
    (["model.in_context=1", "retrieval.method=bm25"], 0.1),                 # GPT-2 reading them in context
    (["model.kind=retro", "retrieval.method=bm25", "train.self_neighbours=0.95"], 0.05),   # room left to 1
    (["model.kind=retro", "retrieval.method=bm25", "train.self_neighbours=0.34",
      "train.diverging_neighbours=0.56"], 0.1),                             # 0.34 + 0.56 + 0.1: 1 to rounding
    (["model.kind=retro", "retrieval.method=bm25", "train.distractor_neighbours=0"], 0.0),  # the user's own
])
def test_distractor_lessons_auto_follow_the_retrieval_method(sets, share, tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", sets)
    assert cfg.train.distractor_neighbours == share and cfg.train.lessons.distractor == share
    save_config(cfg, tmp_path)  # a run records the share it trained with, not "auto"
    assert f"distractor_neighbours: {share}" in (tmp_path / "config.yaml").read_text()


def test_distractor_lessons_refuse_another_word_naming_the_key():
    with pytest.raises(ConfigError, match="train.distractor_neighbours.*a share in \\[0, 1\\] or 'auto', got 'some'"):
        load_config(ROOT / "configs" / "tiny.yaml", ["train.distractor_neighbours=some"])
