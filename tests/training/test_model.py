"""GPT-2 baseline: size, causality, layer-list form, loss, bf16, model directory round trip."""

import pytest
import torch

from retropipe.training.models.registry import build_model, layer_list
from retropipe.training.models.config import MODEL_PRESETS, ModelConfig
from retropipe.training.models.gpt2 import GPT2, loss_fn
from retropipe.training.models.io import ModelFormatError, load_model, save_model
from retropipe.training.models.layers import LayerStack


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=101, n_positions=64, n_layer=3, n_head=2, n_embd=32), **kw})


def test_gpt2_124m_has_the_released_parameter_count():
    cfg = ModelConfig.preset("gpt2-124m")
    with torch.device("meta"):  # counts without allocating or initialising 124M parameters
        model = GPT2(cfg)
    assert model.num_parameters() == 124_439_808
    assert "tiny" in MODEL_PRESETS


def test_logits_shape_and_causality():
    torch.manual_seed(0)
    model = GPT2(tiny()).eval()
    tokens = torch.randint(0, 101, (2, 20))
    logits = model(tokens)
    assert logits.shape == (2, 20, 101)
    t = 11
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % 101
    after = model(changed)
    torch.testing.assert_close(after[:, :t], logits[:, :t], rtol=0, atol=1e-6)
    assert (after[:, t:] - logits[:, t:]).abs().max() > 1e-4


def stages_of(model, descs, cut):
    """The layer list cut in two at `cut`, each part built alone and given the model's weights."""
    stages = [LayerStack(descs[:cut]).eval(), LayerStack(descs[cut:]).eval()]
    for stage in stages:
        missing, unexpected = stage.load_state_dict(model.state_dict(), strict=False)
        assert not missing, missing
    return stages


def test_the_model_is_its_layer_list():
    """The model's modules are the list's, under the list's names, and forward runs the list in
    order: the list cut anywhere into stages, each built alone, computes the same logits."""
    torch.manual_seed(0)
    cfg = tiny()
    model = GPT2(cfg).eval()
    descs = layer_list(cfg)
    assert [d.name for d in descs] == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "ln_f", "wte"]
    assert [d.tie_key for d in descs].count("embed") == 2 and all(d.cost > 0 for d in descs)
    assert all(isinstance(model.get_submodule(d.name), d.cls) for d in descs)
    assert {k.rsplit(".", 1)[0] for k in model.state_dict()} >= {"wte", "wpe", "ln_f"}
    tokens = torch.randint(0, 101, (2, 16))
    logits = model(tokens)
    for cut in range(1, len(descs)):
        first, second = stages_of(model, descs, cut)
        assert torch.equal(second(first(tokens)), logits), cut


def test_sequence_longer_than_positions_is_rejected():
    with pytest.raises(ValueError, match="n_positions"):
        GPT2(tiny())(torch.zeros(1, 65, dtype=torch.int64))


def test_loss_ignores_padding_and_an_all_padding_batch_gives_zero():
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[1, 3:] = -100
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(loss_fn(logits, labels), expected)
    assert loss_fn(logits, torch.full((2, 5), -100)).item() == 0.0


def test_bf16_forward_backward_on_cpu():
    torch.manual_seed(0)
    model = GPT2(tiny())
    tokens = torch.randint(0, 101, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = loss_fn(logits, tokens)
    assert logits.dtype == torch.bfloat16
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_save_and_load_model_round_trip(tmp_path):
    torch.manual_seed(0)
    model = GPT2(tiny()).eval()
    save_model(model, tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_model(tmp_path / "m")
    assert isinstance(loaded, GPT2) and not loaded.training and loaded.cfg == model.cfg
    tokens = torch.randint(0, 101, (1, 12))
    assert torch.equal(loaded(tokens), model(tokens))
    save_model(model, tmp_path / "m")  # replacing an existing directory works
    with pytest.raises(ModelFormatError, match="config.json"):
        load_model(tmp_path)


def test_fused_head_gives_the_plain_loss_and_gradients():
    """training/models/lm_head.py: the head + cross-entropy over slices of tokens equals logits-then-loss."""
    from retropipe.training.models.registry import build_model
    from retropipe.training.models.gpt2 import FusedLoss
    from retropipe.training.models.lm_head import lm_loss, token_nll

    torch.manual_seed(0)
    cfg = tiny()
    plain, fused = build_model(cfg), build_model(cfg, fused_head=True)
    fused.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 101, (3, 16))
    labels = torch.randint(0, 101, (3, 16))
    labels[0, :7] = -100  # padding is no target
    loss_p = loss_fn(plain(tokens), labels)
    loss_f = FusedLoss()(fused(tokens), labels)
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-6, atol=1e-6)
    loss_p.backward()
    loss_f.backward()
    grads_p, grads_f = dict(plain.named_parameters()), dict(fused.named_parameters())
    for name, p in grads_p.items():
        torch.testing.assert_close(grads_f[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # Slices that do not divide the tokens, a frozen head (no weight gradient), no target at all.
    h = torch.randn(2, 9, 32, requires_grad=True)
    w = torch.randn(101, 32)
    y = torch.randint(0, 101, (2, 9))
    torch.testing.assert_close(lm_loss(h, w, y, slice_tokens=4), loss_fn(h @ w.t(), y))
    assert lm_loss(h, w, torch.full_like(y, -100)).item() == 0.0
    y[1, 3] = -100
    nll = token_nll(h, w, y, slice_tokens=5)
    torch.testing.assert_close(nll, torch.nn.functional.cross_entropy((h @ w.t()).transpose(1, 2), y, reduction="none"))
    assert nll[1, 3] == 0.0
    # A target so unlikely that its softmax probability underflows fp32: the NLL is still exact.
    h_far = torch.zeros(1, 2, 2)
    h_far[0, :, 0] = 100.0
    w_far = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])
    y_far = torch.tensor([[2, 1]])                       # NLL 200 (probability e^-200) and 100
    torch.testing.assert_close(lm_loss(h_far, w_far, y_far), loss_fn(h_far @ w_far.t(), y_far))
    torch.testing.assert_close(token_nll(h_far, w_far, y_far), torch.tensor([[200.0, 100.0]]))
    # bf16: matmuls and the stored softmax in bf16, the loss in fp32 from each target's bf16
    # probability (within bf16's rounding, 2^-8 relative: 2^-8 nats per token, less on average),
    # gradients in the inputs' dtypes.
    hb, wb = h.detach().bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    lb = lm_loss(hb, wb, y, slice_tokens=4)
    lb.backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    hr, wr = hb.detach().float().requires_grad_(), wb.detach().float().requires_grad_()
    lr = loss_fn((hr @ wr.t()).bfloat16().float(), y)
    lr.backward()
    torch.testing.assert_close(lb, lr, rtol=0, atol=2 ** -9)
    per_token = torch.nn.functional.cross_entropy((hr @ wr.t()).bfloat16().float().transpose(1, 2), y, reduction="none")
    torch.testing.assert_close(token_nll(hb.detach(), wb.detach(), y, slice_tokens=4), per_token, rtol=0, atol=2 ** -8)
    torch.testing.assert_close(hb.grad.float(), hr.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(wb.grad.float(), wr.grad, rtol=2e-2, atol=2e-3)
    # Under autocast (fp32 inputs) the head's matmuls run in autocast's dtype, as `h @ Wᵀ` would.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        la = lm_loss(hr.detach(), wr.detach(), y, slice_tokens=4)
        lp = loss_fn((hr.detach() @ wr.detach().t()).float(), y)
    torch.testing.assert_close(la, lp, rtol=0, atol=2 ** -9)
    assert (la - loss_fn(hr.detach() @ wr.detach().t(), y)).abs() > 1e-6  # not fp32 matmuls


def test_kept_head_buffers_give_the_fresh_results_and_are_reused_on_the_cpu():
    """lm_head.SliceBuffers: a caller's buffers serve every later call (no new pages per
    micro-batch), grow for a longer slice, and change nothing: loss, gradients, per-token NLL."""
    from retropipe.training.models.lm_head import SliceBuffers, lm_loss, token_nll

    torch.manual_seed(0)
    w = torch.randn(101, 16, requires_grad=True)
    buffers = SliceBuffers()
    for tokens in (7, 7, 12, 5):                       # 12 > 7: grown once, then reused for 5
        h = torch.randn(tokens, 16, requires_grad=True)
        y = torch.randint(0, 101, (tokens,))
        kept = lm_loss(h, w, y, slice_tokens=8, buffers=buffers)
        gh, gw = torch.autograd.grad(kept, (h, w))
        fresh = lm_loss(h, w, y, slice_tokens=8)
        fh, fw = torch.autograd.grad(fresh, (h, w))
        assert kept.item() == fresh.item()
        assert torch.equal(gh, fh) and torch.equal(gw, fw)
        assert torch.equal(token_nll(h, w, y, slice_tokens=8, buffers=buffers), token_nll(h, w, y, slice_tokens=8))
        if tokens == 7:
            first = buffers.get(7, 101, torch.float32, torch.device("cpu"))[0].data_ptr()
    logits, probs = buffers.get(5, 101, torch.float32, torch.device("cpu"))
    assert logits.shape == probs.shape == (5, 101)
    assert logits.data_ptr() != first                  # grown to 8 rows for the 12-token call ...
    assert buffers.get(8, 101, torch.float32, torch.device("cpu"))[0].data_ptr() == logits.data_ptr()  # ... and kept
    assert buffers.get(8, 101, torch.bfloat16, torch.device("cpu"))[0].dtype == torch.bfloat16
    # No token at all: no slice writes W's gradient, which must then be zeros (not an unset buffer;
    # freed NaNs of its size first, for the allocator to hand back).
    none = torch.randn(0, 16, requires_grad=True)
    torch.full_like(w, float("nan"))                    # freed at once
    assert torch.equal(torch.autograd.grad(lm_loss(none, w, torch.zeros(0, dtype=torch.long), buffers=buffers), w)[0],
                       torch.zeros_like(w))


def test_tokens_without_a_target_never_reach_the_head_in_any_precision():
    """The head computes only the rows with a target (padding's logits would be computed for
    nothing): the loss and W's gradient are bit for bit those of the rows with a target alone, and
    h's gradient is theirs on those rows and exactly 0 on the others."""
    from retropipe.training.models.lm_head import lm_loss

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(2, 6, 16, dtype=dtype, requires_grad=True)
        w = torch.randn(37, 16, dtype=dtype, requires_grad=True)
        y = torch.randint(0, 37, (2, 6))
        y[0, 1:4] = -100
        loss = lm_loss(h, w, y, slice_tokens=4)
        (loss * (y != -100).sum()).backward()
        keep = y != -100
        assert (h.grad[~keep] == 0).all() and (h.grad[keep] != 0).all()
        h_kept = h.detach()[keep][None].requires_grad_()
        w_kept = w.detach().clone().requires_grad_()
        loss_kept = lm_loss(h_kept, w_kept, y[keep][None], slice_tokens=4)
        (loss_kept * keep.sum()).backward()
        assert torch.equal(loss, loss_kept)
        assert torch.equal(w.grad, w_kept.grad)
        assert torch.equal(h.grad[keep], h_kept.grad[0])


def test_the_head_padded_with_zero_rows_gives_the_same_loss_and_gradients(monkeypatch):
    """On a GPU the head's matrix gets zero rows up to a multiple of 64 (cuBLAS's fast kernels),
    their logits -inf; forced here on the CPU, to a multiple of 8."""
    import retropipe.training.models.lm_head as lm_head

    torch.manual_seed(0)
    h = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(13, 8, requires_grad=True)
    y = torch.randint(0, 13, (2, 5))
    y[0, 0] = -100
    results = []
    for pad in (False, True):
        if pad:
            monkeypatch.setattr(lm_head, "vocab_padding", lambda vocab, device: -vocab % 8)
        loss = lm_head.lm_loss(h, w, y, slice_tokens=4)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad, lm_head.token_nll(h.detach(), w.detach(), y, slice_tokens=3)))
        h.grad = w.grad = None
    for plain, padded in zip(*results):
        torch.testing.assert_close(padded, plain)
    assert results[1][2].shape == w.shape


def test_the_heads_gradient_of_the_matrix_is_a_whole_tensor_not_a_view():
    """Unpadded, the head hands autograd W's gradient as a tensor of its own: autograd then adds a
    second use's gradient of the tied matrix (the lookup's) into it in place, where into a view it
    would allocate a third (V, d) tensor per backward (docs/benchmarks.md)."""
    import torch.nn.functional as F

    from retropipe.training.models.lm_head import lm_loss

    torch.manual_seed(0)
    h, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(13, 8, requires_grad=True)
    y = torch.randint(0, 13, (2, 5))
    g = torch.autograd.grad(lm_loss(h, w, y, slice_tokens=4), w)[0]
    assert g._base is None and g.shape == w.shape
    plain = w.detach().clone().requires_grad_()
    expected = torch.autograd.grad(F.cross_entropy((h.detach() @ plain.t()).flatten(0, 1), y.flatten()), plain)[0]
    torch.testing.assert_close(g, expected)


def test_the_lookups_gradient_is_added_in_place_and_equals_the_embeddings():
    """model.lookup: over accumulated micro-batches its weight gradient equals F.embedding's, the
    first micro-batch hands autograd a dense gradient and later ones a sparse one that is added in
    place (so .grad stays the same dense tensor and hooks on accumulation still fire)."""
    import torch.nn.functional as F

    from retropipe.training.models.gpt2 import lookup

    torch.manual_seed(0)
    ids = [torch.randint(0, 101, (3, 16)) for _ in range(3)]
    ids[1][0, :4] = 7                                    # a row looked up several times
    plain = torch.randn(101, 32, dtype=torch.float64, requires_grad=True)
    mine = plain.detach().clone().requires_grad_()
    arriving, accumulated = [], []
    mine.register_hook(lambda g: arriving.append(g.is_sparse))
    mine.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.data_ptr()))
    for x in ids:
        up = torch.randn(3, 16, 32, dtype=torch.float64)
        (F.embedding(x, plain) * up).sum().backward()
        (lookup(mine, x) * up).sum().backward()
    assert arriving == [False, True, True]
    assert not mine.grad.is_sparse and len(set(accumulated)) == 1 and len(accumulated) == 3
    torch.testing.assert_close(mine.grad, plain.grad)
    # Tied use (GPT-2: the head reads the same weight): one backward, the sum of both gradients.
    cfg = tiny()
    model, ref = GPT2(cfg), GPT2(cfg)
    ref.load_state_dict(model.state_dict())
    for x in ids:
        loss_fn(model(x), x).backward()
        logits = F.linear(ref.ln_f(ref.blocks[2](ref.blocks[1](ref.blocks[0](
            ref.wpe(F.embedding(x, ref.wte.weight)))))), ref.wte.weight)
        loss_fn(logits, x).backward()
    torch.testing.assert_close(model.wte.weight.grad, ref.wte.weight.grad, rtol=1e-5, atol=1e-7)
    # int32 ids (F.embedding takes them) work on every micro-batch, not only the dense first one.
    narrow = plain.detach().clone().requires_grad_()
    for x in ids[:2]:
        lookup(narrow, x.int()).sum().backward()
    torch.testing.assert_close(narrow.grad, sum(F.embedding(x, plain).new_zeros(101, 32).index_add_(
        0, x.reshape(-1), torch.ones(48, 32, dtype=torch.float64)) for x in ids[:2]))
    # Frozen weight or no grad: a plain lookup, no gradient.
    frozen = torch.randn(101, 32)
    assert lookup(frozen, ids[0]).grad_fn is None
    with torch.no_grad():
        assert lookup(mine, ids[0]).grad_fn is None


def test_the_token_embedding_starts_at_the_configured_std_in_every_form():
    """model.embedding_init_std: the monolithic model and the layer list (what a pipeline stage
    builds) start the tied embedding alike; the tiny configs take 0.1; ≤ 0 is refused."""
    from retropipe.data.errors import ConfigError
    from retropipe.launch.config import load_config

    torch.manual_seed(0)
    for std in (0.02, 0.1):
        cfg = tiny(embedding_init_std=std, vocab_size=4000)
        for model in (GPT2(cfg), build_model(cfg)):
            assert abs(model.wte.weight.std().item() - std) < 0.05 * std
        assert abs(GPT2(cfg).blocks[0].attn.c_attn.weight.std().item() - 0.02) < 0.002  # the rest: GPT-2's
    assert load_config("configs/tiny.yaml", []).model.embedding_init_std == 0.1
    assert ModelConfig().embedding_init_std == 0.02
    with pytest.raises(ConfigError, match="model.embedding_init_std"):
        tiny(embedding_init_std=0.0)


def test_decode_with_the_cache_gives_the_forward_logits():
    torch.manual_seed(0)
    model = GPT2(tiny()).eval()
    tokens = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        full = model(tokens)
        for steps in ([1] * 20, [7] + [1] * 13, [5, 6, 9]):   # one token at a time, a prompt, pieces
            cache, start = model.new_cache(), 0
            for size in steps:
                got = model.decode(tokens[:, start:start + size], None, cache)
                start += size
                torch.testing.assert_close(got, full[:, start - 1], rtol=0, atol=1e-5)
        # Rows dropped from the batch (a finished sample) leave the others' cache intact.
        cache = model.new_cache()
        model.decode(tokens[:, :10], None, cache)
        cache.select(torch.tensor([1]))
        torch.testing.assert_close(model.decode(tokens[1:, 10:11], None, cache), full[1:, 10], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="n_positions"):
        model.decode(torch.zeros(1, 65, dtype=torch.int64), None, model.new_cache())
