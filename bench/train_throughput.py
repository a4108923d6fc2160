"""Benchmark training throughput: a single-process PyTorch loop vs the DeepSpeed pipeline.

    python bench/train_throughput.py [--models gpt2,retro] [--steps 5] [--precision fp32|bf16]
                                     [--micro-batches 8] [--stages 2] [--preset tiny] [--repeat 1]
                                     [--n-layer 12 --n-embd 384 --n-head 6]
                                     [--threads split,shared] [--fused-head true,false] [--layouts 4x4,2x8]
    # one GPU: the engine's step against the plain loop's at the same micro-batches (NCCL, 1 stage)
    python bench/train_throughput.py --device cuda --stages 1 --preset gpt2-124m --precision bf16 \
                                     --seq-len 1024 --layouts 8x16,2x16 --threads shared
    # the same with each block through torch.compile, as train.compile trains (both sides compiled)
    python bench/train_throughput.py --device cuda --stages 1 --preset gpt2-124m --precision bf16 \
                                     --seq-len 1024 --layouts 8x4 --threads shared --compile
    # where each side's step goes (add --profile): host operators, and on a GPU its busy time and kernels
    # the host's work per micro-batch, the compute made negligible (GPT-2 small's 12 blocks at width 64):
    python bench/train_throughput.py --stages 1 --n-layer 12 --n-embd 64 --n-head 2 --vocab-size 512 \
                                     --seq-len 64 --chunk-len 16 --layouts 1x16 --precision bf16 --threads split

Same model, same seeds, same global batch (micro_batch_size × micro_batches sequences of seq_len
tokens, random tokens; RETRO gets 2 random neighbours of 2 · chunk_len tokens per chunk):

- single: `build_model(cfg, layer_seed=seed)` + AdamW with gradient accumulation, one process using
  every core; bf16 as DeepSpeed's bf16 mode trains: a bf16 model whose gradients are added to fp32
  ones in one call after each micro-batch, and AdamW over an fp32 master copy, copied back after its step;
- pipeline: `build_pipeline` + `deepspeed.initialize`, `--stages` stages on as many processes
  over gloo (NCCL with `--device cuda`, one GPU per stage), exactly what launch/train.py runs,
  minus data loading. `--threads` lists the
  thread policies to compare: "split" gives each process cores / processes threads (one core
  each here); "shared" gives every process all cores with OMP_WAIT_POLICY=PASSIVE, so the core
  of a stage that waits for its neighbour works for the busy one (launch/train.py's default).
  `--fused-head` lists the LM-head paths to compare (training/models/lm_head.py; single and pipeline alike).
  `--compile` puts each block through torch.compile in both (`compile_blocks`, train.compile); the
  warm-up steps compile, so give it `--warmup 2` or more.
  `--feed host` hands the pipeline its micro-batches on the host, to be moved by DeepSpeed's
  blocking copies, as training did before its queued copies (`onto_device`; the same on a CPU);
  `--feed device,host` runs both, side by side.
  `--grads one-call,hooks` (bf16) compares how the pipeline adds each micro-batch's bf16 gradients
  to its fp32 ones: in one call after its backward, as training does (training/pipeline/bf16_grads.py),
  or from DeepSpeed's Python hook per parameter (`immediate_grad_update`); each pipeline's loss after
  its last step is printed beside its speed.
  `--profile` runs one more step of each under the torch profiler and prints where it went: the
  host's operators by self time and, on a GPU, how long the GPU was busy and its top kernels.

Prints tokens/s of both, the largest peak RSS of a pipeline rank, their ratio (goal on a 2-core CPU: pipeline ≥ 0.85× single; the bubble
bound is M / (M + P - 1) for M micro-batches and P stages) and MFU against the machine's matmul
FLOP/s measured in this run. Variants alternate (`--repeat`) so machine noise hits both.

At tiny width the 50,257-way output layer is ~3/4 of the FLOPs, so no 2-stage cut balances
and the pipeline is bound near 0.7×; `--n-layer 12 --n-embd 384 --n-head 6` is a shape whose
blocks and head weigh about the same, as in GPT-2 124M.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "--compile" not in sys.argv:  # skip importing dynamo's machinery (seconds per process) where nothing compiles
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def configs(args, kind: str):
    from retropipe.training.models.config import MODEL_PRESETS, ModelConfig
    from retropipe.training.run.config import TrainConfig

    shape = {**MODEL_PRESETS[args.preset], "n_positions": max(args.seq_len, 64)}
    for key in ("n_layer", "n_embd", "n_head"):
        if getattr(args, key):
            shape[key] = getattr(args, key)
    model = ModelConfig(kind=kind, chunk_len=args.chunk_len, vocab_size=args.vocab_size, **shape)
    train = TrainConfig(fused_head=args.fused_head, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                        micro_batches=args.micro_batches,
                        pipeline_stages=args.stages, steps=args.steps + args.warmup, precision=args.precision,
                        warmup_steps=1, eval_every=0)
    return model, train


def random_micro_batch(model, train, rng):
    import torch

    b, n, m = train.micro_batch_size, train.seq_len, model.chunk_len
    tokens = torch.randint(0, model.vocab_size, (b, n), generator=rng)
    labels = torch.randint(0, model.vocab_size, (b, n), generator=rng)
    if model.kind == "retro":
        return (tokens, torch.randint(0, model.vocab_size, (b, n // m, 2, 2 * m), generator=rng)), labels
    return tokens, labels


def run_single(args, kind: str) -> float:
    """Tokens/s of the plain loop (best step after warm-up), all cores in one process."""
    import torch

    from retropipe.training.models.registry import build_model
    from retropipe.training.models.gpt2 import FusedLoss, loss_fn
    from retropipe.training.run.trainer import onto_device

    torch.set_num_threads(os.cpu_count() or 1)
    model_cfg, train = configs(args, kind)
    device = torch.device(args.device)
    bf16 = args.precision == "bf16"
    model = build_model(model_cfg, layer_seed=train.seed, fused_head=train.fused_head).train()
    model.to(device, torch.bfloat16 if bf16 else torch.float32)
    for block in model.blocks if args.compile else []:
        block.compile()  # as compile_blocks does a stage's
    loss_of = FusedLoss() if train.fused_head else lambda logits, labels: loss_fn(logits.float(), labels)
    params = list(model.parameters())
    # bf16 as DeepSpeed's BF16_Optimizer trains: fp32 master weights and gradients, each micro-batch's
    # bf16 gradients added to the fp32 ones in one call and let go (training/pipeline/bf16_grads.py).
    master = [p.detach().float().requires_grad_() for p in params] if bf16 else params
    for m in master if bf16 else []:
        m.grad = torch.zeros_like(m)
    opt = torch.optim.AdamW(master, lr=1e-4, fused=True)  # as training/pipeline/deepspeed_config.py
    rng = torch.Generator().manual_seed(0)
    batches = [onto_device(random_micro_batch(model_cfg, train, rng), device) for _ in range(train.micro_batches)]

    def step():
        for inputs, labels in batches:
            outputs = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            (loss_of(outputs, labels) / train.micro_batches).backward()
            if bf16:
                pairs = [(m, p) for m, p in zip(master, params) if p.grad is not None]  # frozen: none
                torch._foreach_add_([m.grad for m, _ in pairs], [p.grad for _, p in pairs])
                for _, p in pairs:
                    p.grad = None
        torch.nn.utils.clip_grad_norm_(master, train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=not bf16)  # bf16: the fp32 gradients stay, zeroed, to be added into
        if bf16:
            with torch.no_grad():
                torch._foreach_copy_(params, master)

    times = []
    for _ in range(args.warmup + args.steps):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    if args.profile:
        print(profiled(step, device, f"single loop, {kind}"), flush=True)
    tokens = train.micro_batch_size * train.micro_batches * train.seq_len
    del model, opt, batches, loss_of, master, params   # the fused head keeps its slice buffers
    if device.type == "cuda":   # the pipeline's rank 0 trains on this GPU next
        torch.cuda.empty_cache()
    return tokens / min(times[args.warmup:])


def profiled(step, device, what: str, top: int = 15) -> str:
    """One more step under the torch profiler: its wall time, the host's operators by self time and,
    on a GPU, the time its kernels kept the GPU busy (what a step waiting on its host leaves idle)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        synchronize(device)
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    ops = sorted((e for e in averages if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)
    # Kernels only: a user annotation (the optimizer's step, a compiled region) spans kernels counted
    # themselves, and NCCL's wait for the next stage is no work.
    kernels = sorted((e for e in averages if e.device_type == DeviceType.CUDA
                      and not getattr(e, "is_user_annotation", False) and "nccl" not in e.key.lower()),
                     key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    lines = [f"profile ({what}): step {wall * 1e3:.1f} ms profiled, {sum(e.count for e in ops):,} host events"
             + (f", GPU busy {busy * 1e3:.1f} ms ({busy / wall:.0%}) over {sum(e.count for e in kernels):,} kernels"
                f" (NCCL's left out)"
                if kernels else "")]
    lines += [f"  {e.key[:56]:<56} {e.self_cpu_time_total / 1e3:>9.2f} ms self CPU {e.count:>7}" for e in ops[:top]]
    lines += [f"  {e.key[:56]:<56} {e.self_device_time_total / 1e3:>9.2f} ms GPU {e.count:>7}" for e in kernels[:top]]
    return "\n".join(lines)


def synchronize(device) -> None:
    """A GPU runs ahead of the host: a step's time is taken once its kernels are done."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def worker(args) -> None:
    """One pipeline rank (spawned by run_pipeline); rank 0 prints the result as JSON."""
    import deepspeed
    import torch

    from retropipe.training.pipeline.bf16_grads import add_grads_in_one_call
    from retropipe.training.pipeline.deepspeed_engine import build_pipeline, compile_blocks
    from retropipe.training.pipeline.stage_plan import stage_plan
    from retropipe.training.run.hardware import peak_memory_mb
    from retropipe.training.run.trainer import onto_device

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    model_cfg, train = configs(args, args.worker)
    plan = stage_plan(model_cfg, train)  # the layer list, the cut and the DeepSpeed JSON, as launch/train.py's
    module, descs, parts = build_pipeline(model_cfg, train, plan)
    config = plan.deepspeed
    if args.grads == "hooks":  # DeepSpeed's own: a Python hook per parameter adds each bf16 gradient
        config["bf16"]["immediate_grad_update"] = True
    engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()],
                                      config=config)
    if args.grads == "one-call":
        add_grads_in_one_call(engine)
    if args.compile:
        compile_blocks(module, descs)
    rng = torch.Generator().manual_seed(0)
    batches = [random_micro_batch(model_cfg, train, rng) for _ in range(train.micro_batches)]

    device = torch.device(engine.device)

    def forever():  # device: as launch/train.py feeds the engine; host: DeepSpeed's own blocking copies
        while True:
            yield from (onto_device(mb, device) if args.feed == "device" else mb for mb in batches)

    it = forever()
    times = []
    for _ in range(args.warmup + args.steps):
        synchronize(args.device)
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=it)
        synchronize(args.device)
        times.append(time.perf_counter() - t0)
    print(f"PEAK_RSS_MB {peak_memory_mb()[0]:.0f}", flush=True)  # every rank: a training process's peak memory
    if args.profile:  # every stage steps (the schedule is collective); rank 0, the first stage, reports
        text = profiled(lambda: engine.train_batch(data_iter=it), torch.device(args.device),
                        f"engine, {args.worker}, stage 0 of {args.stages}")
        if torch.distributed.get_rank() == 0:
            print("PROFILE " + json.dumps(text), flush=True)
    tokens = train.micro_batch_size * train.micro_batches * train.seq_len
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps({"tokens_per_s": tokens / min(times[args.warmup:]), "parts": parts,
                                      "loss": float(loss)}), flush=True)
    # As launch/train.py: gloo's threads can abort a finished rank in the interpreter's teardown.
    from retropipe.training.pipeline.deepspeed_engine import shutdown
    shutdown()
    sys.stdout.flush()
    os._exit(0)


def run_pipeline(args, kind: str, policy: str) -> tuple[float, list[int], float]:
    """Tokens/s of the pipeline (best step after warm-up), its cut, the largest peak RSS of a rank."""
    from retropipe.training.run.hardware import thread_environment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = args.stages
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), **thread_environment(policy, n, n),
           **({"DS_ACCELERATOR": "cpu"} if args.device == "cpu" else {})}
    argv = [sys.executable, __file__, *sys.argv[1:], "--worker", kind, "--fused-head", str(args.fused_head).lower(),
            "--micro-batch-size", str(args.micro_batch_size), "--micro-batches", str(args.micro_batches),
            "--feed", args.feed, "--grads", args.grads]
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(n)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"pipeline worker failed:\n{outs[0][-3000:]}\n{outs[-1][-3000:]}")
    result = json.loads(next(line for line in outs[0].splitlines() if line.startswith("RESULT "))[7:])
    for line in outs[0].splitlines():
        if line.startswith("PROFILE "):
            print(json.loads(line[8:]), flush=True)
    rss = max(float(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("PEAK_RSS_MB "))
    print(f"  pipeline {kind} {policy} fed on the {args.feed}, grads {args.grads}: loss {result['loss']:.6f} after "
          f"{args.warmup + args.steps} steps, {result['tokens_per_s']:,.0f} tokens/s", flush=True)
    return result["tokens_per_s"], result["parts"], rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,retro")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--n-layer", type=int, default=0, help="override the preset's layers")
    parser.add_argument("--n-embd", type=int, default=0, help="override the preset's width")
    parser.add_argument("--n-head", type=int, default=0, help="override the preset's heads")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=50257,
                        help="a small one makes the compute negligible: what is left is each step's host work")
    parser.add_argument("--chunk-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=4, help="timed steps (best one counts)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="alternate single/pipeline this many times")
    parser.add_argument("--threads", default="split,shared", help="pipeline thread policies to compare")
    parser.add_argument("--fused-head", default="true", help="LM-head paths to compare: true, false or both")
    parser.add_argument("--layouts", default="", help="micro-batch layouts to compare, size x count: 4x4,2x8 "
                        "(the same global batch cut finer shrinks the bubble); default: the two options above")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per pipeline stage, the single loop on the first")
    parser.add_argument("--compile", action="store_true",
                        help="each block through torch.compile, in the single loop and the pipeline (train.compile)")
    parser.add_argument("--feed", default="device",
                        help="the pipeline's micro-batches, a list to compare: copied to its GPU without waiting, "
                             "as training feeds them (device), or handed over on the host for DeepSpeed's blocking "
                             "copies (host)")
    parser.add_argument("--grads", default="one-call",
                        help="bf16: how the pipeline adds each micro-batch's bf16 gradients to its fp32 ones, a "
                             "list to compare: after its backward in one call, as training does (one-call), or "
                             "from DeepSpeed's hook per parameter (hooks, immediate_grad_update)")
    parser.add_argument("--profile", action="store_true",
                        help="one more step of each under the torch profiler: where its time went (rank 0's)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not args.worker:
        import torch

        if torch.cuda.device_count() < args.stages:
            parser.error(f"--device cuda needs a GPU per stage: {args.stages} stages, "
                         f"{torch.cuda.device_count()} GPUs")
    feeds, grads = args.feed.split(","), args.grads.split(",")
    if not set(feeds) <= {"device", "host"}:
        parser.error(f"--feed: device, host or both, not {args.feed!r}")
    if not set(grads) <= {"one-call", "hooks"}:
        parser.error(f"--grads: one-call, hooks or both, not {args.grads!r}")
    if args.worker:
        args.fused_head = args.fused_head == "true"
        return worker(args)

    import torch

    from retropipe.training.models.flops import flops_per_token, mfu
    from retropipe.training.run.hardware import describe, matmul_flops_per_s

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak = max(matmul_flops_per_s(dtype, args.device, seconds=1.0) for _ in range(3))
    layouts = [tuple(int(v) for v in layout.split("x")) for layout in args.layouts.split(",") if layout] \
        or [(args.micro_batch_size, args.micro_batches)]
    p = args.stages
    shape = configs(args, "gpt2")[0]
    print(describe())
    print(f"preset {args.preset} ({shape.n_layer} layers, width {shape.n_embd}), seq_len {args.seq_len}, "
          f"{args.precision}{', blocks compiled' if args.compile else ''}, micro-batches fed on the "
          f"{' or the '.join(feeds)}; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s; "
          "micro-batch layouts (size×count) "
          + ", ".join(f"{b}×{m} (bubble bound M/(M+P-1) = {m / (m + p - 1):.2f})" for b, m in layouts))
    # a variant of the pipeline: its thread policy, where its micro-batches are handed over, how its bf16
    # gradients are added
    policies = args.threads.split(",")
    variants = [(policy, feed, grad) for policy in policies for feed in feeds for grad in grads]
    heads = args.fused_head.split(",")
    rows = []
    for kind in args.models.split(","):
        for head in heads:
            for args.micro_batch_size, args.micro_batches in layouts:
                args.fused_head = head == "true"
                layout = f"{args.micro_batch_size}x{args.micro_batches}"
                single, pipe, rss = [], {v: [] for v in variants}, {v: 0.0 for v in variants}
                for _ in range(args.repeat):  # alternate, so machine noise hits every variant
                    single.append(run_single(args, kind))
                    for variant in variants:
                        policy, args.feed, args.grads = variant
                        tps, parts, peak_rss = run_pipeline(args, kind, policy)
                        pipe[variant].append(tps)
                        rss[variant] = max(rss[variant], peak_rss)
                fpt = flops_per_token(configs(args, kind)[0], args.seq_len)
                s = max(single)
                for variant in variants:
                    q = max(pipe[variant])
                    label = "/".join(v for v, axis in zip(variant, (policies, feeds, grads)) if len(axis) > 1) \
                        or variant[0]
                    rows.append((kind, head, label, s, q, q / s, mfu(fpt, s, peak), mfu(fpt, q, peak),
                                 rss[variant], parts, layout))
    print(f"\n{'model':<6} {'fused':>5} {'layout':>6} {'variant':>13} {'single tok/s':>12} {'pipeline tok/s':>14} "
          f"{'ratio':>6} {'MFU single':>10} {'MFU pipe':>9} {'rank RSS MB':>11}  partition")
    for kind, head, policy, s, q, ratio, mfu_s, mfu_q, rss_mb, parts, layout in rows:
        print(f"{kind:<6} {head:>5} {layout:>6} {policy:>13} {s:>12,.0f} {q:>14,.0f} {ratio:>5.2f}x {mfu_s:>10.1%} "
              f"{mfu_q:>9.1%} {rss_mb:>11,.0f}  {parts}")
    first = rows[0]
    for row in rows[1:]:  # side by side with the first variant (e.g. main's settings: plain head, split threads)
        print(f"{row[0]} fused={row[1]} {row[10]} {row[2]}: pipeline {row[4] / first[4]:.2f}× the tokens/s of "
              f"{first[0]} fused={first[1]} {first[10]} {first[2]}, peak rank RSS {row[8] / first[8]:.2f}×")
    best = max(rows, key=lambda r: r[5])
    print(f"goal: pipeline ≥ 0.85× single (best: {best[5]:.2f}× with {best[2]})")


if __name__ == "__main__":
    main()
