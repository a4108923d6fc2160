"""The plain parts of training (no DeepSpeed, no subprocesses): RNG state, FLOPs, seeded layers,
parameter groups, the metrics log."""

import copy
import io
import json
import random

import numpy as np
import pytest
import torch

from retropipe.training.models.registry import build_model, layer_list
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.flops import flops_per_token, mfu, step_flops_per_token
from retropipe.training.models.layers import seeded
from retropipe.training.run.rng import rng_state, set_rng_state

SHAPE = dict(n_head=2, n_embd=32, n_positions=64, encoder_layers=1, encoder_embd=16, encoder_head=2, chunk_len=16)


def draws():
    return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist(), np.random.randn()


def test_rng_state_round_trips_through_a_weights_only_file():
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state, which must survive too
    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    expected = draws()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    assert draws() != expected
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True))
    assert draws() == expected


def test_flops_per_token_equals_a_hand_count():
    d, layers, vocab, t = 32, 2, 50257, 64
    cfg = ModelConfig(kind="gpt2", n_layer=layers, **SHAPE)
    # Per block: ln_1 and ln_2 (2d each), c_attn (3d² + 3d), attn c_proj (d² + d), c_fc (4d² + 4d),
    # mlp c_proj (4d² + d) = 12d² + 13d. Plus the tied embedding (counted once) and ln_f; the
    # position embedding is a lookup and is left out.
    n = vocab * d + layers * (12 * d * d + 13 * d) + 2 * d
    assert flops_per_token(cfg, t) == 6 * n + 12 * layers * d * t
    # GPT-2 small, nanoGPT's figure: 6 · 123,653,376 + 12 · 12 · 768 · 1024.
    assert flops_per_token(ModelConfig.preset("gpt2-124m"), 1024) == 855_166_464
    assert mfu(1e6, 2e3, 4e9) == 0.5
    # A batch of which a quarter has no target: the fused head does 6·V·d less for each such token.
    full = flops_per_token(cfg, t)
    assert step_flops_per_token(full, cfg, 0.75, fused_head=True) == full - 0.25 * 6 * vocab * d
    assert step_flops_per_token(full, cfg, 0.75, fused_head=False) == full == step_flops_per_token(full, cfg, 1.0, True)


def test_flops_of_retro_count_its_retrieval_parameters():
    gpt2, retro = (flops_per_token(ModelConfig(kind=k, n_layer=4, **SHAPE), 64) for k in ("gpt2", "retro"))
    assert retro > gpt2


def test_seeded_layers_do_not_depend_on_what_else_is_built():
    cfg = ModelConfig(kind="retro", n_layer=4, **SHAPE)
    model = build_model(cfg, layer_seed=5)
    again = build_model(cfg, layer_seed=5)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    # A pipeline stage builds only its own layers, each under seed + its index: the same weights.
    descs = layer_list(cfg)
    assert [d.name for d in descs[:4]] == ["wte", "wpe", "blocks.0", "blocks.1"]
    for i in (1, 2, 3):  # wpe, a Block, the first RetroBlock (with the encoder)
        torch.manual_seed(123)  # whatever the global state: the layer's seed decides
        with seeded(5 + i):
            alone = descs[i].build()
        for pname, p in alone.state_dict().items():
            assert torch.equal(p, model.state_dict()[f"{descs[i].name}.{pname}"]), (descs[i].name, pname)
    other = build_model(cfg, layer_seed=6).state_dict()
    assert not torch.equal(other["wpe.weight"], model.state_dict()["wpe.weight"])
    # build_model without a layer seed runs the same list: same names, same outputs for the same weights.
    plain = build_model(cfg)
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 100, (1, 64))
    assert torch.equal(plain(tokens), model(tokens))


def test_seeded_leaves_the_global_generator_alone():
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    with seeded(42):
        torch.rand(5)
    assert torch.equal(torch.rand(2), expected)


def test_weight_decay_applies_exactly_to_the_matrices_but_the_position_bias():
    from retropipe.training.pipeline.param_groups import GROUPS, parameter_groups

    model = build_model(ModelConfig(kind="retro", n_layer=4, **SHAPE))
    groups = parameter_groups(model, weight_decay=0.1)
    assert [g["name"] for g in groups] == list(GROUPS) == ["decay", "no_decay"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decay, no_decay = ({id(p) for p in g["params"]} for g in groups)
    named = dict(model.named_parameters())
    matrix = {n for n, p in named.items() if p.dim() >= 2 and not n.endswith("position_bias")}
    assert decay == {id(named[n]) for n in matrix}
    assert no_decay == {id(p) for n, p in named.items() if n not in matrix}
    assert {"wte.weight", "wpe.weight", "blocks.0.attn.c_attn.weight"} <= \
        {n for n, p in named.items() if id(p) in decay}
    assert {"blocks.0.ln_1.weight", "blocks.0.ln_1.bias", "ln_f.weight", "blocks.1.cca.attn.q.bias",
            "blocks.1.cca.position_bias", "blocks.3.cca.position_bias"} <= \
        {n for n, p in named.items() if id(p) in no_decay}
    # One AdamW step on zero gradients moves nothing but the decoupled decay: exactly the matrices shrink.
    before = {n: p.detach().clone() for n, p in named.items()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.optim.AdamW(groups, lr=0.5, betas=(0.9, 0.95)).step()
    for n, p in named.items():
        expected = before[n] * (1 - 0.5 * 0.1) if n in matrix else before[n]
        assert torch.equal(p.detach(), expected), n


def test_every_stage_gets_both_groups_even_without_a_vector():
    from retropipe.training.models.layers import LayerStack
    from retropipe.training.pipeline.param_groups import parameter_groups
    from retropipe.training.pipeline.partition import partition

    cfg = ModelConfig(kind="gpt2", n_layer=2, **SHAPE)
    descs = layer_list(cfg)
    parts = partition(descs, 2, "parameters")  # the embeddings outweigh the trunk: stage 0 = wte, wpe
    assert parts == [0, 2, 6]
    stage0 = LayerStack(descs[:2])
    groups = parameter_groups(stage0, weight_decay=0.1)
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    (placeholder,) = groups[1]["params"]  # no vector on this stage: a placeholder keeps the group
    assert dict(stage0.named_parameters())["empty_no_decay_group"] is placeholder
    assert placeholder.requires_grad and placeholder.numel() == 1 and float(placeholder.detach()) == 0.0
    assert len(groups[0]["params"]) == 2  # wte, wpe
    stage1 = LayerStack(descs[2:])
    assert all(len(g["params"]) > 1 for g in parameter_groups(stage1, 0.1))  # no placeholder needed
    assert not [n for n, _ in stage1.named_parameters() if n.startswith("empty_")]


def test_a_frozen_trunk_leaves_only_retrieval_parameters_in_the_groups():
    from retropipe.training.models.retro import is_retrieval_parameter
    from retropipe.training.pipeline.param_groups import parameter_groups

    model = build_model(ModelConfig(kind="retro", n_layer=4, freeze_trunk=True, **SHAPE))
    grouped = {id(p) for g in parameter_groups(model, 0.1) for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in grouped) == is_retrieval_parameter(name), name


def test_the_config_reaches_tensorboard_as_hyperparameters(tmp_path):
    import yaml

    from retropipe.training.run.metrics_log import MetricsLog, hparams_of
    from tests.distributed import read_tensorboard

    cfg = {"workdir": "/w", "train": {"lr": 0.02, "name": "", "fused_head": True, "deepspeed": {"a": 1}},
           "model": {"retro_layers": [2, 4], "n_layer": 4}}
    assert hparams_of(cfg) == {"workdir": "/w", "train.lr": 0.02, "train.name": "", "train.fused_head": True,
                               "train.deepspeed": '{"a": 1}', "model.retro_layers": "[2, 4]", "model.n_layer": 4}
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    log = MetricsLog(tmp_path, 1, cfg)  # a resume from step 1: step 2 is logged again
    log.write({"step": 2, "loss": 7.5, "grad_norm": None})
    log.close()
    assert [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [9.0, 7.5]
    hparams, text, scalars = read_tensorboard(tmp_path / "tensorboard")
    assert hparams["train.lr"] == pytest.approx(0.02) and hparams["model.n_layer"] == 4
    assert hparams["train.fused_head"] == 1 and hparams["model.retro_layers"] == "[2, 4]"  # bools as numbers
    assert yaml.safe_load("\n".join(line[4:] for line in text.splitlines())) == cfg
    assert scalars == {"loss": [(2, 7.5)]}


def _stage(specs):
    """The layers DeepSpeed specs build, each with how a PipelineModule stage calls it."""
    built = [(spec.build(), getattr(spec, "forward_fn", None)) for spec in specs]
    return built, lambda x: _run(built, x)


def _run(built, x):
    for module, fn in built:
        x = fn(module, x) if fn is not None else module(x)
    return x


def test_a_stage_boundary_carries_retros_tuple_as_one_tensor_so_backward_runs_once():
    """DeepSpeed runs a stage's backward once per float tensor it sent on. RETRO's (h, ids,
    encoded) share the layers below the first CCA layer: sent as two tensors those layers ran
    backward twice; packed (training.pipeline.stage_boundary), once, with the same gradients."""
    from retropipe.training.pipeline.deepspeed_engine import layer_specs
    from retropipe.training.pipeline.stage_boundary import pack_boundary, unpack_boundary

    cfg = ModelConfig(kind="retro", n_layer=4, n_head=2, n_embd=32, n_positions=64, chunk_len=16,
                      encoder_layers=1, encoder_embd=16, encoder_head=2, retro_layers=[2, 4])
    descs = layer_list(cfg)
    cut = [d.name for d in descs].index("blocks.2")               # after the first CCA layer (blocks.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    nbrs = torch.randint(0, cfg.vocab_size, (2, 4, 2, 32))

    def backward_runs(specs):
        """How often blocks.0's weight got a gradient when backward runs as DeepSpeed runs it."""
        built, stage = _stage(specs)
        out = stage((tokens, nbrs))
        calls = []
        built[2][0].mlp.c_fc.weight.register_hook(lambda g: calls.append(g.clone()))   # blocks.0
        floats = [t for t in out if t.is_floating_point()]
        for i, t in enumerate(floats):
            t.backward(torch.ones_like(t), retain_graph=i < len(floats) - 1)
        return out, len(calls), sum(calls)

    plain, n_plain, g_plain = backward_runs(layer_specs(descs, 0)[:cut])
    packed, n_packed, g_packed = backward_runs(layer_specs(descs, 0, [0, cut, len(descs)], cfg)[:cut])
    assert len(plain) == 4 and len(packed) == 3 and packed[0].shape == (2, 64 * 32 + 4 * 2 * 32 * 16)
    assert (n_plain, n_packed) == (2, 1)
    torch.testing.assert_close(g_packed, g_plain)
    h, ids, encoded, tokens_ = unpack_boundary(packed, n_embd=32, chunk_len=16)   # what the next stage sees
    assert torch.equal(h, plain[0]) and torch.equal(ids, plain[1]) and torch.equal(encoded, plain[2])
    assert torch.equal(tokens_, tokens)
    assert pack_boundary(h) is h                                          # a lone h passes as it is
    first_input = (tokens, nbrs)
    assert unpack_boundary(first_input, n_embd=32, chunk_len=16) is first_input       # a stage's input too


def test_three_stages_with_packed_cuts_give_the_sequential_models_loss_and_gradients():
    """Stage by stage, as the pipeline runs them (tensors detached between stages, each stage's
    backward once per float it sent, as DeepSpeed does): a one-layer middle stage both unpacks
    and packs; loss and every gradient equal the sequential model's."""
    from retropipe.training.models.gpt2 import loss_fn
    from retropipe.training.pipeline.deepspeed_engine import layer_specs

    cfg = ModelConfig(kind="retro", n_layer=4, n_head=2, n_embd=32, n_positions=64, chunk_len=16,
                      encoder_layers=1, encoder_embd=16, encoder_head=2, retro_layers=[2, 4])
    descs = layer_list(cfg)
    names = [d.name for d in descs]
    parts = [0, names.index("blocks.2"), names.index("blocks.3"), len(descs)]   # blocks.2 alone
    specs = layer_specs(descs, 7, parts, cfg)
    tied, modules = {}, []
    for spec in specs:  # a tied module is built once and shared, as DeepSpeed keeps it in sync
        key = getattr(spec, "key", None)
        module = tied.setdefault(key, spec.build()) if key else spec.build()
        modules.append((module, getattr(spec, "forward_fn", None)))
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    nbrs = torch.randint(0, cfg.vocab_size, (2, 4, 2, 32))
    labels = torch.randint(0, cfg.vocab_size, (2, 64))

    x, stages = (tokens, nbrs), []
    for lo, hi in zip(parts, parts[1:]):
        out = _run(modules[lo:hi], x)
        outs = out if isinstance(out, tuple) else (out,)
        received = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outs)  # the next stage's
        stages.append((outs, received))
        x = received if len(received) > 1 else received[0]
    loss = loss_fn(out, labels)
    loss.backward()
    for outs, received in reversed(stages[:-1]):
        floats = [(t, r.grad) for t, r in zip(outs, received) if t.is_floating_point()]
        assert len(floats) == 1                                        # one tensor across every cut
        for i, (t, g) in enumerate(floats):
            t.backward(g, retain_graph=i < len(floats) - 1)

    seq = build_model(cfg, layer_seed=7)
    seq_loss = loss_fn(seq(tokens, nbrs), labels)
    seq_loss.backward()
    torch.testing.assert_close(loss, seq_loss)
    seen = set()
    for (module, _), name in zip(modules, names):
        if name in seen:
            continue
        seen.add(name)
        for (pname, p), q in zip(module.named_parameters(), seq.get_submodule(name).parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"{name}.{pname}")


def test_a_resumed_optimizer_takes_this_runs_settings_and_the_fused_step_runs():
    """A checkpoint saved by the per-tensor AdamW, loaded into a fused one: torch restores the
    saved groups (fused=None, other decay and betas); restore_group_settings puts this run's back,
    and the fused step then makes the per-tensor step's update."""
    from retropipe.training.pipeline.param_groups import restore_group_settings

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 4))
    old = torch.optim.AdamW([{"params": [w], "name": "decay", "weight_decay": 0.5}], lr=0.1, betas=(0.8, 0.9))
    w.grad = torch.randn(8, 4)
    old.step()
    saved = old.state_dict()

    def resumed(fused):
        p = torch.nn.Parameter(w.detach().clone())
        opt = torch.optim.AdamW([{"params": [p], "name": "decay", "weight_decay": 0.1}], lr=0.1,
                                betas=(0.9, 0.95), fused=fused)
        opt.load_state_dict(copy.deepcopy(saved))  # torch keeps the state's tensors: a file's, not shared
        assert opt.param_groups[0]["weight_decay"] == 0.5 and opt.param_groups[0]["fused"] is None
        restore_group_settings(opt, 0.1, (0.9, 0.95), fused)
        group = opt.param_groups[0]
        assert (group["weight_decay"], group["betas"], group["fused"]) == (0.1, (0.9, 0.95), fused)
        p.grad = torch.ones(8, 4)
        opt.step()
        return p.detach()

    torch.testing.assert_close(resumed(True), resumed(False))


def test_a_scheduler_signal_asks_to_stop_and_the_deadline_exits_75(tmp_path):
    """SIGUSR1 (Slurm's --signal) or SIGTERM marks a stop at the step's end; whatever happens after,
    the process exits PREEMPTED once train.preempt_grace has passed, naming where to resume."""
    import os
    import signal
    import threading

    from retropipe.training.run.preemption import PREEMPTED, Preemption

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    exited, lines = threading.Event(), []
    codes = []
    preemption = Preemption(0.5, lambda: "step 7", log=lines.append,
                            exit_fn=lambda code: (codes.append(code), exited.set()))
    try:
        preemption.install()
        assert not preemption.requested and not preemption.agreed("cpu")
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested and preemption.signal_name == "SIGUSR1" and preemption.agreed("cpu")
        assert not codes  # the deadline has not passed yet
        assert exited.wait(5) and codes == [PREEMPTED] == [75]
        assert "train.preempt_grace (0.5 s); rerun the same command to resume from step 7" in lines[0]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_file_another_node_writes_is_seen_once_it_appears_within_the_wait(tmp_path):
    """A network filesystem may answer "no such file" from its cache: the check waits for it."""
    import threading

    from retropipe.training.run.cluster import sees_file

    marker = tmp_path / "run" / ".shared-x"
    assert not sees_file(marker, 0.2)
    threading.Timer(0.5, lambda: (marker.parent.mkdir(), marker.write_text("node0"))).start()
    assert sees_file(marker, 5)


@pytest.mark.parametrize("timeout", [10, 60, 300, 600, 1800])
def test_collectives_time_out_only_after_the_watchdog_names_a_lost_rank(timeout):
    """NCCL aborts the process when a collective times out: the watchdog must get there first. A
    healthy wait lasts under train.dist_timeout, so a peer lost while this rank waits is named at
    most a timeout of silence and a beat after a wait that had lasted under a timeout."""
    from retropipe.training.run.cluster import collective_timeout, interval_for

    named_by = timeout + timeout + interval_for(timeout)
    assert named_by < collective_timeout(timeout) < 3 * timeout + 30
