"""Sampling from GPT-2 or RETRO, with RETRO's retrieval at every chunk boundary (plain torch).

    out = generate(model, prompt_tokens, max_new_tokens=64, temperature=0.8, top_k=50, top_p=0.95,
                   seed=0, eot_id=50256, retrieve=fn)   # fn(chunk_tokens, chunk_index) -> (k, r) ids
    out.tokens, out.new_tokens, out.stop ("eot" | "max_tokens"), out.retrievals
    outs = generate_samples(model, prompt_tokens, 64, num_samples=4, seed=0, ...)  # one batch; outs[j] is seed + j

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
callback, wired by launch/generate.py (retrieval/query.py).

Key/value cache (`cache=True`, the default): the prompt is fed once, then one token per step
(`model.decode`, training/models/gpt2.py and retro.py): self-attention reads the earlier positions'
keys and values, and RETRO encodes a chunk's neighbours once, when its last token is fed. The
tokens are the same as without the cache (`cache=False`: every step reruns the model over the
whole context and reads its last position; tested, greedy and seeded). The context is at most model.n_positions tokens;
when the sequence outgrows it the window slides (`context_window`) and, since positions are
absolute, the cache is refilled from the new window: for RETRO once per chunk (its window moves
a whole chunk at a time), for GPT-2 at every step (its window moves one token at a time, so
past n_positions the cache gives no speed-up, and no different token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

from retropipe.training.models.gpt2 import lm_logits

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
             retrieve: Retrieve | None = None, cache: bool = True) -> Generation:
    """Sample up to max_new_tokens after prompt (a batch of one); stop early at eot_id.

    Deterministic for a seed (and device): the sampling generator lives on the model's device,
    seeded with `seed`. For RETRO, `retrieve` is called as the module docstring says; None =
    RETRO[OFF] (no neighbours). GPT-2 takes none. cache: decode with the key/value cache.
    """
    return generate_samples(model, prompt, max_new_tokens, 1, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, eot_id=eot_id, retrieve=retrieve, cache=cache)[0]


def generate_samples(model: nn.Module, prompt: Sequence[int], max_new_tokens: int, num_samples: int, *,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                     eot_id: int | None = None, retrieve: Retrieve | None = None, cache: bool = True) -> list[Generation]:
    """num_samples independent continuations of one prompt, computed as one batch.

    Sample j draws from its own generator seeded with seed + j, so it is the continuation that
    generate(..., seed=seed + j) gives (rows of a batch never mix; tested). The samples stay in
    lockstep (same length, same chunk boundaries, each retrieving with its own text); one that
    reaches end-of-text leaves the batch.
    """
    check_request(model.cfg, prompt, num_samples, retrieve, temperature, top_k, top_p)
    batch = _Batch(model, prompt, num_samples, seed, retrieve, cache)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for step in range(max_new_tokens):
                logits = batch.next_logits(first_step=step == 0, pad_id=eot_id or 0)             # (b, vocab)
                if temperature == 0:
                    nxt = logits.float().argmax(-1)
                else:
                    nxt = torch.cat([sample_next(logits[i:i + 1], temperature, top_k, top_p, batch.generators[j])
                                     for i, j in enumerate(batch.active)])
                if not batch.append(nxt.tolist(), eot_id):                                   # one sync per step
                    break
    finally:
        model.train(was_training)
    return batch.outs


def check_request(cfg, prompt: Sequence[int], num_samples: int, retrieve: Retrieve | None, temperature: float,
                  top_k: int, top_p: float) -> None:
    """A ValueError for a request that cannot be sampled, before any work."""
    check_sampling(temperature, top_k, top_p)
    if not prompt:
        raise ValueError("the prompt must hold at least one token (start from end-of-text for none)")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if retrieve is not None and not cfg.retrieves:
        raise ValueError("a retrieve function was given, but the model is GPT-2 (model.kind 'gpt2')")
    if cfg.retrieves and cfg.n_positions < cfg.chunk_len:
        raise ValueError(f"model.n_positions ({cfg.n_positions}) is shorter than one chunk ({cfg.chunk_len} tokens)")


class _Batch:
    """The samples still running, in batch order, with their neighbours and the key/value cache."""

    def __init__(self, model: nn.Module, prompt: Sequence[int], num_samples: int, seed: int,
                 retrieve: Retrieve | None, cache: bool):
        self.model, self.cfg, self.retrieve = model, model.cfg, retrieve
        self.device = next(model.parameters()).device
        self.generators = [torch.Generator(device=self.device).manual_seed(seed + j) for j in range(num_samples)]
        self.outs = [Generation(tokens=[int(t) for t in prompt], new_tokens=[], stop="max_tokens")
                     for _ in range(num_samples)]
        self.fetched: list[dict[int, tuple[int, torch.Tensor]]] = [{} for _ in self.outs]  # chunk → (query length, (k, r))
        self.active = list(range(num_samples))
        self.kv, self.kv_start = (model.new_cache() if cache else None), 0

    def next_logits(self, first_step: bool, pad_id: int) -> torch.Tensor:
        """The next token's logits (b, vocab) of every active sample, retrieving what has completed."""
        m = self.cfg.chunk_len
        retro = self.cfg.retrieves
        n = len(self.outs[self.active[0]].tokens)                                 # the same for every sample
        start, length = context_window(n, self.cfg.n_positions, m if retro else None)
        nbrs = None
        if retro and self.retrieve is not None:
            for j in self.active:
                _update_neighbours(self.retrieve, self.outs[j], self.fetched[j], start, length, m, first_step,
                                   self.device)
            nbrs = torch.cat([_window_neighbours(self.fetched[j], start // m, length // m, self.outs[j], self.device)
                              for j in self.active])                              # (b, l, k, r)
        if self.kv is not None:
            if start != self.kv_start:  # the window slid: positions changed, refill from its start
                self.kv.reset()
                self.kv_start = start
            fed = self.kv_start + self.kv.length
            x = torch.tensor([self.outs[j].tokens[fed:n] for j in self.active], dtype=torch.int64, device=self.device)
            return self.model.decode(x, nbrs, self.kv)                            # (b, vocab)
        x = torch.full((len(self.active), length), pad_id, dtype=torch.int64, device=self.device)  # padding: any id
        x[:, :n - start] = torch.tensor([self.outs[j].tokens[start:] for j in self.active], device=self.device)
        h = self.model.hidden(x, nbrs)[:, n - start - 1]                          # (b, d): the one position read
        return lm_logits(self.model.wte, h)                                       # (b, vocab)

    def append(self, tokens: list[int], eot_id: int | None) -> bool:
        """Append each active sample's next token; a sample that reached eot_id leaves the batch.
        Whether any sample is still running."""
        keep = []
        for i, (j, t) in enumerate(zip(self.active, tokens)):
            self.outs[j].tokens.append(t)
            self.outs[j].new_tokens.append(t)
            if t == eot_id:
                self.outs[j].stop = "eot"
            else:
                keep.append(i)
        if len(keep) < len(self.active):
            self.active = [self.active[i] for i in keep]
            if self.active and self.kv is not None:
                self.kv.select(torch.tensor(keep, device=self.device))
        return bool(self.active)


def _update_neighbours(retrieve: Retrieve, out: Generation, fetched: dict, start: int, length: int, m: int,
                       first_step: bool, device) -> None:
    """Retrieve every chunk of the window that has just completed (or, at the first step, begun)."""
    n = len(out.tokens)
    for u in range(start // m, (start + length) // m):
        have = fetched.get(u, (0, None))[0]
        query_len = min(m, n - u * m)
        if (query_len == m and have != m) or (first_step and u not in fetched):
            fetched[u] = (query_len, _retrieve(retrieve, out.tokens, u, m, query_len, out).to(device))


def _retrieve(retrieve: Retrieve, tokens: list[int], u: int, m: int, query_len: int, out: Generation) -> torch.Tensor:
    """Call retrieve for chunk u, check its (k, r) answer, record the event."""
    got = torch.as_tensor(np.asarray(retrieve(tokens[u * m:u * m + query_len], u)), dtype=torch.int64, device="cpu")
    if got.dim() != 2 or got.shape[1] != 2 * m or got.shape[0] < 1:
        raise ValueError(f"retrieve returned shape {tuple(got.shape)} for chunk {u}; expected (k, {2 * m}) "
                         f"(k neighbours of chunk + continuation)")
    if out.retrievals and got.shape[0] != out.retrievals[0].neighbours.shape[0]:
        raise ValueError(f"retrieve returned {got.shape[0]} neighbours for chunk {u}, "
                         f"but {out.retrievals[0].neighbours.shape[0]} before")
    out.retrievals.append(Retrieval(u, len(tokens), query_len, got.numpy().copy()))
    return got


def _window_neighbours(fetched: dict[int, tuple[int, torch.Tensor]], first: int, chunks: int,
                       out: Generation, device) -> torch.Tensor:
    """(1, chunks, k, r) neighbours of chunks first … first + chunks - 1; -1 where none were fetched."""
    k, r = out.retrievals[0].neighbours.shape
    missing = torch.full((k, r), -1, dtype=torch.int64, device=device)
    rows = [fetched[u][1] if u in fetched else missing for u in range(first, first + chunks)]
    return torch.stack(rows)[None]
