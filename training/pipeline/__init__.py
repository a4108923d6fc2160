"""retropipe.training.pipeline: the model's layer list cut into DeepSpeed pipeline stages. Where to
cut (`partition`), what crosses a cut (`stage_boundary`), AdamW's groups per stage
(`param_groups`), the DeepSpeed JSON (`deepspeed_config`): plain torch and dicts. The one module
that imports deepspeed is `deepspeed_engine`. Imports models/ and run/ (its config).
"""
