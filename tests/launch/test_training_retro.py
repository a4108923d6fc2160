"""RETRO through launch/train.py: two pipeline stages against one, and a RETRO-fit, with
neighbours from a real retrieval database (the bundled BERT, FAISS)."""

import json

import pytest
import torch

from retropipe.launch.config import load_config
from tests.corpora import build_workdir
from tests.distributed import ROOT, changed_layer_tensors, train
from tests.launch.test_training import TINY, losses, sets


@pytest.fixture(scope="module")
def retro_workdir(tmp_path_factory):
    """A smaller corpus with its retrieval database (real BERT embeddings, FAISS Flat)."""
    wd = tmp_path_factory.mktemp("retro")
    build_workdir(load_config(ROOT / "configs" / "tiny-retro.yaml", [f"workdir={wd}", *TINY, "data.max_documents=100"]))
    return wd


@pytest.mark.slow
def test_retro_trains_on_two_stages_and_equals_one_stage(retro_workdir):
    # "uniform" cuts before the first RETRO block, so the (hidden, ids, embedded neighbours) tuple
    # crosses the stage boundary.
    common = ["--config", "configs/tiny-retro.yaml"]
    code, log = train(2, [*common, *sets(f"workdir={retro_workdir}", "train.name=two", "train.partition=uniform")],
                      retro_workdir / "logs-two")
    assert code == 0, log[-3000:]
    assert "stage 0: wte, wpe, blocks.0\n" in log and "stage 1: blocks.1, ln_f, wte" in log, log[-2000:]
    two = losses(retro_workdir / "runs" / "two")
    assert sorted(two) == list(range(1, 9)) and two[8] < two[1] - 0.3, two
    summary = json.loads((retro_workdir / "runs" / "two" / "summary.json").read_text())
    assert summary["tied_embedding_max_diff"] == 0.0

    code, log = train(1, [*common, *sets(f"workdir={retro_workdir}", "train.name=one", "train.pipeline_stages=1")],
                      retro_workdir / "logs-one")
    assert code == 0, log[-3000:]
    one = losses(retro_workdir / "runs" / "one")
    for step in one:
        assert abs(one[step] - two[step]) < 1e-4, (step, one[step], two[step])

    from retropipe.training.models.io import load_model
    from retropipe.training.models.retro import Retro
    model = load_model(retro_workdir / "runs" / "two" / "model")
    assert isinstance(model, Retro)
    nbrs = torch.full((1, 4, 2, 32), 7, dtype=torch.int64)
    assert model(torch.zeros(1, 64, dtype=torch.int64), nbrs).shape == (1, 64, 50257)


@pytest.mark.slow
def test_retrofit_trains_only_cca_and_encoder_on_two_stages(retro_workdir):
    """RETRO-fit from a GPT-2 checkpoint: the trunk is frozen, each stage owns a CCA layer, and the
    last stage's output head starts as the checkpoint's embedding (2 stages == 1 stage from step 1)."""
    from retropipe.training.models.config import ModelConfig
    from retropipe.training.models.gpt2 import GPT2
    from retropipe.training.models.io import load_model, save_model
    from retropipe.training.models.retro import is_retrieval_parameter

    shape = dict(n_layer=4, n_head=2, n_embd=32, n_positions=64, chunk_len=16)
    torch.manual_seed(0)
    gpt2 = GPT2(ModelConfig(kind="gpt2", **shape))
    save_model(gpt2, retro_workdir / "gpt2")
    fit = ["--config", "configs/tiny-retro.yaml", *sets(f"workdir={retro_workdir}", "model.n_layer=4",
                                                           f"train.init_from={retro_workdir / 'gpt2'}",
                                                           "model.freeze_trunk=true")]
    code, log = train(2, [*fit, "--set", "train.name=fit"], retro_workdir / "logs-fit")
    assert code == 0, log[-3000:]
    fitted = load_model(retro_workdir / "runs" / "fit" / "model").state_dict()
    trunk = gpt2.state_dict()
    for name, value in trunk.items():
        assert torch.equal(fitted[name], value), name  # bit for bit: the trunk never moved
    two = losses(retro_workdir / "runs" / "fit")
    # What the optimizer moves from step 6 to 8: every CCA and encoder tensor, no trunk weight (a
    # random trunk predicts ~uniformly, so 8 losses on 8 batches would say nothing either way).
    moved, names = changed_layer_tensors(retro_workdir / "runs" / "fit" / "checkpoints", "step000006", "step000008")
    assert moved and moved == {name for name in names if is_retrieval_parameter(name)}, sorted(moved)
    summary = json.loads((retro_workdir / "runs" / "fit" / "summary.json").read_text())
    assert summary["tied_embedding_max_diff"] == 0.0

    code, log = train(1, [*fit, "--set", "train.name=fit1", "--set", "train.pipeline_stages=1"],
                      retro_workdir / "logs-fit1")
    assert code == 0, log[-3000:]
    one = losses(retro_workdir / "runs" / "fit1")
    # A random head on the last stage would start near ln(50257) = 10.8 instead.
    for step in one:
        assert abs(one[step] - two[step]) < 1e-4, (step, one[step], two[step])


@pytest.mark.slow
def test_a_gpt2_trains_and_is_scored_with_its_neighbours_in_context(retro_workdir):
    """The in-context-trained rival (model.in_context): a GPT-2 on two stages whose sequences are
    [a neighbour][the last two chunks], and its report row reads the neighbours the same way."""
    from retropipe.launch.evaluate import main as evaluate
    from retropipe.training.models.io import load_model

    args = ["--config", "configs/tiny.yaml", *sets(f"workdir={retro_workdir}", "train.name=in-context",
                                                      "model.in_context=1", "train.self_neighbours=0.5")]
    code, log = train(2, args, retro_workdir / "logs-in-context")
    assert code == 0, log[-3000:]
    curve = losses(retro_workdir / "runs" / "in-context")
    assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1] - 0.3, curve
    assert load_model(retro_workdir / "runs" / "in-context" / "model").cfg.in_context == 1
    out = retro_workdir / "in-context-report"
    assert evaluate([*args, "--checkpoint", str(retro_workdir / "runs" / "in-context"), "--out", str(out),
                     "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [r["model"] for r in report["rows"]] == ["in-context in-context trained k=1"]
    assert report["rows"][0]["tokens"] > 0 and report["alpha"] is not None


def test_training_refuses_neighbours_of_another_method(retro_workdir):
    """A run's config names the neighbours it trains on: dense ones under retrieval.method bm25 are refused."""
    from retropipe.data.errors import ConfigError
    from retropipe.launch.train import preflight

    cfg = load_config(ROOT / "configs" / "tiny-retro.yaml", [f"workdir={retro_workdir}", *TINY])
    assert preflight(cfg, 2)[1].manifest.get("method", "dense") == "dense"
    with pytest.raises(ConfigError, match=r"retrieval\.method.*'bm25', but the neighbours .* 'dense'"):
        preflight(load_config(ROOT / "configs" / "tiny-retro.yaml", [f"workdir={retro_workdir}", *TINY,
                                                                     "retrieval.method=bm25"]), 2)
