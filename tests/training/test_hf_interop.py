"""Exact interchange with Hugging Face GPT2LMHeadModel: in memory, via directories, via the CLI."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from retropipe.launch.convert_gpt2 import main as convert
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2
from retropipe.training.models.hf_interop import gpt2_from_hf, save_hf, to_hf
from retropipe.training.models.io import load_model, retrofit, save_model

ROOT = Path(__file__).resolve().parents[2]
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
    from retropipe.training.models.hf_interop import HFFormatError
    from retropipe.training.models.hf_interop import config_from_hf
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, activation_function="relu").to_dict()
    with pytest.raises(HFFormatError, match="activation_function"):
        config_from_hf(cfg)


def test_corrupt_hf_directory_is_a_clear_error(tmp_path):
    hf_model().save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"not safetensors")
    assert convert(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


# --- the hand-off: pipeline() on an export, hub names ------------------------------------------------

def test_to_hf_export_runs_in_a_transformers_pipeline_offline_with_our_greedy_tokens(tmp_path, capsys, monkeypatch):
    """The export holds the GPT-2 tokenizer and a generation config: pipeline("text-generation")
    tokenizes as tiktoken does and its greedy continuation is launch/generate.py --temperature 0's."""
    from transformers import pipeline

    from retropipe.data.tokenizer import get_tokenizer
    from retropipe.launch.generate import main as generate_cli
    from retropipe.training.evaluation.sampling import generate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    ours = GPT2(ModelConfig(vocab_size=50257, n_positions=64, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():  # larger weights than the init's, so that greedy decoding does not just repeat a token
        for p in ours.parameters():
            p.add_(0.3 * torch.randn_like(p))
    save_model(ours, tmp_path / "ours")
    assert convert(["--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    assert "GPT-2 tokenizer" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "generation_config.json", "vocab.json", "merges.txt",
                 "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).is_file(), name

    prompt, new = "The hacker, naïve café", 16
    pipe = pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    enc = get_tokenizer("gpt2")
    assert len(pipe.tokenizer) == 50257 and pipe.tokenizer.encode(prompt) == enc.encode_ordinary(prompt)
    ids = pipe(prompt, max_new_tokens=new, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    expected = generate(ours, enc.encode_ordinary(prompt), new, temperature=0, eot_id=enc.eot_token).tokens
    assert list(ids) == expected and len(set(expected[-new:])) > 4
    # The CLI prints the same text as the pipeline.
    text = pipe(prompt, max_new_tokens=new, do_sample=False)[0]["generated_text"]
    code = generate_cli(["--config", str(ROOT / "configs" / "tiny.yaml"), "--checkpoint", str(tmp_path / "ours"),
                         "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(new), "--device", "cpu"])
    assert code == 0 and capsys.readouterr().out == text + "\n"


def test_to_hf_of_a_small_vocabulary_writes_no_tokenizer(tmp_path, capsys):
    torch.manual_seed(0)
    save_model(GPT2(ModelConfig(vocab_size=101, n_positions=64, n_layer=1, n_head=2, n_embd=32)), tmp_path / "ours")
    assert convert(["--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    assert "no tokenizer: vocab_size 101" in capsys.readouterr().out
    assert (tmp_path / "hf" / "generation_config.json").is_file() and not (tmp_path / "hf" / "vocab.json").exists()


def test_from_hf_hub_name_without_a_network_is_a_one_line_error(tmp_path):
    """A hub name is tried through huggingface_hub's cache; offline and not cached: exit 2, one
    line naming --from-hf, nothing written. (A fresh process: huggingface_hub reads
    HF_HUB_OFFLINE when imported.)"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "convert_gpt2.py"), "--from-hf", "gpt2",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "--from-hf" in run.stderr and "gpt2" in run.stderr
    assert "cannot be reached" in run.stderr and not (tmp_path / "out").exists()
