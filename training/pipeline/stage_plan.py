"""A run's pipeline plan, computed once: the layer list, where it is cut, and DeepSpeed's JSON.

    plan = stage_plan(model_cfg, train_cfg)          # or launch/train.py's preflight, which checks each part
    Pipeline(model_cfg, train_cfg, plan=plan)        # training/pipeline/deepspeed_engine.py builds from it

launch/train.py's preflight builds the plan before any process group exists (its checks name the
config key at fault), writes `plan.deepspeed` into the run directory as deepspeed_config.json and
hands the plan to the Pipeline: the cut it checked and the config it recorded are the ones
DeepSpeed gets. A Pipeline built without one (tests, bench/) computes it here. Plain Python: no
DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from retropipe.training.models.config import ModelConfig
from retropipe.training.models.layers import LayerDesc
from retropipe.training.models.registry import layer_list
from retropipe.training.pipeline.deepspeed_config import deepspeed_config
from retropipe.training.pipeline.partition import partition
from retropipe.training.run.config import TrainConfig


@dataclass(frozen=True)
class StagePlan:
    descs: list[LayerDesc]  # the model's layer list (with train.fused_head's output head)
    parts: list[int]        # stage s runs layers parts[s]:parts[s + 1]
    deepspeed: dict         # deepspeed_config(train): what deepspeed.initialize is given (a copy of)


def stage_plan(model: ModelConfig, train: TrainConfig) -> StagePlan:
    """The plan of `model` trained as `train` says (a ValueError or ConfigError where impossible)."""
    descs = layer_list(model, fused_head=train.fused_head)
    parts = partition(descs, train.pipeline_stages, train.partition, frozen_trunk=model.freeze_trunk)
    return StagePlan(descs, parts, deepspeed_config(train))
