"""Exact interchange with Hugging Face GPT2LMHeadModel: in memory, via directories, via the CLI."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from launch.convert_gpt2 import main as convert
from training import load_model, retrofit
from training.config import ModelConfig
from training.hf_interop import gpt2_from_hf, save_hf, to_hf
from training.model import GPT2

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4


def hf_model(seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=101, n_positions=64, n_layer=2, n_head=2, n_embd=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # perturb every tensor (LayerNorms included) so a mis-mapping shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tokens(seed=1):
    return torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(seed))


def max_diff(ours, hf, x):
    with torch.no_grad():
        return (ours(x) - hf(x).logits).abs().max().item()


def test_import_from_hf_model_and_directory(tmp_path):
    hf = hf_model()
    assert max_diff(gpt2_from_hf(hf), hf, tokens()) <= TOL
    hf.save_pretrained(tmp_path / "hf")
    assert max_diff(gpt2_from_hf(tmp_path / "hf"), hf, tokens()) <= TOL


def test_export_to_hf_model_and_directory(tmp_path):
    torch.manual_seed(0)
    ours = GPT2(ModelConfig(vocab_size=101, n_positions=64, n_layer=2, n_head=2, n_embd=32)).eval()
    assert max_diff(ours, to_hf(ours), tokens()) <= TOL
    save_hf(ours, tmp_path / "hf")
    assert max_diff(ours, GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval(), tokens()) <= TOL


def test_convert_cli_both_ways(tmp_path):
    hf = hf_model(seed=3)
    hf.save_pretrained(tmp_path / "hf")
    assert convert(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    ours = load_model(tmp_path / "ours")
    assert isinstance(ours, GPT2) and max_diff(ours, hf, tokens()) <= TOL
    assert convert(["--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf2")]) == 0
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "hf2").eval()
    assert max_diff(ours, back, tokens()) <= TOL
    # An existing output is kept unless --force.
    assert convert(["--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf2")]) == 2
    assert convert(["--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf2"), "--force"]) == 0
    # RETRO-fit straight from the Hugging Face directory.
    retro = retrofit(tmp_path / "hf", ModelConfig(kind="retro", vocab_size=101, n_positions=64, n_layer=2,
                                                  n_head=2, n_embd=32, encoder_embd=16, encoder_head=2, chunk_len=4))
    assert max_diff(retro.eval(), hf, tokens()) <= TOL


def test_convert_cli_rejects_bad_input_with_nonzero_exit(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "convert_gpt2.py"), "--from-hf",
                          str(tmp_path / "missing"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "input directory not found" in run.stderr
    (tmp_path / "empty").mkdir()
    assert convert(["--from-hf", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert convert(["--to-hf", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_unsupported_hf_variant_is_rejected():
    from training.hf_interop import HFFormatError, config_from_hf
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, activation_function="relu").to_dict()
    with pytest.raises(HFFormatError, match="activation_function"):
        config_from_hf(cfg)


def test_corrupt_hf_directory_is_a_clear_error(tmp_path):
    hf_model().save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"not safetensors")
    assert convert(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
