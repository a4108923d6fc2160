"""Sampling (training/evaluation/sampling.py), in-process: filters, seeded determinism, retrieval at
chunk boundaries, the key/value cache, batches of samples, end-of-text. tests/launch/test_generate.py
runs the CLI on a real retrieval database.
"""

import numpy as np
import pytest
import torch
import torch.nn as nn

from retropipe.training.evaluation.sampling import context_window, generate, generate_samples, sample_next
from retropipe.training.models.registry import build_model
from retropipe.training.models.config import ModelConfig

M, K = 8, 2  # chunk_len, neighbours per chunk


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(kind: str, **kw) -> ModelConfig:
    return ModelConfig(**{**dict(kind=kind, vocab_size=50257, n_positions=64, n_layer=2, n_head=2, n_embd=32,
                                 encoder_layers=1, encoder_embd=16, encoder_head=2, chunk_len=M), **kw})


def model_of(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def stub_neighbours(chunk_tokens: list[int]) -> np.ndarray:
    """A deterministic (K, 2M) answer that identifies its query: the query's tokens, repeated."""
    row = np.resize(np.asarray(chunk_tokens, dtype=np.int64), 2 * M)
    return np.stack([row, (row + 1) % 50257])


class Recorder:
    """Records the (tokens, neighbours) of each full-window pass (model.hidden; the real model runs)."""

    def __init__(self, model: nn.Module):
        self.calls, hidden = [], model.hidden

        def record(tokens, neighbours=None):
            self.calls.append([tokens.clone(), neighbours.clone()])
            return hidden(tokens, neighbours)
        model.hidden = record


# --- sampling filters -------------------------------------------------------------------------

def test_sample_next_greedy_top_k_top_p():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(4000, 1)      # (4000, 4)
    g = torch.Generator().manual_seed(0)
    assert (sample_next(logits, temperature=0) == 1).all()
    assert (sample_next(logits, top_k=1, generator=g) == 1).all()
    assert set(sample_next(logits, top_k=2, generator=g).tolist()) == {1, 3}
    # Sorted: 0.5, 0.3 reach 0.8; 0.15 and 0.05 are cut. A tiny top_p keeps the top token only.
    assert set(sample_next(logits, top_p=0.8, generator=g).tolist()) == {1, 3}
    assert set(sample_next(logits, top_p=0.81, generator=g).tolist()) == {1, 2, 3}
    assert (sample_next(logits, top_p=1e-6, generator=g) == 1).all()
    freq = np.bincount(sample_next(logits, generator=g).numpy(), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.05, 0.5, 0.15, 0.3], atol=0.03)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, temperature=-1)


def test_context_window_is_chunk_aligned_for_retro():
    assert context_window(5, 32, M) == (0, 8)
    assert context_window(32, 32, M) == (0, 32)
    assert context_window(33, 32, M) == (8, 32)   # 33 real tokens → 40 padded, the last 4 chunks
    assert context_window(33, 36, M) == (8, 32)   # n_positions rounded down to whole chunks
    assert context_window(33, 32, None) == (1, 32)


# --- determinism ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpt2", "retro"])
def test_generation_is_deterministic_for_a_seed(kind):
    model = model_of(tiny(kind))
    retrieve = (lambda toks, u: stub_neighbours(toks)) if kind == "retro" else None
    run = lambda seed: generate(model, [464, 3290, 318], 20, temperature=1.0, top_k=50, top_p=0.95,  # noqa: E731
                                seed=seed, retrieve=retrieve).tokens
    assert run(7) == run(7)
    assert run(7) != run(8)


# --- retrieval at chunk boundaries ------------------------------------------------------------

def test_retrieves_at_chunk_boundaries_and_feeds_each_chunk_its_neighbours():
    model = model_of(tiny("retro", n_positions=4 * M))   # a 4-chunk window: the context slides too
    calls = []

    def retrieve(chunk_tokens, u):
        calls.append((u, list(chunk_tokens)))
        return stub_neighbours(chunk_tokens)

    recorder = Recorder(model)
    prompt = [464, 3290, 318, 257, 1332]                   # 5 tokens: shorter than one chunk
    out = generate(model, prompt, 40, seed=0, retrieve=retrieve, cache=False)  # forward sees the whole window
    assert out.stop == "max_tokens" and len(out.tokens) == 45
    # The partial prompt chunk at the start, then each chunk as the sequence completes it (and
    # a token follows): lengths 8, 16, 24, 32, 40. Never in between.
    assert [(r.chunk, r.seq_len, r.query_len) for r in out.retrievals] == \
        [(0, 5, 5), (0, 8, 8), (1, 16, 8), (2, 24, 8), (3, 32, 8), (4, 40, 8)]
    assert calls[0] == (0, prompt)
    for u, query in calls[1:]:
        assert query == out.tokens[u * M:(u + 1) * M]

    assert len(recorder.calls) == 40
    for step, (tokens, neighbours) in enumerate(recorder.calls):
        n = len(prompt) + step                               # sequence length at this forward
        start = max(0, -(-n // M) * M - 4 * M)
        assert start % M == 0 and tokens.shape[1] == -(-n // M) * M - start <= 4 * M
        assert tokens[0, :n - start].tolist() == out.tokens[start:n]
        assert neighbours.shape == (1, tokens.shape[1] // M, K, 2 * M)
        for j in range(neighbours.shape[1]):
            u = start // M + j
            if (u + 1) * M <= n:                             # complete: its own neighbours
                expected = stub_neighbours(out.tokens[u * M:(u + 1) * M])
            elif u == 0 and step < M - len(prompt):          # the prompt's partial chunk
                expected = stub_neighbours(prompt)
            else:                                            # begun during generation: none yet
                expected = np.full((K, 2 * M), -1)
            assert neighbours[0, j].tolist() == expected.tolist(), (step, u)


def test_neighbours_of_an_incomplete_chunk_change_nothing():
    """Why retrieving the partial prompt chunk is safe: causally its neighbours reach no output."""
    model = model_of(tiny("retro"))
    prompt = [464, 3290, 318]

    def retrieve(garbage: bool):
        def fn(chunk_tokens, u):
            if len(chunk_tokens) < M:
                return np.random.default_rng(len(chunk_tokens)).integers(0, 50257, (K, 2 * M)) if garbage \
                    else np.full((K, 2 * M), -1)
            return stub_neighbours(chunk_tokens)
        return fn

    a = generate(model, prompt, 20, temperature=0, retrieve=retrieve(True))
    b = generate(model, prompt, 20, temperature=0, retrieve=retrieve(False))
    assert a.tokens == b.tokens


def test_prompt_of_whole_chunks_is_retrieved_at_the_start():
    model = model_of(tiny("retro"))
    out = generate(model, list(range(100, 100 + 2 * M)), 3, seed=0, retrieve=lambda t, u: stub_neighbours(t))
    assert [(r.chunk, r.seq_len, r.query_len) for r in out.retrievals] == [(0, 16, 8), (1, 16, 8)]


# --- the key/value cache and batches of samples ---------------------------------------------------

def events(out):
    return [(r.chunk, r.seq_len, r.query_len, r.neighbours.tolist()) for r in out.retrievals]


@pytest.mark.parametrize("kind", ["gpt2", "retro"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_len", [5, 2 * M + 3])   # shorter than a chunk; longer than one, partial last
def test_cache_gives_exactly_the_tokens_of_the_full_forward(kind, temperature, prompt_len):
    """Through RETRO's retrievals at chunk boundaries and past n_positions (the window slides:
    4 chunks of context, 45 tokens and more)."""
    model = model_of(tiny(kind, n_positions=4 * M))
    calls = {True: [], False: []}

    def retrieve(cache):
        def fn(chunk_tokens, u):
            calls[cache].append((u, list(chunk_tokens)))
            return stub_neighbours(chunk_tokens)
        return fn if kind == "retro" else None

    prompt = list(range(464, 464 + prompt_len))
    outs = {cache: generate(model, prompt, 40, temperature=temperature, top_k=50, top_p=0.95, seed=3,
                            retrieve=retrieve(cache), cache=cache) for cache in (True, False)}
    assert len(outs[True].tokens) == prompt_len + 40 > model.cfg.n_positions
    assert outs[True].tokens == outs[False].tokens
    assert events(outs[True]) == events(outs[False]) and calls[True] == calls[False]
    if kind == "retro":
        assert len(outs[True].retrievals) >= 5
        off = {cache: generate(model, prompt, 40, temperature=temperature, seed=3, cache=cache).tokens
               for cache in (True, False)}                     # RETRO[OFF]
        assert off[True] == off[False]


@pytest.mark.parametrize("kind", ["gpt2", "retro"])
def test_samples_of_a_batch_are_the_single_runs_of_their_seeds(kind):
    model = model_of(tiny(kind))
    retrieve = (lambda toks, u: stub_neighbours(toks)) if kind == "retro" else None
    prompt = [464, 3290, 318]
    free = generate_samples(model, prompt, 20, 3, temperature=1.0, seed=5, retrieve=retrieve)
    assert len({tuple(o.tokens) for o in free}) == 3              # independent samples
    # An end-of-text id that sample 0 draws early: it leaves the batch, the others go on.
    eot = free[0].new_tokens[4]
    for cache in (True, False):
        batch = generate_samples(model, prompt, 20, 3, temperature=1.0, seed=5, eot_id=eot, retrieve=retrieve,
                                 cache=cache)
        single = [generate(model, prompt, 20, temperature=1.0, seed=5 + j, eot_id=eot, retrieve=retrieve, cache=cache)
                  for j in range(3)]
        assert batch[0].stop == "eot" and len(batch[0].new_tokens) <= 5
        assert any(o.stop == "max_tokens" for o in batch)
        assert [o.tokens for o in batch] == [o.tokens for o in single]
        assert [events(o) for o in batch] == [events(o) for o in single]


@pytest.mark.parametrize("kind", ["gpt2", "retro"])
def test_every_tensor_of_a_step_is_made_on_the_models_device(kind):
    """What a CPU-only machine can check of the CUDA path: with the default device set to "meta",
    a tensor made without device= lands on meta, and mixing it with the (CPU) model fails."""
    model = model_of(tiny(kind, n_positions=4 * M))
    retrieve = (lambda toks, u: stub_neighbours(toks)) if kind == "retro" else None
    prompt, kw = list(range(400, 419)), dict(temperature=1.0, top_k=50, top_p=0.9, seed=1, retrieve=retrieve)
    reference = [o.tokens for o in generate_samples(model, prompt, 30, 2, **kw)]
    for cache in (True, False):
        model.to("cpu")   # empties the attentions' kept rotary tables: built again under "meta"
        with torch.device("meta"):
            assert [o.tokens for o in generate_samples(model, prompt, 30, 2, cache=cache, **kw)] == reference


# --- end-of-text ----------------------------------------------------------------------------

class Counter(nn.Module):
    """Plain torch: predicts position + 1 until position 5, then end-of-text (id 9), each by a wide margin."""

    def __init__(self):
        super().__init__()
        self.cfg = ModelConfig(kind="gpt2", vocab_size=10, n_positions=16, n_layer=1, n_head=1, n_embd=10)
        self.wte = nn.Embedding(10, 10)     # the tied head reads it: the identity, so logits = hidden
        nn.init.eye_(self.wte.weight)

    def hidden(self, tokens, neighbours=None):
        b, n = tokens.shape
        target = torch.clamp(torch.arange(n) + 1, max=9).where(torch.arange(n) < 5, torch.tensor(9))
        return torch.nn.functional.one_hot(target, 10).float()[None].expand(b, n, 10) * 50.0


def test_stops_at_end_of_text_or_max_tokens():
    out = generate(Counter(), [0], 20, temperature=1.0, seed=0, eot_id=9, cache=False)   # Counter has no decode
    assert out.tokens == [0, 1, 2, 3, 4, 5, 9] and out.stop == "eot" and out.new_tokens[-1] == 9
    out = generate(Counter(), [0], 3, temperature=1.0, seed=0, eot_id=9, cache=False)
    assert out.tokens == [0, 1, 2, 3] and out.stop == "max_tokens"
