"""Every training recipe the README and configs document, on 2 pipeline stages, in fp32 and bf16.

Recipes: the GPT-2 baseline, RETRO, RETRO from the baseline's weights (`train.init_from`; in bf16
also on one stage),
RETRO-fit with a frozen trunk (`configs/tiny-retrofit.yaml`), a finished run extended
(`train.steps` raised, on two stages and on one) and a branch (`train.branch_from`), these in bf16 (fp32's have their own
tests in tests/launch/test_training.py; the branch with DeepSpeed's own bf16 gradient accumulation).
Each trains 2 steps (the extension and the branch one more) with real DeepSpeed on 2 CPU
processes; each asserts its first loss
and that the stages' copies of the tied embedding agree. The first loss of a fresh or warm-started
run is computed again in-process from the same weights and micro-batches; the extension's and
the branch's must be equal, both continuing the same checkpoint.
"""

import json
import shutil

import pytest
import torch

from retropipe.data.cpu import cpu_has_bf16
from retropipe.launch.config import load_config
from tests.corpora import build_workdir
from tests.distributed import ROOT, train
from tests.launch.test_training import TINY, losses

pytestmark = pytest.mark.slow

PRECISIONS = {"fp32": 1e-4, "bf16": 0.05}   # first-loss tolerance: bf16 weights round the logits
# 4 layers, so that the frozen trunk's two CCA layers (2 and 4) give each stage one that trains;
# micro-batches of one sequence: a CPU without bf16 instructions emulates bf16's products, 5-170×
# slower than fp32's (docs/benchmarks.md), and the recipes' bf16 steps were most of their time there.
COMMON = [*TINY, "data.max_documents=100", "model.n_layer=4", "train.steps=2", "train.micro_batch_size=1"]


@pytest.fixture(scope="module")
def recipe_workdir(tmp_path_factory):
    """Prepared data and a retrieval database (real BERT embeddings, FAISS Flat), shared by the recipes."""
    wd = tmp_path_factory.mktemp("recipes")
    build_workdir(config(wd, "tiny-retro.yaml", "fp32"))
    return wd


def config(workdir, name: str, precision: str, *overrides: str):
    return load_config(ROOT / "configs" / name, [f"workdir={workdir}", *COMMON, f"train.precision={precision}",
                                                 *overrides])


def run(workdir, name: str, precision: str, run_name: str, *overrides: str, stages: int = 2) -> dict[int, float]:
    """Train on `stages` processes (as many stages); the run's losses. Asserts it completed with the
    tied copies equal."""
    sets = [a for o in [*COMMON, f"train.precision={precision}", f"workdir={workdir}", f"train.name={run_name}",
                        f"train.pipeline_stages={stages}", *overrides] for a in ("--set", o)]
    code, log = train(stages, ["--config", f"configs/{name}", *sets], workdir / f"logs-{run_name}")
    assert code == 0, log[-3000:]
    assert f"pipeline: {stages} stages × 1 data parallel" in log, log[-2000:]
    # bf16 on a CPU that emulates it trains, and says how slowly (CI's CPU may have bf16 or not)
    assert ("train: warning: train.precision is bf16" in log) == (precision == "bf16" and not cpu_has_bf16()), log
    summary = json.loads((workdir / "runs" / run_name / "summary.json").read_text())
    assert summary["tied_embedding_max_diff"] == 0.0  # checked at the start and the end of training
    return losses(workdir / "runs" / run_name)


def metrics(run_dir) -> list[tuple[int, float, float]]:
    """Each logged step's loss and gradient norm."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def first_loss(cfg, warm_from=None) -> float:
    """Step 1's loss, in-process: the mean over its micro-batches, each layer built under its own
    seed as the pipeline builds it, warm-started as train.init_from does, in the run's precision."""
    from retropipe.data.neighbour_store import NeighbourStore
    from retropipe.data.reading import Reading
    from retropipe.data.store import ChunkStore
    from retropipe.training.models.registry import build_model
    from retropipe.training.models.gpt2 import loss_fn
    from retropipe.training.models.io import load_model
    from retropipe.training.run.batches import SequenceBatches, micro_batches

    t = cfg.train
    model = build_model(cfg.model, layer_seed=t.seed)
    if warm_from is not None:
        missing, unexpected = model.load_state_dict(load_model(warm_from).state_dict(), strict=False)
        assert not unexpected and all("cca" in k or "encoder" in k for k in missing)
    if t.precision == "bf16":
        model = model.to(torch.bfloat16)
    store = ChunkStore(cfg.data_dir)
    retro = cfg.model.retrieves
    nbrs = NeighbourStore.of(cfg.retrieval_dir, store, t.seq_len // store.chunk_len,
                             reading=Reading.for_training(cfg.retrieval)) if retro else None
    data = SequenceBatches(store, "train", t.seq_len, nbrs, t.neighbours, t.lessons, t.seed)
    batches = micro_batches(data, 0, t.micro_batch_size, 0, 1, t.seed)
    total = 0.0
    with torch.no_grad():
        for _ in range(t.micro_batches):
            b = next(batches)
            tokens = torch.from_numpy(b["tokens"])
            logits = model(tokens, torch.from_numpy(b["neighbours"])) if retro else model(tokens)
            total += float(loss_fn(logits, torch.from_numpy(b["labels"])))
    return total / t.micro_batches


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_documented_recipe_trains_on_two_stages(recipe_workdir, precision):
    wd, tol = recipe_workdir, PRECISIONS[precision]
    gpt2 = f"gpt2-{precision}"
    baseline = wd / "runs" / gpt2 / "model"
    recipes = [  # (name, config, overrides, warm start)
        (gpt2, "tiny-gpt2.yaml", [], None),
        (f"retro-{precision}", "tiny-retro.yaml", [], None),
        (f"warm-{precision}", "tiny-retro.yaml", [f"train.init_from={baseline}"], baseline),
        (f"retrofit-{precision}", "tiny-retrofit.yaml", [f"train.init_from={baseline}"], baseline),
    ]
    if precision == "bf16":  # one stage: the whole model in one process, warm-started
        recipes.append((f"warm-one-stage-{precision}", "tiny-retro.yaml", [f"train.init_from={baseline}"], baseline))
    for name, cfg_file, overrides, warm in recipes:
        stages = 1 if "one-stage" in name else 2
        curve = run(wd, cfg_file, precision, name, *overrides, stages=stages)
        assert sorted(curve) == [1, 2], (name, curve)
        expected = first_loss(config(wd, cfg_file, precision, f"train.name={name}", *overrides), warm)
        assert abs(curve[1] - expected) < tol, (name, curve[1], expected)

    # The baseline extended by a step, and a branch of its step-2 checkpoint: the same next step.
    # In bf16 here; fp32's extension and branch have their own tests (tests/launch/test_training.py).
    if precision == "fp32":
        return
    # The branch adds its bf16 gradients to the fp32 ones by DeepSpeed's hook per parameter, where
    # training adds them in one call after each backward (training/pipeline/bf16_grads.py): the same
    # sums, so step 3's gradient norm too is the extension's, bit for bit.
    shutil.copytree(wd / "runs" / gpt2, wd / "runs" / f"{gpt2}-one-stage")
    extended = run(wd, "tiny-gpt2.yaml", precision, gpt2, "train.steps=3")
    # The same extension on one stage: its 2-stage checkpoint resumes from the elastic state.
    one_stage = run(wd, "tiny-gpt2.yaml", precision, f"{gpt2}-one-stage", "train.steps=3", stages=1)
    assert sorted(one_stage) == [1, 2, 3] and abs(one_stage[3] - extended[3]) < 1e-3, (one_stage, extended)
    branch = run(wd, "tiny-gpt2.yaml", precision, f"branch-{precision}", "train.steps=3",
                 f"train.branch_from={wd / 'runs' / gpt2 / 'checkpoints' / 'step000002'}",
                 "train.deepspeed={bf16: {immediate_grad_update: true}}")
    assert sorted(extended) == [1, 2, 3] and sorted(branch) == [3], (extended, branch)
    assert branch[3] == extended[3], (branch, extended)
    assert metrics(wd / "runs" / f"branch-{precision}") == metrics(wd / "runs" / gpt2)[2:]
