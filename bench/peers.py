"""RetroPipe's GPT-2 and RETRO against the implementations a user would otherwise pick, side by side.

    python bench/peers.py [--shapes tiny,12x384] [--precisions fp32,bf16] [--rounds 3] [--steps 6]

Peers: lucidrains' retro-pytorch 0.3.9 (RETRO) and Hugging Face transformers' GPT2LMHeadModel
(GPT-2). retro-pytorch is fetched from the package index on first use (`pip download --no-deps`
into runs/peers/); its model module alone is loaded: the retrieval module it imports a constant
from needs autofaiss, which a training step does not use (and which would pin an older numpy).

Each measurement is a fresh process (its peak resident memory is its own) running `--steps`
training steps (forward, loss, backward, AdamW) on the same seeded batches after one warm-up step,
one thread per core. Rounds alternate every model and precision, and each round's ratios are
taken within the round (a noisy machine slows a round, not one side). bf16 runs under
torch.autocast for every model. Configured as the same model as far as each allows; what
differs is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_DIR = ROOT / "runs" / "peers"
RETRO_PYTORCH = "retro-pytorch==0.3.9"

# (layers, width, heads, encoder width, encoder heads, CCA layers 1-indexed, batch); seq 256, chunk 64, k 2
SHAPES = {"tiny": (4, 128, 4, 64, 2, (2, 4), 16), "12x384": (12, 384, 6, 384, 6, (6, 9, 12), 4)}
SEQ, CHUNK, K, VOCAB = 256, 64, 2, 50257
MODELS = ("retropipe-retro", "retro-pytorch", "retropipe-gpt2", "hf-gpt2")
DIFFERENCES = """\
Differences between the models compared (same layers, width, heads, sequence, chunk, k, vocabulary):
- retro-pytorch: RMSNorm (RetroPipe: LayerNorm); rotary positions in the decoder's self-attention
  besides absolute embeddings (RetroPipe: learned absolute, GPT-2's); an untied output head
  (RetroPipe: the tied embedding, fused with the loss); token embeddings as wide as its encoder
  (tiny: 128, RetroPipe's encoder 64 wide); its CCA attends per neighbour; no relative-position
  bias; pad id 0 masked (RetroPipe: -1).
- HF GPT2LMHeadModel: the same function as RetroPipe's GPT-2 (tests/training/test_hf_interop.py);
  its loss from the full logits (RetroPipe: the fused head); SDPA attention in both."""


def retro_pytorch_class():
    """retro-pytorch's RETRO class, from its wheel (downloaded once), without its package __init__."""
    wheel = next(PEER_DIR.glob("retro_pytorch-*.whl"), None)
    if wheel is None:
        PEER_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", RETRO_PYTORCH, "-d",
                        str(PEER_DIR)], check=True)
        wheel = next(PEER_DIR.glob("retro_pytorch-*.whl"))
    unpacked = PEER_DIR / wheel.stem
    if not unpacked.exists():
        zipfile.ZipFile(wheel).extractall(unpacked)
    package = types.ModuleType("retro_pytorch")
    package.__path__ = [str(unpacked / "retro_pytorch")]
    retrieval = types.ModuleType("retro_pytorch.retrieval")
    retrieval.BERT_VOCAB_SIZE = 28996  # the one name the model module takes from it
    sys.modules.update({"retro_pytorch": package, "retro_pytorch.retrieval": retrieval})
    from retro_pytorch.retro_pytorch import RETRO

    return RETRO


def build(model: str, shape: str):
    """(module, step function computing the loss from (tokens (b, n+1), neighbours (b, l, k, r)))."""
    layers, width, heads, enc_width, enc_heads, cca, _ = SHAPES[shape]
    if model.startswith("retropipe"):
        from retropipe.training.models.registry import build_model
        from retropipe.training.models.config import ModelConfig
        from retropipe.training.models.lm_head import lm_loss

        kind = "retro" if model.endswith("retro") else "gpt2"
        cfg = ModelConfig(kind=kind, n_layer=layers, n_embd=width, n_head=heads, n_positions=SEQ, chunk_len=CHUNK,
                          encoder_embd=enc_width, encoder_head=enc_heads, retro_layers=list(cca) if kind == "retro"
                          else [])
        net = build_model(cfg)
        if kind == "retro":
            return net, lambda t, nb: lm_loss(net.hidden(t[:, :-1], nb), net.wte.weight, t[:, 1:])
        return net, lambda t, nb: lm_loss(net.hidden(t[:, :-1]), net.wte.weight, t[:, 1:])
    if model == "retro-pytorch":
        net = retro_pytorch_class()(num_tokens=VOCAB, max_seq_len=SEQ, enc_dim=width, enc_depth=2, dec_depth=layers,
                                    dec_cross_attn_layers=cca, heads=heads, dec_dim=width, dim_head=width // heads,
                                    chunk_size=CHUNK)
        return net, lambda t, nb: net(t, nb + 1, return_loss=True)  # its pad id is 0: shift ours off it
    from transformers import GPT2Config, GPT2LMHeadModel

    net = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=width, n_layer=layers, n_head=heads,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))
    return net, lambda t, nb: net(input_ids=t[:, :-1], labels=t[:, :-1]).loss


def worker(model: str, shape: str, precision: str, steps: int) -> dict:
    """This process: `steps` timed training steps after one warm-up; tokens/s, peak RSS, parameters."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    net, loss_of = build(model, shape)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    batch = SHAPES[shape][-1]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB - 1, (batch, SEQ + 1), generator=g)
    nbrs = torch.randint(0, VOCAB - 1, (batch, SEQ // CHUNK, K, 2 * CHUNK), generator=g)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of(tokens, nbrs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    return {"tokens_per_s": batch * SEQ / statistics.median(times), "params": sum(p.numel() for p in net.parameters()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "loss": float(loss)}


def measure(model: str, shape: str, precision: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", model, shape, precision, str(steps)],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{model} {shape} {precision}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,12x384")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "SHAPE", "PRECISION", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model, shape, precision, steps = args.worker
        print(json.dumps(worker(model, shape, precision, int(steps))))
        return 0
    from retropipe.training.run.hardware import describe

    print(describe())
    retro_pytorch_class()  # fetched before any timing
    results: dict = {}
    for r in range(args.rounds):
        for shape in args.shapes.split(","):
            for precision in args.precisions.split(","):
                for model in MODELS:
                    results.setdefault((shape, precision, model), []).append(measure(model, shape, precision,
                                                                                     args.steps))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(f"\n{'shape':<7}{'prec':<6}{'model':<17}{'params':>13}{'tokens/s':>10}{'peak RSS MB':>13}"
          f"{'ours / peer (per round)':>28}")
    for shape in args.shapes.split(","):
        for precision in args.precisions.split(","):
            for ours, peer in (("retropipe-retro", "retro-pytorch"), ("retropipe-gpt2", "hf-gpt2")):
                ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in
                          zip(results[shape, precision, ours], results[shape, precision, peer])]
                for model in (ours, peer):
                    runs = results[shape, precision, model]
                    ratio = (f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
                             if model == ours else "")
                    print(f"{shape:<7}{precision:<6}{model:<17}{runs[0]['params']:>13,}"
                          f"{statistics.median(x['tokens_per_s'] for x in runs):>10,.0f}"
                          f"{max(x['peak_rss_mb'] for x in runs):>13,.0f}{ratio:>28}")
    print("\n" + DIFFERENCES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
