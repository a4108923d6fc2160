"""retropipe.training: GPT-2 and RETRO in plain PyTorch, trained with DeepSpeed pipeline parallelism,
and scored in bits per byte. Four rooms, each importing only the ones listed before it (and
retropipe.data; never retropipe.retrieval):

    models/      the networks: config, GPT-2, RETRO (a GPT-2 subclass), their layer list, I/O
    run/         a training run: its config, directory, start, data order, loop, logs, hardware
    pipeline/    the layer list cut into DeepSpeed stages; the one adapter that imports deepspeed
    evaluation/  a trained model used: bits per byte, leakage α, the report's rows, sampling
"""
