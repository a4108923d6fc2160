"""What this CPU computes fast: its feature flags, and whether bf16 matmuls run in hardware.

Shared by training (train.precision "auto", training/run/hardware.py) and the retrieval build
(retrieval.embed_precision "auto"): with AVX512-BF16 or AMX, bf16 matmuls are 2-3× faster than
fp32; without them oneDNN emulates bf16, several times slower. Reads /proc/cpuinfo (Linux).

A fact of the hardware, not of data's stages: it lives in data because training and retrieval
both need it and never import each other, and data is the one package both import.
"""

from __future__ import annotations

import functools
import os
import platform

CPU_FLAGS = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}
# The environment variables that hold torch's CPU kernels below what the CPU has: ATen's own
# (elementwise, softmax, attention), oneDNN's (bf16 matmuls; DNNL_ is its older prefix) and MKL's
# (fp32 matmuls). All at AVX2, an AVX-512 machine runs an AVX2-only CPU's code paths.
ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
HELD_KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", *ONEDNN_ISA_VARIABLES, "MKL_ENABLE_INSTRUCTIONS")


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
    paths on this one) emulates bf16 matmuls, 15-35× slower than fp32; an AVX2-only EPYC's are
    ~170× slower at 1024² (docs/benchmarks.md).
    """
    held = {os.environ.get(k, "").upper() for k in ONEDNN_ISA_VARIABLES}
    below_bf16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and not (held & below_bf16)


def emulated_bf16(key: str, precision: str, device: str) -> str | None:
    """A warning for `key` set to bf16 (by name: "auto" never takes it there) on a CPU that emulates
    bf16's products (cpu_has_bf16 false); None elsewhere."""
    if precision != "bf16" or not str(device).startswith("cpu") or cpu_has_bf16():
        return None
    return (f"{key} is bf16, but this CPU has no bf16 instructions that torch may use (AVX512-BF16 or AMX): "
            f"torch emulates bf16's products, 15-170x slower than fp32's on the CPUs measured; 'auto' takes fp32 here")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
