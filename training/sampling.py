"""Sampling from GPT-2 or RETRO, with RETRO's retrieval at every chunk boundary (plain torch).

    out = generate(model, prompt_tokens, max_new_tokens=64, temperature=0.8, top_k=50, top_p=0.95,
                   seed=0, eot_id=50256, retrieve=fn)   # fn(chunk_tokens, chunk_index) -> (k, r) ids
    out.tokens, out.new_tokens, out.stop ("eot" | "max_tokens"), out.retrievals

Retrieval (RETRO paper §2.4; lucidrains' RETRO-pytorch `generate`): the neighbours of chunk u
are found with chunk u's own text and, through the causal shift of the chunked cross-attention,
reach predictions from chunk u's last token on. So chunk u is retrieved when the sequence has
just completed it (its length hit (u + 1) · chunk_len) and another token is to be sampled:
that token is the first one they can influence. At the start, every complete chunk of the
prompt is retrieved, and so is a partial last chunk of the prompt (a prompt shorter than one
chunk too), with the text it has; its neighbours cannot influence any prediction until the
chunk is complete, when it is retrieved again with its whole text, which replaces them. A
chunk begun during generation has no neighbours (all -1) until it is complete; causally they
could not matter yet.

`training` never imports `retrieval`: the embedder and the index come in as the `retrieve`
callback, wired by launch/generate.py (retrieval/query.py). No key/value cache: every step
runs the model over the whole context (at most model.n_positions tokens), which keeps the
RETRO chunk bookkeeping simple and costs little at the sizes this project samples from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

# retrieve(tokens of chunk u so far, u) -> (k, r) int64 neighbour + continuation ids, -1 = missing
Retrieve = Callable[[list[int], int], "np.ndarray | torch.Tensor"]


@dataclass
class Retrieval:
    """One call of `retrieve`: chunk index, sequence length when called, query tokens, result."""

    chunk: int
    seq_len: int        # len(tokens) when retrieved: (chunk + 1) · chunk_len unless the query was partial
    query_len: int      # tokens of the chunk in the query (< chunk_len only for the prompt's partial chunk)
    neighbours: np.ndarray  # (k, r) int64, -1 = missing


@dataclass
class Generation:
    tokens: list[int]        # prompt + new tokens (the end-of-text token included if it stopped there)
    new_tokens: list[int]
    stop: str                # "eot" or "max_tokens"
    retrievals: list[Retrieval] = field(default_factory=list)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got temperature "
                         f"{temperature}, top_k {top_k}, top_p {top_p}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (b,) from logits (b, vocab). temperature 0 = greedy; top_k 0 / top_p 1 = off.

    Filtering order as Hugging Face's: temperature, then top-k, then top-p (the smallest set of
    most likely tokens whose probability reaches top_p; the most likely token always stays).
    """
    check_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]                   # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)              # (b, vocab)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)      # (b,)


def context_window(n: int, n_positions: int, chunk_len: int | None) -> tuple[int, int]:
    """(start, padded length) of the tokens the model sees when the sequence is n tokens long.

    GPT-2 (chunk_len None): the last n_positions tokens, unpadded. RETRO: the window starts on
    a chunk boundary (so each chunk keeps its own neighbours) and is padded to whole chunks; the
    padding follows the last real token, so causally it changes no logit we read.
    """
    if chunk_len is None:
        start = max(0, n - n_positions)
        return start, n - start
    longest = n_positions // chunk_len * chunk_len
    end = -(-n // chunk_len) * chunk_len                                        # n rounded up to whole chunks
    start = max(0, end - longest)
    return start, end - start


def generate(model: nn.Module, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eot_id: int | None = None,
             retrieve: Retrieve | None = None) -> Generation:
    """Sample up to max_new_tokens after prompt (a batch of one); stop early at eot_id.

    Deterministic for a seed: the sampling generator is a CPU torch.Generator seeded with
    `seed`, and sampling runs on CPU whatever the model's device. For RETRO, `retrieve` is
    called as the module docstring says; None = RETRO[OFF] (no neighbours). GPT-2 takes none.
    """
    cfg = model.cfg
    retro = cfg.kind == "retro"
    check_sampling(temperature, top_k, top_p)
    if not prompt:
        raise ValueError("the prompt must hold at least one token (start from end-of-text for none)")
    if retrieve is not None and not retro:
        raise ValueError("a retrieve function was given, but the model is GPT-2 (model.kind 'gpt2')")
    m = cfg.chunk_len
    if retro and cfg.n_positions < m:
        raise ValueError(f"model.n_positions ({cfg.n_positions}) is shorter than one chunk ({m} tokens)")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    tokens = [int(t) for t in prompt]
    fetched: dict[int, tuple[int, torch.Tensor]] = {}                        # chunk → (query length, (k, r))
    out = Generation(tokens=tokens, new_tokens=[], stop="max_tokens")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for step in range(max_new_tokens):
                n = len(tokens)
                start, length = context_window(n, cfg.n_positions, m if retro else None)
                x = torch.full((1, length), eot_id or 0, dtype=torch.int64)      # padding: any id will do
                x[0, :n - start] = torch.tensor(tokens[start:], dtype=torch.int64)
                if retro and retrieve is not None:
                    for u in range(start // m, (start + length) // m):
                        have = fetched.get(u, (0, None))[0]
                        query_len = min(m, n - u * m)
                        if (query_len == m and have != m) or (step == 0 and u not in fetched):
                            fetched[u] = (query_len, _retrieve(retrieve, tokens, u, m, query_len, out))
                    nbrs = _window_neighbours(fetched, start // m, length // m, out)  # (1, l, k, r)
                    logits = model(x.to(device), nbrs.to(device))
                else:
                    logits = model(x.to(device))
                nxt = int(sample_next(logits[:, n - start - 1].cpu(), temperature, top_k, top_p, generator))
                tokens.append(nxt)
                out.new_tokens.append(nxt)
                if nxt == eot_id:
                    out.stop = "eot"
                    break
    finally:
        model.train(was_training)
    return out


def _retrieve(retrieve: Retrieve, tokens: list[int], u: int, m: int, query_len: int, out: Generation) -> torch.Tensor:
    """Call retrieve for chunk u, check its (k, r) answer, record the event."""
    got = torch.as_tensor(np.asarray(retrieve(tokens[u * m:u * m + query_len], u)), dtype=torch.int64)
    if got.dim() != 2 or got.shape[1] != 2 * m or got.shape[0] < 1:
        raise ValueError(f"retrieve returned shape {tuple(got.shape)} for chunk {u}; expected (k, {2 * m}) "
                         f"(k neighbours of chunk + continuation)")
    if out.retrievals and got.shape[0] != out.retrievals[0].neighbours.shape[0]:
        raise ValueError(f"retrieve returned {got.shape[0]} neighbours for chunk {u}, "
                         f"but {out.retrievals[0].neighbours.shape[0]} before")
    out.retrievals.append(Retrieval(u, len(tokens), query_len, got.numpy().copy()))
    return got


def _window_neighbours(fetched: dict[int, tuple[int, torch.Tensor]], first: int, chunks: int,
                       out: Generation) -> torch.Tensor:
    """(1, chunks, k, r) neighbours of chunks first … first + chunks - 1; -1 where none were fetched."""
    k, r = out.retrievals[0].neighbours.shape
    missing = torch.full((k, r), -1, dtype=torch.int64)
    rows = [fetched[u][1] if u in fetched else missing for u in range(first, first + chunks)]
    return torch.stack(rows)[None]
