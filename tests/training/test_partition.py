"""Pipeline stage boundaries (training/pipeline/partition.py): in-process, no DeepSpeed."""

import itertools
import random

import pytest
import torch.nn as nn

from retropipe.training.models.registry import layer_list
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.layers import LayerDesc
from retropipe.training.pipeline.partition import min_max_partition, partition, partition_uniform, stage_trains

SHAPE = dict(n_head=2, n_embd=32, n_positions=64, encoder_layers=1, encoder_embd=16, encoder_head=2, chunk_len=16)


class RetroBlock(nn.Module):  # a stand-in: the partition rules know RETRO layers by LayerDesc.retrieval
    pass


def descs_of(costs, tied=(), retro=()):
    return [LayerDesc(f"l{i}", RetroBlock if i in retro else nn.Identity, tie_key="embed" if i in tied else None,
                      cost=c, retrieval=i in retro) for i, c in enumerate(costs)]


def brute_force(weights, stages, valid):
    """The lowest max-stage cost over every cut (None if no valid cut)."""
    n, best = len(weights), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        parts = [0, *cuts, n]
        if all(valid(a, b) for a, b in zip(parts, parts[1:])):
            cost = max(sum(weights[a:b]) for a, b in zip(parts, parts[1:]))
            best = cost if best is None else min(best, cost)
    return best


def test_min_max_partition_is_optimal_on_small_cases():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        weights = [rng.choice([0.0, 1.0, 2.0, 5.0, rng.random() * 10]) for _ in range(n)]
        tied = {i for i in range(n) if rng.random() < 0.3}
        valid = stage_trains(descs_of(weights, tied), frozen_trunk=False)
        parts = min_max_partition(weights, stages, valid)
        expected = brute_force(weights, stages, valid)
        if expected is None:
            assert parts is None, (weights, tied, stages, parts)
            continue
        assert parts[0] == 0 and parts[-1] == n and len(parts) == stages + 1
        assert all(a < b for a, b in zip(parts, parts[1:]))  # no empty stage
        assert all(valid(a, b) for a, b in zip(parts, parts[1:]))
        assert max(sum(weights[a:b]) for a, b in zip(parts, parts[1:])) == pytest.approx(expected)


@pytest.mark.parametrize("kind,n_layer,stages", [("gpt2", 2, 2), ("gpt2", 4, 3), ("gpt2", 4, 5), ("retro", 4, 2),
                                                 ("retro", 6, 4)])
@pytest.mark.parametrize("method", ["cost", "parameters"])
def test_every_stage_owns_a_layer_that_trains(kind, n_layer, stages, method):
    descs = layer_list(ModelConfig(kind=kind, n_layer=n_layer, **SHAPE))
    parts = partition(descs, stages, method)
    assert parts[0] == 0 and parts[-1] == len(descs) and len(parts) == stages + 1
    for a, b in zip(parts, parts[1:]):
        assert a < b and any(d.tie_key is None for d in descs[a:b]), (parts, [d.name for d in descs])


def test_the_head_is_cut_off_by_cost_but_keeps_a_layer_of_its_own():
    # The LM head (a vocabulary matmul) outweighs a tiny trunk: the cost cut gives it a stage, and
    # since the tied head has no parameter of its own that stage also takes ln_f.
    descs = layer_list(ModelConfig(kind="gpt2", n_layer=2, **SHAPE))
    assert [d.name for d in descs] == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f", "wte"]
    assert partition(descs, 2, "cost") == [0, 4, 6]


def test_a_frozen_trunk_needs_a_retro_block_on_every_stage():
    cfg = ModelConfig(kind="retro", n_layer=4, **SHAPE)  # CCA at layers 2 and 4
    descs = layer_list(cfg)
    parts = partition(descs, 2, "cost", frozen_trunk=True)
    for a, b in zip(parts, parts[1:]):
        assert any(d.retrieval and d.cls.__name__ == "RetroBlock" for d in descs[a:b]), parts
    with pytest.raises(ValueError, match="every stage a RETRO"):
        partition(descs, 3, "cost", frozen_trunk=True)  # two CCA layers cannot serve three stages
    # Without a frozen trunk three stages are fine.
    assert len(partition(descs, 3, "cost")) == 4


def test_frozen_trunk_rule_on_synthetic_layers():
    descs = descs_of([1, 1, 1, 1, 1, 1], tied={0, 5}, retro={2, 4})
    assert partition(descs, 2, "cost", frozen_trunk=True) == [0, 3, 6]
    with pytest.raises(ValueError, match="train.pipeline_stages=3"):
        partition(descs, 3, "cost", frozen_trunk=True)


def test_uniform_cut_and_its_error():
    assert partition_uniform(6, 2) == [0, 3, 6]
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    descs = layer_list(ModelConfig(kind="gpt2", n_layer=4, **SHAPE))  # wte wpe b0 b1 b2 b3 ln_f wte
    assert partition(descs, 2, "uniform") == [0, 4, 8]
    # Six stages of eight layers: the last stage is the tied head alone, which cannot train.
    with pytest.raises(ValueError, match=r"train.partition=uniform: the uniform cut \[0, 2, 4, 5, 6, 7, 8\]"):
        partition(descs, 6, "uniform")
    assert partition(descs, 6, "cost") == [0, 2, 3, 4, 5, 6, 8]  # ln_f joins the head instead


def test_uniform_cut_equals_deepspeeds():
    from deepspeed.runtime.utils import partition_uniform as deepspeeds

    for items in range(1, 30):
        for parts in range(1, 12):
            assert partition_uniform(items, parts) == list(deepspeeds(items, parts)), (items, parts)


def test_too_many_stages_are_refused():
    descs = layer_list(ModelConfig(kind="gpt2", n_layer=2, **SHAPE))
    with pytest.raises(ValueError, match="train.pipeline_stages=7 exceeds the model's 6 pipeline layers"):
        partition(descs, 7, "cost")
    with pytest.raises(ValueError, match="no 'cost' partition"):
        partition(descs, 6, "cost")  # six stages of one layer each: wte alone cannot train


def test_the_stage_plan_is_the_layer_list_the_cut_and_the_deepspeed_config_computed_once():
    """training/pipeline/stage_plan.py: what launch/train.py's preflight checks and records is what
    the Pipeline builds (the fused head included) and what DeepSpeed is given."""
    from retropipe.training.models.gpt2 import head_inputs
    from retropipe.training.pipeline.deepspeed_config import deepspeed_config
    from retropipe.training.pipeline.stage_plan import stage_plan
    from retropipe.training.run.config import TrainConfig

    model, train = ModelConfig(kind="retro", n_layer=4, **SHAPE), TrainConfig(pipeline_stages=2, partition="cost")
    plan = stage_plan(model, train)
    descs = layer_list(model, fused_head=True)
    assert [d.name for d in plan.descs] == [d.name for d in descs] and plan.descs[-1].forward_fn is head_inputs
    assert plan.parts == partition(descs, 2, "cost")
    assert plan.deepspeed == deepspeed_config(train)
