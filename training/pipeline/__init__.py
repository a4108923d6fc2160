"""retropipe.training.pipeline: the model's layer list cut into DeepSpeed pipeline stages. Where to
cut (`partition`), what crosses a cut (`stage_boundary`), AdamW's groups per stage
(`param_groups`), the DeepSpeed JSON (`deepspeed_config`), a run's layer list, cut and JSON
computed once (`stage_plan`): plain torch and dicts. The modules that import deepspeed are
`deepspeed_engine` and `deepspeed_private` (every private DeepSpeed name we reach). Imports
models/ and run/ (its config).
"""
