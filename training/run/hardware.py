"""What this machine computes with: GPUs, the precision `auto` stands for (CPU features:
retropipe.data.cpu), the matmul peak that MFU is measured against, and the thread settings of a
CPU pipeline stage.

Every benchmark prints `describe()` so that a figure always names its machine: on a CPU the
fp32/bf16 choice hinges on AVX512-BF16 / AMX (bf16 is ~2.6× faster than fp32 with them, several
times slower without).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from retropipe.data.cpu import CPU_FLAGS, HELD_KERNEL_VARIABLES, cpu_flags, cpu_has_bf16, cpu_model

def inductor_cxx() -> str | None:
    """The C++ compiler torch.compile's inductor runs on a CPU, where it is on PATH: $CXX, else g++
    (clang++ on macOS), as inductor's own config picks it; None where it is missing."""
    return shutil.which(os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++"))


def gpu_has_bf16(capability: tuple[int, int]) -> bool:
    """bf16 matmuls in hardware: compute capability 8.0 (Ampere) and newer. Older GPUs emulate
    them (torch.cuda.is_bf16_supported() says True there), far slower than fp16."""
    return tuple(capability) >= (8, 0)


def local_gpu() -> int:
    """This process's GPU: its LOCAL_RANK (set by the launcher) among the visible ones."""
    import torch

    return int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)


def resolve_precision(precision: str) -> str:
    """The precision "auto" stands for on this machine; others are returned as they are.

    On GPUs it asks this process's own GPU (LOCAL_RANK) for its compute capability, which touches
    no other GPU and allocates nothing: every rank resolves it before its device is set."""
    if precision != "auto":
        return precision
    import torch

    if torch.cuda.is_available():
        return "bf16" if gpu_has_bf16(torch.cuda.get_device_capability(local_gpu())) else "fp16"
    return "bf16" if cpu_has_bf16() else "fp32"


def local_processes(env: dict, world_size: int) -> int:
    """Processes on this node: LOCAL_SIZE (DeepSpeed's launcher) or LOCAL_WORLD_SIZE (torchrun);
    without either, one node holds the whole world."""
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if env.get(key):
            return int(env[key])
    return world_size


def too_few_gpus(local: int, gpus: int) -> str | None:
    """Why `local` processes cannot run on a node with `gpus` GPUs (each needs one), or None."""
    if gpus == 0 or local <= gpus:
        return None
    return (f"this node starts {local} processes but has {gpus} GPU(s): each process needs its own GPU; "
            f"start at most {gpus} per node (deepspeed --num_gpus {gpus}, with train.pipeline_stages dividing the "
            f"world size), or run on the CPU: CUDA_VISIBLE_DEVICES= deepspeed --num_gpus {local} ...")


def describe() -> str:
    """One line: CPU model, cores, vector features present and absent, GPUs, torch version."""
    import torch

    flags = cpu_flags()
    have = [name for flag, name in CPU_FLAGS.items() if flag in flags]
    lack = [name for flag, name in CPU_FLAGS.items() if flag not in flags and flag != "fma"]
    gpu = (f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU")
    # The kernels torch runs can be held below what the CPU has (HELD_KERNEL_VARIABLES): say so.
    kernels = torch.backends.cpu.get_cpu_capability()
    held = [f"{k}={os.environ[k]}" for k in HELD_KERNEL_VARIABLES if os.environ.get(k)]
    return (f"{cpu_model()}, {os.cpu_count()} cores, {'+'.join(have) or 'no AVX'}"
            + (f" (no {', '.join(lack)})" if lack else "") + f"; {gpu}; torch {torch.__version__}, "
            f"{kernels} kernels" + (f" ({', '.join(held)})" if held else "") + "; "
            f"precision auto = {resolve_precision('auto')}")


def peak_memory_mb(device: str = "cpu") -> tuple[float, float]:
    """This process's peak resident memory and, on CUDA, peak allocated device memory, in MB."""
    import resource

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports kB
    cuda = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0
    return rss, cuda


def cpu_threads(policy: str, local_processes: int, stages: int = 1) -> int:
    """Threads per process of a CPU run with `local_processes` processes on this machine.

    "split": cores / processes each, every process on its own cores. "shared": the stages of one
    pipeline share that pipeline's cores (all of them, unless data-parallel replicas run on the
    same machine). Pipeline stages take turns (a stage waits while its neighbour computes), so with
    "split" a waiting stage's cores idle; with "shared" and OMP_WAIT_POLICY=PASSIVE (waiting
    threads sleep instead of spinning) the busy stage gets them. docs/benchmarks.md measures both.
    """
    cores, local = os.cpu_count() or 1, max(local_processes, 1)
    if policy == "shared":
        replicas = max(1, local // max(min(stages, local), 1))  # pipelines running side by side here
        return max(1, cores // replicas)
    return max(1, cores // local)


def thread_environment(policy: str, local_processes: int, stages: int = 1) -> dict[str, str]:
    """The OpenMP environment of a process under `policy` (read when torch loads: set it before)."""
    return {"OMP_NUM_THREADS": str(cpu_threads(policy, local_processes, stages)),
            "OMP_WAIT_POLICY": "PASSIVE" if policy == "shared" else "ACTIVE"}


def peak_dtype(dtype, device: str):
    """The dtype whose matmul peak MFU is measured against: the run's, except bf16 on a CPU that
    emulates it (cpu_has_bf16 false), which counts against fp32: its arithmetic runs on the fp32
    units, and the emulation's own 1024² products, ~170× slower than fp32's on a 2-core AVX2 EPYC,
    made a bf16 run's logged MFU 2-3 (and took 2 s to measure at every start)."""
    import torch

    if device == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16():
        return torch.float32
    return dtype


def share_of_peak(device: str, policy: str, local_rank: int) -> str:
    """What this process adds to the world's matmul peak (MFU's denominator): "own", its own
    measurement; "host", its host's, measured on all the host's cores; "none", nothing.

    Every GPU adds its own. CPU processes with "shared" threads all run on all their host's cores, so
    one of them (local rank 0) measures the host while the others wait. Measured by each at once and
    summed, the demo's two ranks came to 1.4–1.9× the machine's peak (MFU 0.32–0.36 where one
    measurement of the machine gives 0.45–0.54, a 2-core AVX2 EPYC). With
    "split" each process has its own share of the cores and adds what it measures on them."""
    if device != "cpu" or policy != "shared":
        return "own"
    return "host" if local_rank == 0 else "none"


def host_matmul_flops_per_s(dtype=None) -> float:
    """matmul_flops_per_s on all this host's CPU cores, whatever this process's own thread count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return matmul_flops_per_s(dtype, "cpu")
    finally:
        torch.set_num_threads(threads)


def peak_matmul_shape(device: str) -> tuple[int, int]:
    """(size, products per timing) of the peak measurement. A CPU runs a 1024² product at its peak;
    a GPU needs 8192² and many products between synchronisations, or a timing measures launch
    and synchronisation overhead (an H100 does a 1024² product in ~10 µs) and MFU comes out
    several times too high, above 1."""
    return (1024, 1) if device == "cpu" else (8192, 10)


def matmul_flops_per_s(dtype=None, device: str = "cpu", size: int | None = None, seconds: float = 0.3) -> float:
    """This process's dense matmul FLOP/s in dtype (the best timing of repeated size² products): the
    one peak that every MFU figure (training log, bench/model_step.py) is measured against."""
    import torch

    dtype = dtype or torch.float32
    default_size, reps = peak_matmul_shape(device)
    size = size or default_size
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * size**3 / best
