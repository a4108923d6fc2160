"""RETRO's attention parts: rotary positions, the explicit bf16 attention, the CCA's logit term
(position bias, copy gate, null slot) and its gradients."""

import pytest
import torch

from retropipe.training.models.rotary_attention import Positions
from retropipe.training.models.config import ModelConfig

M = 4  # chunk_len


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(kind="retro", vocab_size=101, n_positions=64, n_layer=4, n_head=2, n_embd=32,
                                 encoder_layers=2, encoder_embd=16, encoder_head=2, chunk_len=M), **kw})


def test_the_copy_gate_marks_where_a_neighbour_matches_the_text_just_read():
    """The bonus sits on neighbour token j when token j - 1 is the query's current token (so j may
    be the next one), more when token j - 2 is also the one before it, never on padding; the null
    slot adds nothing, so a chunk whose neighbour never matches can read (almost) nothing from it."""
    from retropipe.training.models.cca import BIGRAM_INIT, MATCH_INIT, NULL_INIT, ChunkedCrossAttention

    cca = ChunkedCrossAttention(tiny(copy_gate=True))
    neighbours = torch.tensor([[[5, 6, 7, 8, 9, -1, -1, -1]]])                 # (B=1, k=1, r=8)
    current = torch.tensor([[[6, 5], [9, 1], [-1, -1], [3, 9], [5, -1]]])     # (B=1, t=5, 2): token, the one before
    expected = torch.zeros(5, 8, dtype=torch.int64)                          # (t, k r)
    expected[0, 2] = 2                                                        # after 5, 6: a bigram
    expected[1, 5] = 1                                                        # after the 9 alone
    expected[4, 1] = 1                                                        # after the 5; nothing before it
    match, bigram = cca.matches(neighbours, current)[0]
    assert torch.equal(match.long() + bigram.long(), expected)
    valid = neighbours.flatten(1) >= 0
    logits = cca.logit_bias(Positions(M - 1, M + 4), Positions(0, 8), valid, neighbours, current, torch.float32)
    bonus = torch.tensor([0.0, MATCH_INIT, MATCH_INIT + BIGRAM_INIT])[expected].masked_fill(~valid, float("-inf"))
    torch.testing.assert_close(logits[0, 0, :, 1:], bonus)                    # the position bias starts at 0
    torch.testing.assert_close(logits[0, :, :, 0], torch.full((2, 5), NULL_INIT))   # the null slot, every head
    # Attention's null slot: with its logit far above the rest, the output is the projection's bias.
    with torch.no_grad():
        cca.null_bias.fill_(1e4)
    q = torch.randn(1, 5, 32)
    out = cca.attend(q, torch.randn(1, 1, 8, 16), neighbours, Positions(0, 5), current)
    torch.testing.assert_close(out, cca.attn.proj.bias.expand(1, 5, 32))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "float per head"])
def test_attention_in_bf16_training_on_cpu_is_sdpas_function(mask_kind):
    """The explicit attention (bf16 with gradients on a CPU) computes what fp32 SDPA does, output
    and gradients within bf16 rounding; a masked key's value changes nothing; a float mask gets
    its gradient."""
    from retropipe.training.models.gpt2 import attention

    torch.manual_seed(0)
    t = 7 if mask_kind == "causal" else 5
    q, k, v = (torch.randn(3, 2, n, 16) for n in (t, 7, 7))
    mask = {"none": None, "bool": torch.rand(3, 1, 5, 7) > 0.4, "float": torch.randn(3, 2, 5, 7), "causal": None,
            "float per head": torch.randn(1, 2, 5, 7, requires_grad=True)}[mask_kind]
    if mask_kind == "bool":
        mask[..., 0], mask[..., 1] = True, False                 # every row keeps a key (key_mask); key 1 is out
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        m = mask if mask is None or mask_kind == "bool" else mask.to(dtype)
        y = attention(*leaves, m, is_causal=mask_kind == "causal")
        (y.float() * torch.linspace(-1, 1, 16)).sum().backward()
        results.append([y.float(), *(x.grad.float() for x in leaves)])
        if mask_kind == "float per head":
            results[-1].append(mask.grad.clone())
            mask.grad = None
    for ours, reference in zip(*reversed(results)):
        torch.testing.assert_close(ours, reference, atol=0.05, rtol=0.05)
    if mask_kind == "bool":
        leaves = [x.detach().bfloat16().requires_grad_() for x in (q, k, v + 100 * (torch.arange(7) == 1)[:, None])]
        assert torch.equal(attention(*leaves, mask).float(), results[1][0])


def test_rotary_rotates_each_heads_halves_and_is_relative():
    """rotary on (B, t, heads·c) equals RoFormer's rotate-half per head, written out, in value and
    gradient (to the fp32 angles' rounding); and a rotated q·k depends on the positions only through their difference."""
    from retropipe.training.models.rotary_attention import rotary

    torch.manual_seed(0)
    heads, c, t = 3, 8, 6
    x = torch.randn(2, t, heads * c, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(t) * 3 + 1

    def reference(x):
        x4 = x.unflatten(-1, (heads, c))                                        # (B, t, h, c)
        angles = pos[:, None, None].double() * 10.0 ** (-torch.arange(0, c, 2).double() / c)   # (t, 1, c/2)
        x1, x2 = x4.chunk(2, -1)
        return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], -1).flatten(-2)

    y = rotary(x, pos, 10.0, heads)
    grad = torch.randn_like(y)
    close = dict(atol=1e-6, rtol=1e-5)                                          # the angles are fp32
    torch.testing.assert_close(y, reference(x), **close)
    torch.testing.assert_close(torch.autograd.grad(y, x, grad)[0], torch.autograd.grad(reference(x), x, grad)[0],
                               **close)
    q, k = torch.randn(2, 1, c, dtype=torch.float64)
    dots = [(rotary(q, torch.tensor([p]), 10.0) * rotary(k, torch.tensor([p + 2]), 10.0)).sum() for p in (0, 5, 11)]
    torch.testing.assert_close(dots[0], dots[1], **close)
    torch.testing.assert_close(dots[0], dots[2], **close)
    assert not torch.allclose(dots[0], (rotary(q, torch.tensor([0]), 10.0) * rotary(k, torch.tensor([3]), 10.0)).sum())


def test_attention_keeps_its_rotary_tables_and_they_train_after_inference():
    """The tables an Attention keeps per positions are the ones rotary builds each call; kept while
    generating (inference mode), they still serve a training step (saved for backward); a module
    keeps a bounded number of them, and lets them go when it moves to another dtype or device."""
    from retropipe.training.models.rotary_attention import CONSTANTS_KEPT, Attention, rotary

    torch.manual_seed(0)
    attn = Attention(16, 24, 16, 2, 0.0, 10.0)
    x, context = torch.randn(3, 5, 16), torch.randn(3, 7, 24)
    q_pos, k_pos = Positions(4, 9), Positions(0, 7)
    with torch.inference_mode():
        attn(x, context, q_pos, k_pos)
    assert len(attn.constants) == 2

    def reference(x):
        k, v = attn.kv(context).chunk(2, dim=-1)
        q, k = rotary(attn.q(x), q_pos.tensor("cpu"), 10.0, 2), rotary(k, k_pos.tensor("cpu"), 10.0, 2)
        q, k, v = (z.unflatten(-1, (2, 8)).transpose(1, 2) for z in (q, k, v))
        return attn.proj((torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v).transpose(1, 2).flatten(2))

    x.requires_grad_(True)
    y = attn(x, context, q_pos, k_pos)
    torch.testing.assert_close(y, reference(x))
    grad = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, grad)[0], torch.autograd.grad(reference(x), x, grad)[0])
    attn.to(torch.float64)(x.double(), context.double(), q_pos, k_pos)
    assert len(attn.constants) == 2                   # moved to float64: the float32 tables let go
    for start in range(2 * CONSTANTS_KEPT):
        attn(x.double(), context.double(), Positions(start, start + 5), k_pos)
    assert len(attn.constants) <= CONSTANTS_KEPT


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_ccas_logit_term_and_its_gradients_are_the_broadcast_sums(dtype):
    """The CCA's additive logits (one batched product and the keys' mask) equal the broadcast sum
    of the position bias, the copy gate's bonuses and the null slot's logit, -inf at missing keys,
    and give every parameter the gradient autograd gives that sum."""
    from retropipe.training.models.cca import ChunkedCrossAttention

    torch.manual_seed(0)
    cca = ChunkedCrossAttention(tiny(copy_gate=True)).to(dtype)
    with torch.no_grad():
        for p in (cca.position_bias, cca.match_bias, cca.bigram_bias, cca.null_bias):
            p.normal_(0, 0.01)
    neighbours = torch.randint(0, 4, (3, 2, 2 * M))
    neighbours[0, 1, M:] = -1
    current = torch.randint(0, 4, (3, M, 2))
    q_pos, k_pos = Positions(M - 1, 2 * M - 1), Positions(0, 2 * M, 2)
    valid = neighbours.flatten(1) >= 0
    params = [cca.position_bias, cca.match_bias, cca.bigram_bias, cca.null_bias]

    def reference():
        match, bigram = cca.matches(neighbours, current)[:, :, None].unbind(1)             # (B, 1, t, k r) each
        qt, kt = q_pos.tensor("cpu"), k_pos.tensor("cpu")
        position = cca.position_bias_scale * cca.position_bias[:, kt[None, :] - qt[:, None] + 2 * M - 2]
        bonus = cca.match_bias[:, None, None] * match + cca.bigram_bias[:, None, None] * bigram
        body = (position + cca.gate_scale * bonus).masked_fill(~valid[:, None, None], float("-inf"))
        null = (cca.gate_scale * cca.null_bias)[None, :, None, None].expand(3, -1, M, 1)
        return torch.cat([null, body], -1)

    ours, expected = cca.logit_bias(q_pos, k_pos, valid, neighbours, current, dtype), reference()
    close = dict(atol=0.05, rtol=0.02) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(ours, expected, **close)
    grad = torch.randn(ours.shape, dtype=dtype).masked_fill(ours.isinf(), 0)    # softmax sends none to -inf
    for got, want in zip(torch.autograd.grad(ours, params, grad), torch.autograd.grad(expected, params, grad)):
        torch.testing.assert_close(got, want, **close)
