"""The DeepSpeed JSON generated from the train section, with train.deepspeed merged over it
(training/pipeline/deepspeed_config.py: plain dicts, no DeepSpeed); and the check that the installed
DeepSpeed has every private name training/pipeline/deepspeed_private.py reaches."""

import pytest

from retropipe.data.errors import ConfigError
from retropipe.training.pipeline.deepspeed_config import deepspeed_config, generated_config
from retropipe.training.run.config import TrainConfig


def test_the_passthrough_is_deep_merged_over_the_generated_config():
    train = TrainConfig(precision="bf16", deepspeed={"zero_optimization": {"reduce_bucket_size": 1000},
                                                     "optimizer": {"params": {"eps": 1e-6}},
                                                     "steps_per_print": 5, "comms_logger": {"enabled": True}})
    merged = deepspeed_config(train)
    assert merged["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert merged["optimizer"]["params"]["eps"] == 1e-6 and merged["optimizer"]["params"]["lr"] == train.lr
    assert merged["steps_per_print"] == 5 and merged["comms_logger"] == {"enabled": True}
    assert merged["data_types"] == {"grad_accum_dtype": "fp32"}
    assert merged["bf16"]["enabled"] is True
    assert deepspeed_config(TrainConfig()) == generated_config(TrainConfig())
    # Stating a generated value again is no contradiction.
    same = TrainConfig(micro_batches=4, grad_clip=0.0,
                       deepspeed={"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 0}})
    assert deepspeed_config(same)["zero_optimization"]["stage"] == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_the_pipeline_engine_refuses_are_named(stage):
    with pytest.raises(ConfigError, match=r"train\.deepspeed\.zero_optimization\.stage.*stage 0 or 1 only"):
        deepspeed_config(TrainConfig(deepspeed={"zero_optimization": {"stage": stage}}))


@pytest.mark.parametrize("over,key,instead", [
    ({"train_batch_size": 64}, "train_batch_size", "train.micro_batch_size and train.micro_batches"),
    ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu", "train.micro_batch_size"),
    ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps", "train.micro_batches"),
    ({"gradient_clipping": 0.5}, "gradient_clipping", "train.grad_clip"),
    ({"bf16": {"enabled": True}}, "bf16.enabled", "train.precision"),
    ({"optimizer": {"params": {"lr": 0.1}}}, "optimizer.params.lr", "train.lr"),
    ({"optimizer": {"params": {"betas": [0.9, 0.99]}}}, "optimizer.params.betas", "train.beta1 and train.beta2"),
    ({"scheduler": {"params": {"total_num_steps": 5}}}, "scheduler.params.total_num_steps", "train.steps"),
])
def test_keys_that_train_sets_are_refused_naming_the_train_key(over, key, instead):
    with pytest.raises(ConfigError, match=rf"train\.deepspeed\.{key}': is set by {instead}"):
        deepspeed_config(TrainConfig(precision="fp32", deepspeed=over))


def test_another_optimizer_or_scheduler_takes_its_own_params():
    train = TrainConfig(deepspeed={"optimizer": {"type": "Lamb", "params": {"max_coeff": 0.3}},
                                   "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    merged = deepspeed_config(train)
    assert merged["optimizer"] == {"type": "Lamb", "params": {"lr": train.lr, "weight_decay": train.weight_decay,
                                                             "max_coeff": 0.3}}
    assert merged["scheduler"] == {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}


def test_bad_passthrough_shapes_are_refused():
    with pytest.raises(ConfigError, match=r"train\.deepspeed\.zero_optimization'.*replace a whole section"):
        deepspeed_config(TrainConfig(deepspeed={"zero_optimization": 1}))
    with pytest.raises(ConfigError, match=r"train\.deepspeed'.*must be a mapping"):
        TrainConfig(deepspeed="zero_optimization.stage=1")
    with pytest.raises(ConfigError, match=r"stage.*0 with train\.precision=bf16"):
        deepspeed_config(TrainConfig(precision="bf16", grad_clip=0.0, deepspeed={"zero_optimization": {"stage": 0}}))
    # DeepSpeed's clipping without ZeRO sees only the first pipeline stage's gradients.
    with pytest.raises(ConfigError, match=r"stage.*0 with train\.grad_clip > 0 on more than one pipeline stage"):
        deepspeed_config(TrainConfig(precision="fp32", deepspeed={"zero_optimization": {"stage": 0}}))
    one_stage = TrainConfig(precision="fp32", pipeline_stages=1, deepspeed={"zero_optimization": {"stage": 0}})
    assert deepspeed_config(one_stage)["zero_optimization"]["stage"] == 0


def test_the_fused_adamw_step_goes_only_to_torchs_adamw():
    assert deepspeed_config(TrainConfig())["optimizer"]["params"]["fused"] is True
    # DeepSpeed's own Adam classes (torch_adam off) take no `fused`: it is dropped, not passed on.
    own = deepspeed_config(TrainConfig(deepspeed={"optimizer": {"params": {"torch_adam": False}}}))
    assert "fused" not in own["optimizer"]["params"]
    off = deepspeed_config(TrainConfig(deepspeed={"optimizer": {"params": {"fused": False}}}))
    assert off["optimizer"]["params"]["fused"] is False and off["optimizer"]["params"]["torch_adam"] is True


# -- the private DeepSpeed names training/pipeline/deepspeed_private.py reaches --

def test_the_installed_deepspeed_has_every_private_name_we_reach():
    from retropipe.training.pipeline.deepspeed_private import check_private_names

    check_private_names()  # raises a TrainingError naming what is missing


@pytest.mark.parametrize("owner, kind", [
    ("deepspeed.runtime.pipe.module.PipelineModule", "attr"),       # a method
    ("deepspeed.runtime.pipe.module.PipelineModule", "sets"),       # an instance attribute
    ("deepspeed.runtime.pipe.engine.PipelineEngine", "reads"),      # read off another object
    ("deepspeed.ops.__compatible_ops__", "key"),                    # a key of a mapping
    ("deepspeed.runtime.no_such_module.NoSuchClass", "attr"),       # a module gone
])
def test_a_private_name_deepspeed_lacks_is_named_with_the_adapter_and_the_tested_range(owner, kind):
    import deepspeed

    from retropipe.training.run import TrainingError
    from retropipe.training.pipeline.deepspeed_private import PrivateName, check_private_names, tested_range

    made_up = PrivateName(owner, "_retropipe_made_up_name", kind, "a test")
    real = PrivateName("deepspeed.runtime.pipe.module.PipelineModule", "_set_bounds", "attr", "a test")
    with pytest.raises(TrainingError) as e:
        check_private_names((real, made_up))
    message = str(e.value)
    assert message.startswith(f"DeepSpeed {deepspeed.__version__} lacks {owner}")
    assert "_retropipe_made_up_name" in message and "_set_bounds" not in message
    assert "training/pipeline/deepspeed_private.py" in message
    assert f"RetroPipe is tested with {tested_range()} (pyproject.toml)" in message
    assert tested_range().startswith("deepspeed>=")
