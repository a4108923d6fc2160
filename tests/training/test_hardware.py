"""What training asks of the machine (training/run/hardware.py) and the guards of the GPU and
multi-node paths that a CPU run cannot reach by itself: the precision `auto` picks, the GPUs a node
needs, the processes on a node, the matmul peak MFU is measured against, the CUDA generators,
the tied embedding's rounding."""

import pytest
import torch

import retropipe.data.cpu as cpu
import retropipe.training.run.hardware as hw
from retropipe.training.models.layers import seeded
from retropipe.training.run.trainer import rounding_tolerance


def test_precision_auto_takes_bf16_only_where_the_kernels_may_use_it(monkeypatch, kernels_unheld):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hw.resolve_precision("auto") == "bf16"
    # oneDNN (torch's CPU matmuls) held to AVX2 on the same CPU emulates bf16 (15-35× slower): fp32.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert hw.resolve_precision("auto") == "fp32"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert hw.resolve_precision("auto") == "bf16"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # ATen's elementwise kernels only: matmuls keep bf16
    assert hw.resolve_precision("auto") == "bf16"
    assert "ATEN_CPU_CAPABILITY=avx2" in hw.describe()
    # MKL runs the fp32 matmuls; held to AVX2 it changes no precision, and the machine line says so.
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert hw.resolve_precision("auto") == "bf16" and "MKL_ENABLE_INSTRUCTIONS=AVX2" in hw.describe()
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert hw.resolve_precision("auto") == "fp32" and hw.resolve_precision("bf16") == "bf16"


def test_bf16_by_name_is_warned_about_only_where_the_cpu_emulates_it(monkeypatch, kernels_unheld):
    """train.precision and eval.precision "bf16" on such a CPU run, many times slower than fp32: said."""
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cpu.emulated_bf16("train.precision", "bf16", "cpu").startswith("train.precision is bf16, but ")
    assert cpu.emulated_bf16("train.precision", "auto", "cpu") is None          # auto takes fp32 there
    assert cpu.emulated_bf16("train.precision", "bf16", "cuda:0") is None       # a GPU's own check
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    assert cpu.emulated_bf16("eval.precision", "bf16", "cpu") is not None       # held below its bf16 instructions
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert cpu.emulated_bf16("eval.precision", "bf16", "cpu") is None


def test_mfu_of_emulated_bf16_is_measured_against_the_fp32_peak(monkeypatch, kernels_unheld):
    """Its arithmetic runs on the fp32 units: against the emulation's own speed it logged MFU 2-3."""
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert hw.peak_dtype(torch.bfloat16, "cpu") == torch.float32
    assert hw.peak_dtype(torch.float32, "cpu") == torch.float32
    assert hw.peak_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    assert hw.peak_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the same CPU held below its bf16 instructions
    assert hw.peak_dtype(torch.bfloat16, "cpu") == torch.float32


def test_the_worlds_matmul_peak_counts_a_cpu_host_shared_by_its_ranks_once():
    """MFU's denominator: every GPU adds its own peak; CPU ranks with shared threads run on the same
    cores, so only local rank 0 adds one, measured on all the host's cores; split threads add their own."""
    assert [hw.share_of_peak("cuda", "shared", r) for r in (0, 1)] == ["own", "own"]
    assert [hw.share_of_peak("cpu", "shared", r) for r in (0, 1, 2)] == ["host", "none", "none"]
    assert [hw.share_of_peak("cpu", "split", r) for r in (0, 1)] == ["own", "own"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert hw.host_matmul_flops_per_s(torch.float32) > 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_a_gpu_before_ampere_gets_fp16_not_emulated_bf16(monkeypatch):
    """torch.cuda.is_bf16_supported() says True on a V100 or T4 (emulation, far slower than fp16);
    the precision comes from this rank's own GPU's compute capability."""
    assert not hw.gpu_has_bf16((7, 0)) and not hw.gpu_has_bf16((7, 5))
    assert hw.gpu_has_bf16((8, 0)) and hw.gpu_has_bf16((9, 0))
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or (7, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: pytest.fail("emulation counts as support"))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert hw.resolve_precision("auto") == "fp16" and asked == [3]  # its own GPU, not cuda:0


def test_a_node_with_fewer_gpus_than_processes_is_refused_in_one_line():
    assert hw.too_few_gpus(2, 2) is None and hw.too_few_gpus(1, 8) is None and hw.too_few_gpus(2, 0) is None
    why = hw.too_few_gpus(2, 1)
    assert "2 processes but has 1 GPU" in why and "--num_gpus 1" in why and "CUDA_VISIBLE_DEVICES=" in why
    assert "\n" not in why


def test_processes_on_a_node_come_from_the_launcher_not_the_world():
    """DeepSpeed's launcher sets LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE: on 2 nodes of 4 processes
    the threads of a CPU process are divided by 4, not by the world's 8."""
    assert hw.local_processes({"LOCAL_SIZE": "4", "WORLD_SIZE": "8"}, 8) == 4
    assert hw.local_processes({"LOCAL_WORLD_SIZE": "2"}, 8) == 2
    assert hw.local_processes({}, 8) == 8


def test_the_gpu_peak_is_timed_over_large_products_between_synchronisations():
    """One synchronised 1024² product is mostly launch overhead on an H100: MFU came out above 1."""
    size, reps = hw.peak_matmul_shape("cuda")
    assert size >= 8192 and reps >= 10
    assert hw.peak_matmul_shape("cpu") == (1024, 1)
    assert hw.matmul_flops_per_s(torch.float32, "cpu", size=256, seconds=0.05) > 0


def test_seeded_leaves_every_cuda_generator_alone():
    """Layers are built on the CPU under their own seed. torch.manual_seed would also reseed every
    CUDA generator and leave them so, giving every data-parallel replica the same dropout masks.
    Without a GPU torch queues such a seed for when CUDA starts: none may be queued."""
    if torch.cuda.is_available():
        before = torch.cuda.get_rng_state_all()
        with seeded(5):
            torch.rand(2)
        assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all()))
        return
    from torch.cuda import _lazy_seed_tracker

    before = list(_lazy_seed_tracker.get_calls())
    with seeded(5):
        torch.rand(2)
    assert list(_lazy_seed_tracker.get_calls()) == before


def test_the_tied_embedding_may_drift_by_rounding_not_by_steps():
    assert rounding_tolerance(0.5, torch.float32) == pytest.approx(5e-6)
    assert rounding_tolerance(0.5, torch.bfloat16) == pytest.approx(2 * 2 ** -7 * 0.5)
    assert 3e-8 < rounding_tolerance(0.5, torch.float32) < 2e-3  # a 3-replica drift passes; one lr step does not
