"""What this machine computes with: CPU vector features, GPUs, the precision `auto` stands for, the
matmul peak that MFU is measured against, and the thread settings of a CPU pipeline stage.

Every benchmark prints `describe()` so that a figure always names its machine: on a CPU the
fp32/bf16 choice hinges on AVX512-BF16 / AMX (bf16 is ~2.6× faster than fp32 with them, several
times slower without).
"""

from __future__ import annotations

import functools
import os
import platform
import time

CPU_FLAGS = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16() -> bool:
    """The CPU has bf16 instructions and oneDNN, which runs torch's CPU matmuls, may use them.

    oneDNN held below AVX512-BF16 (ONEDNN_MAX_CPU_ISA=AVX2: how one runs an AVX2-only CPU's code
    paths on this one) emulates bf16 matmuls, 15-35× slower than fp32 (docs/benchmarks.md).
    """
    held = {os.environ.get(k, "").upper() for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    below_bf16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and not (held & below_bf16)


def resolve_precision(precision: str) -> str:
    """The precision "auto" stands for on this machine; others are returned as they are."""
    if precision != "auto":
        return precision
    import torch

    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_bf16() else "fp32"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe() -> str:
    """One line: CPU model, cores, vector features present and absent, GPUs, torch version."""
    import torch

    flags = cpu_flags()
    have = [name for flag, name in CPU_FLAGS.items() if flag in flags]
    lack = [name for flag, name in CPU_FLAGS.items() if flag not in flags and flag != "fma"]
    gpu = (f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU")
    # The kernels torch runs can be held below what the CPU has (ATEN_CPU_CAPABILITY=avx2 and
    # ONEDNN_MAX_CPU_ISA=AVX2 run an AVX2-only CPU's code paths on an AVX-512 one): say so.
    kernels = torch.backends.cpu.get_cpu_capability()
    held = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)]
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


def matmul_flops_per_s(dtype=None, device: str = "cpu", size: int = 1024, seconds: float = 0.3) -> float:
    """This process's dense matmul FLOP/s in dtype (best of repeated size² products): the one peak
    that every MFU figure (training log, bench/model_step.py) is measured against."""
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best
