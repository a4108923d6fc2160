"""The models on a CUDA GPU against the same weights on the CPU: forward, gradients, bf16,
evaluation's chunk selection, decoding with the cache, scoring; and the micro-batches' copy to the
GPU. Skipped where torch sees no GPU (CI has none); run them where one is lent:
`python -m pytest -q tests/training/test_cuda.py`."""

import copy

import numpy as np
import pytest
import torch

from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2, attention
from retropipe.training.models.lm_head import lm_loss
from retropipe.training.models.retro import Retro

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

M = 8  # chunk_len


def tiny(kind: str) -> ModelConfig:
    return ModelConfig(kind=kind, vocab_size=211, n_positions=64, n_layer=4, n_head=2, n_embd=32,
                       encoder_layers=2, encoder_embd=16, encoder_head=2, chunk_len=M)


def pair(kind: str):
    """(cpu model, cuda model) with the same weights, eval mode."""
    torch.manual_seed(0)
    cpu = (Retro if kind == "retro" else GPT2)(tiny(kind)).eval()
    return cpu, copy.deepcopy(cpu).cuda()


def inputs(b=3, l=4, k=2):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 211, (b, l * M), generator=g)
    neighbours = torch.randint(0, 211, (b, l, k, 2 * M), generator=g)
    neighbours[0, 1] = -1                     # a chunk without any neighbour
    neighbours[1, 2, 1] = -1                  # a missing neighbour
    neighbours[-1, :, :, M:] = -1             # missing continuations
    return tokens, neighbours


@pytest.mark.parametrize("kind", ["gpt2", "retro"])
def test_forward_and_gradients_match_the_cpu(kind):
    cpu, gpu = pair(kind)
    tokens, neighbours = inputs()
    args = (tokens, neighbours) if kind == "retro" else (tokens,)
    for model, dev in ((cpu, "cpu"), (gpu, "cuda")):
        h = model.train().hidden(*(a.to(dev) for a in args))
        lm_loss(h, model.wte.weight, torch.roll(tokens, -1, 1).to(dev)).backward()
    torch.testing.assert_close(gpu.eval()(*(a.cuda() for a in args)).cpu(), cpu.eval()(*args), atol=2e-4, rtol=1e-4)
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=2e-4, rtol=1e-3, msg=name)


def test_evaluation_chunk_selection_on_the_gpu_equals_every_chunk():
    _, gpu = pair("retro")
    tokens, neighbours = (x.cuda() for x in inputs())
    with torch.enable_grad():
        full = gpu(tokens, neighbours).detach()              # every chunk through encoder and CCA
    with torch.no_grad():
        torch.testing.assert_close(gpu(tokens, neighbours), full, atol=1e-5, rtol=0)
        off = gpu(tokens, torch.full_like(neighbours, -1))   # no chunk reads: the trunk alone
        torch.testing.assert_close(off, gpu(tokens), atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["gpt2", "retro"])
def test_bf16_autocast_trains_on_the_gpu(kind):
    _, gpu = pair(kind)
    tokens, neighbours = (x.cuda() for x in inputs())
    args = (tokens, neighbours) if kind == "retro" else (tokens,)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = lm_loss(gpu.train().hidden(*args), gpu.wte.weight, torch.roll(tokens, -1, 1))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in gpu.parameters())


def test_attention_runs_sdpa_on_the_gpu_as_the_cpu_computes_it():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 1, 16, generator=g) > 0.3
    mask[..., 0] = True
    for kw in (dict(mask=mask), dict(is_causal=True)):
        on_gpu = attention(*(x.cuda().bfloat16().requires_grad_() for x in (q, k, v)),
                           **{a: (b.cuda() if torch.is_tensor(b) else b) for a, b in kw.items()})
        torch.testing.assert_close(on_gpu.float().cpu(), attention(q, k, v, **kw), atol=0.03, rtol=0.03)


@pytest.mark.parametrize("kind", ["gpt2", "retro"])
def test_decoding_with_the_cache_equals_the_full_forward_on_the_gpu(kind):
    _, gpu = pair(kind)
    tokens, neighbours = (x.cuda() for x in inputs(b=2))
    with torch.no_grad():
        full = gpu(tokens, neighbours) if kind == "retro" else gpu(tokens)
        cache, last = gpu.new_cache(), []
        for t in range(tokens.shape[1]):
            nbr = neighbours[:, :t // M + 1] if kind == "retro" else None
            last.append(gpu.decode(tokens[:, t:t + 1], nbr, cache))
    torch.testing.assert_close(torch.stack(last, 1), full, atol=1e-4, rtol=1e-4)


def test_scoring_on_the_gpu_equals_the_cpu():
    from retropipe.training.evaluation.scoring import score_split

    cpu, gpu = pair("retro")
    g = np.random.default_rng(0)
    c = 12

    class Chunks:                                              # a split of c chunks, the last ones short
        chunk_len, split = M, "validation"
        lengths = np.array([M] * (c - 2) + [5, 3])
        _tokens = g.integers(0, 211, (c, M))

        def tokens(self, ids):
            return self._tokens[np.asarray(ids)]

        def __len__(self):
            return c

    class Neighbours:
        table = np.where(g.random((c, 2, 2 * M)) < 0.9, g.integers(0, 211, (c, 2, 2 * M)), -1)
        table[3] = -1

        def neighbour_tokens(self, split, ids, k):
            return self.table[ids][..., :k, :].copy()

    lengths = np.ones(211, dtype=np.int64)
    on_cpu = score_split(cpu, Chunks(), lengths, 4 * M, 2 * M, Neighbours(), k=2)
    on_gpu = score_split(gpu, Chunks(), lengths, 4 * M, 2 * M, Neighbours(), k=2)
    np.testing.assert_allclose(on_gpu.nll, on_cpu.nll, rtol=1e-4, atol=1e-4)
    assert (on_gpu.tokens == on_cpu.tokens).all()


@pytest.mark.parametrize("kind", ["gpt2", "retro"])
def test_compiled_blocks_give_the_eager_loss_and_gradients_on_the_gpu(kind):
    # train.compile's blocks (nn.Module.compile in place, inductor's Triton kernels) against eager.
    torch.manual_seed(0)
    eager = (Retro if kind == "retro" else GPT2)(tiny(kind)).cuda()
    compiled = copy.deepcopy(eager)
    for block in compiled.blocks:
        block.compile()
    tokens, neighbours = (x.cuda() for x in inputs())
    args = (tokens, neighbours) if kind == "retro" else (tokens,)
    losses = [lm_loss(m.train().hidden(*args), m.wte.weight, torch.roll(tokens, -1, 1)) for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=2e-4, rtol=1e-3, msg=name)


def test_micro_batches_reach_the_gpu_without_a_host_sync():
    # train.py feeds DeepSpeed micro-batches already on the GPU (onto_device), queued behind the
    # GPU's work: a blocking host-to-GPU copy waits for every kernel before it.
    from retropipe.training.run.trainer import onto_device

    tokens, neighbours = inputs()
    labels = torch.roll(tokens, -1, 1)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_sync_debug_mode("error")   # a synchronizing CUDA call raises
    try:
        torch.cuda._sleep(int(1e9))           # about half a second of GPU work queued ahead of the copies
        (got_tokens, got_neighbours), got_labels = onto_device(((tokens, neighbours), labels), device)
        assert not torch.cuda.current_stream().query()   # the host did not wait for the GPU
        with pytest.raises(RuntimeError, match="synchroniz"):
            tokens.to(device)                 # the blocking copy DeepSpeed would make
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in ((got_tokens, tokens), (got_neighbours, neighbours), (got_labels, labels)):
        assert got.device == device and got.dtype == torch.int64
        assert torch.equal(got.cpu(), want)
    on_cpu = onto_device((tokens, labels), torch.device("cpu"))
    assert on_cpu[0] is tokens and on_cpu[1] is labels


def test_a_process_shown_one_gpu_trains_on_it_whatever_its_local_rank(tmp_path):
    """Slurm's --gpus-per-task and Kubernetes show each process only its own GPU: LOCAL_RANK 3 with
    one visible GPU trains on cuda:0 (DeepSpeed alone would ask for cuda:3)."""
    from retropipe.launch.config import load_config
    from tests.corpora import build_workdir
    from tests.distributed import train
    from tests.launch.test_training import TINY

    sets = [f"workdir={tmp_path}", *TINY, "data.max_documents=100", "train.steps=2", "train.pipeline_stages=1"]
    build_workdir(load_config("configs/tiny-gpt2.yaml", sets))
    args = ["--config", "configs/tiny-gpt2.yaml", *[a for s in sets for a in ("--set", s)]]
    code, log = train(1, args, tmp_path / "logs", env={"DS_ACCELERATOR": "cuda", "CUDA_VISIBLE_DEVICES": "0"},
                      rank_env={0: {"LOCAL_RANK": "3"}})
    assert code == 0 and "train: done" in log, log[-3000:]
