"""RETRO: chunk causality, masked neighbours, layer-list form, shapes, bf16, RETRO-fit, I/O."""

import dataclasses
import math

import pytest
import torch

from retropipe.training.models.registry import build_model, layer_list
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2, loss_fn
from retropipe.training.models.io import load_model, retrofit, save_model
from retropipe.training.models.layers import LayerStack
from retropipe.training.models.retro import Retro, is_retrieval_parameter

M = 4  # chunk_len


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(kind="retro", vocab_size=101, n_positions=64, n_layer=4, n_head=2, n_embd=32,
                                 encoder_layers=2, encoder_embd=16, encoder_head=2, chunk_len=M), **kw})


def inputs(b=2, l=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 101, (b, l * M), generator=g)
    neighbours = torch.randint(0, 101, (b, l, k, 2 * M), generator=g)
    neighbours[0, 2, 1] = -1  # a missing neighbour
    neighbours[1, 3, :, M:] = -1  # missing continuations
    return tokens, neighbours


def model(cfg=None, seed=0):
    torch.manual_seed(seed)
    return Retro(cfg or tiny()).eval()


def test_default_cca_layers():
    assert tiny().cca_layers() == [2, 4]
    assert ModelConfig(kind="retro", n_layer=12).cca_layers() == [6, 9, 12]
    assert ModelConfig(kind="retro", n_layer=24, n_head=16, n_embd=1024).cca_layers() == [9, 12, 15, 18, 21, 24]


@pytest.mark.parametrize("gate", [False, True])
def test_neighbours_of_chunk_u_reach_only_positions_from_its_last_token_on(gate):
    net = model(tiny(copy_gate=gate))
    tokens, neighbours = inputs()
    logits = net(tokens, neighbours)
    assert logits.shape == (2, 4 * M, 101) and torch.isfinite(logits).all()
    for u in range(4):
        changed = neighbours.clone()
        changed[:, u] = torch.randint(0, 101, changed[:, u].shape)
        after = net(tokens, changed)
        first = (u + 1) * M - 1  # chunk u's last token
        torch.testing.assert_close(after[:, :first], logits[:, :first], rtol=0, atol=1e-6)
        assert (after[:, first] - logits[:, first]).abs().max() > 1e-5


@pytest.mark.parametrize("gate", [False, True])
def test_changing_token_t_changes_no_earlier_logit(gate):
    net = model(tiny(copy_gate=gate))
    tokens, neighbours = inputs()
    logits = net(tokens, neighbours)
    t = 6
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % 101
    after = net(changed, neighbours)
    torch.testing.assert_close(after[:, :t], logits[:, :t], rtol=0, atol=1e-6)


@pytest.mark.parametrize("gate", [False, True])
def test_masked_neighbours_give_exactly_the_trunk(gate):
    net = model(tiny(copy_gate=gate))
    gpt2 = GPT2(dataclasses.replace(net.cfg, kind="gpt2")).eval()
    gpt2.load_state_dict({k: v for k, v in net.state_dict().items() if not is_retrieval_parameter(k)})
    tokens, neighbours = inputs()
    off = torch.full_like(neighbours, -1)
    assert torch.equal(net(tokens, off), gpt2(tokens))
    assert torch.equal(net(tokens), gpt2(tokens))  # neighbours=None is RETRO[OFF]
    assert not torch.equal(net(tokens, neighbours), gpt2(tokens))
    # Without gradients (evaluation) RETRO[OFF] skips the encoder and the CCA: the same logits.
    encoder_calls = []
    net.blocks[net.cfg.cca_blocks()[0]].encoder.register_forward_hook(lambda *_: encoder_calls.append(1))
    with torch.no_grad():
        assert torch.equal(net(tokens, off), gpt2(tokens)) and torch.equal(net(tokens), gpt2(tokens))
        assert not encoder_calls
        net(tokens, neighbours)
    assert encoder_calls == [1]


@pytest.mark.parametrize("gate", [False, True])
def test_evaluation_encodes_only_the_chunks_that_have_a_neighbour(gate):
    net = model(tiny(copy_gate=gate))
    tokens, neighbours = inputs()
    neighbours[0, 1] = neighbours[1, 3] = -1                   # two chunks (of 2 × 4) without any
    with torch.enable_grad():
        full = net(tokens, neighbours)                         # every chunk through encoder and CCA
    encoded_chunks = []
    net.blocks[net.cfg.cca_blocks()[0]].encoder.register_forward_hook(
        lambda mod, args, out: encoded_chunks.append(args[1].shape[:2]))
    with torch.no_grad():
        torch.testing.assert_close(net(tokens, neighbours), full, rtol=0, atol=1e-6)
    assert encoded_chunks == [(1, 6)]                          # the 6 chunks that read, as one batch


def test_missing_neighbours_give_finite_values_and_gradients():
    net = model().train()
    tokens, neighbours = inputs()
    neighbours[:, 1] = -1  # a chunk with no neighbour at all
    loss = loss_fn(net(tokens, neighbours), tokens)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in net.parameters())


def test_the_model_is_its_layer_list():
    """RETRO's forward runs its layer list in order: cut anywhere into stages, each built alone,
    the list computes the same logits (tuples crossing the cuts as they cross pipeline stages)."""
    for cfg in (tiny(), tiny(n_layer=5, retro_layers=[3]), tiny(n_layer=6, retro_layers=[2, 3, 5])):
        net, descs = model(cfg), layer_list(cfg)
        assert all(isinstance(net.get_submodule(d.name), d.cls) for d in descs)
        assert [d.name for d in descs if d.retrieval] == [f"blocks.{i - 1}" for i in cfg.cca_layers()]
        tokens, neighbours = inputs()
        logits = net(tokens, neighbours)
        for cut in range(1, len(descs)):
            first, second = (LayerStack(part).eval() for part in (descs[:cut], descs[cut:]))
            for stage in (first, second):
                stage.load_state_dict(net.state_dict(), strict=False)
            assert torch.equal(second(first((tokens, neighbours))), logits), (cfg.retro_layers, cut)
    names = [d.name for d in layer_list(tiny())]
    assert names == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "wte"]


def test_layer_tuples_follow_the_pipeline_contract():
    cfg = tiny(n_layer=5, retro_layers=[2, 4])
    seq = build_model(cfg).eval()
    tokens, neighbours = inputs()
    x = (tokens, neighbours)
    kinds = []
    for module, forward_fn in seq._calls:
        x = forward_fn(module, x) if forward_fn is not None else module(x)
        items = x if isinstance(x, tuple) else (x,)
        kinds.append("".join("f" if t.is_floating_point() else "i" for t in items))
        assert all(t.dtype == torch.int64 for t in items if not t.is_floating_point())
    # wte (tokens and neighbours), wpe, block0, block1 (first CCA), block2, block3 (last CCA), block4, ln_f, head
    assert kinds == ["fifi", "fifi", "fifi", "fifi", "fifi", "f", "f", "f", "f"]


def test_sequence_not_a_multiple_of_chunk_len_is_rejected():
    net = model()
    tokens, neighbours = inputs()
    with pytest.raises(ValueError, match=r"multiple of model.chunk_len \(4\)"):
        net(tokens[:, :-1], neighbours)
    with pytest.raises(ValueError, match=r"multiple of model.chunk_len \(4\)"):
        build_model(tiny())(tokens[:, :-1], neighbours)
    with pytest.raises(ValueError, match="neighbours must be"):
        net(tokens, neighbours[:, :3])


def test_bf16_forward_backward_on_cpu():
    net = model().train()
    tokens, neighbours = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(net(tokens, neighbours), tokens)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in net.parameters())


def test_retrofit_freezes_the_trunk_and_trains_cca_and_encoder(tmp_path):
    torch.manual_seed(0)
    gpt2 = GPT2(dataclasses.replace(tiny(), kind="gpt2")).eval()
    save_model(gpt2, tmp_path / "gpt2")
    net = retrofit(tmp_path / "gpt2", tiny())
    assert net.cfg.freeze_trunk and net.training
    for name, p in net.named_parameters():
        assert p.requires_grad == is_retrieval_parameter(name), name
    tokens, neighbours = inputs()
    assert torch.equal(net.eval()(tokens), gpt2(tokens))  # starts as the GPT-2 it was fitted to
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net.train()
    for _ in range(2):
        opt.zero_grad()
        loss_fn(net(tokens, neighbours), tokens).backward()
        opt.step()
    after = net.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]) != is_retrieval_parameter(k), k
    with pytest.raises(ValueError, match="model.n_embd"):
        retrofit(gpt2, tiny(n_embd=64))


def test_save_and_load_retro_round_trip(tmp_path):
    net = model()
    save_model(net, tmp_path / "retro")
    loaded = load_model(tmp_path / "retro")
    assert isinstance(loaded, Retro) and not loaded.training
    tokens, neighbours = inputs()
    assert torch.equal(loaded(tokens, neighbours), net(tokens, neighbours))


def test_retro_copies_its_neighbours_continuation():
    """Encoder + CCA carry neighbour content: on random tokens whose neighbours hold the exact next
    chunk, RETRO learns to copy (loss far below ln V) in a few dozen steps, while without
    neighbours, with another sequence's or with one-chunk-late neighbours the loss stays at chance."""
    torch.manual_seed(0)
    V, m, l, b = 256, 8, 4, 16
    cfg = ModelConfig(kind="retro", vocab_size=V, n_positions=m * l, n_layer=2, n_head=2, n_embd=64,
                      encoder_layers=1, encoder_embd=32, encoder_head=2, chunk_len=m)
    net = Retro(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(1)

    def loss(kind: str) -> torch.Tensor:
        x = torch.randint(0, V, (b, (l + 1) * m), generator=g)
        chunks = x.view(b, l + 1, m)
        nbr = torch.cat([chunks[:, :l], chunks[:, 1:]], dim=-1)[:, :, None]     # (b, l, k=1, r): chunk u, then u+1
        if kind == "off":
            nbr = torch.full_like(nbr, -1)
        elif kind == "shuffled":                                                 # another sequence's neighbours
            nbr = nbr.roll(1, dims=0)
        elif kind == "late":                                                     # chunk u gets chunk u-1's
            nbr = torch.cat([torch.full_like(nbr[:, :1], -1), nbr[:, :-1]], dim=1)
        logits = net(x[:, :l * m], nbr)
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:l * m + 1].flatten(), reduction="none")
        return nll.view(b, l * m)[:, m - 1:].mean()   # positions that see a neighbour (chunk 0's reach from m-1)

    for _ in range(80):
        opt.zero_grad()
        loss("on").backward()
        opt.step()
    with torch.no_grad():
        result = {kind: loss(kind).item() for kind in ("on", "off", "shuffled", "late")}
    chance = math.log(V)
    assert result["on"] < 0.1 * chance, result
    assert min(result["off"], result["shuffled"], result["late"]) > 0.9 * chance, result


def decoded_logits(net, tokens, neighbours, steps):
    """(b, pieces, vocab): the logits decode returns (each piece's last position's), fed in pieces of these sizes."""
    cache, out, start = net.new_cache(), [], 0
    for size in steps:
        end = start + size
        chunks = -(-end // M)
        out.append(net.decode(tokens[:, start:end], None if neighbours is None else neighbours[:, :chunks], cache))
        start = end
    return torch.stack(out, 1)


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("prefix", [1, M - 1, M, 2 * M + 1])
def test_decode_with_the_cache_gives_the_forward_logits(prefix, gate):
    """A prompt fed at once, then one token at a time, and pieces spanning chunk boundaries: every
    position's logits equal forward's, with neighbours (some missing) and without (RETRO[OFF])."""
    net = model(tiny(copy_gate=gate))
    with torch.no_grad():
        for block in net.blocks:           # the relative-position bias starts at zero: make it matter
            if hasattr(block, "cca"):
                block.cca.position_bias.normal_()
    tokens, neighbours = inputs(l=6)
    if gate:  # first neighbours that copy their chunk and its continuation: the gate's bigrams match
        for u in range(5):
            neighbours[:, u, 0] = tokens[:, u * M:(u + 2) * M]
    n = tokens.shape[1]
    for nbrs in (neighbours, None):
        with torch.no_grad():
            full = net(tokens, nbrs)                                              # (b, n, vocab)
            one_by_one = decoded_logits(net, tokens, nbrs, [prefix] + [1] * (n - prefix))
            torch.testing.assert_close(one_by_one, full[:, prefix - 1:], rtol=0, atol=2e-5)
            pieces = decoded_logits(net, tokens, nbrs, [prefix, 2 * M + 1, n - prefix - 2 * M - 2, 1])
            torch.testing.assert_close(pieces, full[:, [prefix - 1, prefix + 2 * M, n - 2, n - 1]], rtol=0, atol=2e-5)
    # The encoding of chunk u is made when its last token is fed: neighbours given later are not read.
    cache = net.new_cache()
    with torch.no_grad():
        full = net(tokens, neighbours)
        net.decode(tokens[:, :M], neighbours[:, :1], cache)
        late = neighbours[:, :2].clone()
        late[:, 0] = -1
        torch.testing.assert_close(net.decode(tokens[:, M:M + 1], late, cache), full[:, M], rtol=0, atol=2e-5)


def test_decode_past_n_positions_is_rejected():
    net = model(tiny(n_positions=2 * M))
    cache = net.new_cache()
    net.decode(torch.zeros(1, 2 * M, dtype=torch.int64), None, cache)
    with pytest.raises(ValueError, match="n_positions"):
        net.decode(torch.zeros(1, 1, dtype=torch.int64), None, cache)
