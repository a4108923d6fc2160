"""launch/generate.py end to end on a real retrieval database (sentence-transformers + FAISS,
8-token chunks). tests/training/test_sampling.py tests sampling itself, in-process.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from retropipe.data.chunking import split_of
from retropipe.data.config import DataConfig
from retropipe.data.prepare import prepare
from retropipe.data.store import ChunkStore
from retropipe.retrieval.build_database import build_retrieval
from retropipe.retrieval.config import RetrievalConfig
from retropipe.training.models.io import save_model
from tests.training.test_sampling import K, M, model_of, tiny

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

TOPICS = ["apples and pears grow in the orchard", "the ship sails across stormy ocean waves",
          "compilers parse source code into syntax trees", "violins and cellos play in the orchestra"]
pytestmark = pytest.mark.usefixtures("one_thread")


# --- the CLI on a real retrieval database ---------------------------------------------------------

def doc_id(split: str, n: int) -> str:
    """An id the data stage puts in `split` (the split is a hash of the id)."""
    i = 0
    while split_of(f"{split}-{n}-{i}", 1234, 0.2) != split:
        i += 1
    return f"{split}-{n}-{i}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A topic corpus with 8-token chunks, its retrieval database, and tiny saved models (run dirs)."""
    root = tmp_path_factory.mktemp("gen")
    docs = [("train", " ".join([TOPICS[i % len(TOPICS)]] * (1 + i % 3))) for i in range(10)] + \
        [("validation", TOPICS[0])]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": doc_id(s, n), "text": t}) + "\n" for n, (s, t) in enumerate(docs)))
    prepare(DataConfig(corpus=str(corpus), chunk_len=M, validation_fraction=0.2), root / "data", progress=False)
    build_retrieval(RetrievalConfig(k=K, embed_batch_size=16, recall_queries=5, train_sample=0),
                    ChunkStore(root / "data"), root / "retrieval", chunks_per_seq=4)
    for kind in ("retro", "gpt2"):
        save_model(model_of(tiny(kind)), root / "runs" / kind / "model")
    return root


def cli(workdir: Path, *args: str, capsys) -> tuple[int, str, str]:
    from retropipe.launch.generate import main

    code = main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", f"workdir={workdir}",
                 "--set", f"data.chunk_len={M}", "--set", "train.seq_len=32", "--device", "cpu", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_retro_end_to_end_shows_neighbours(workdir, capsys):
    args = ("--checkpoint", str(workdir / "runs" / "retro"), "--prompt", "the ship sails across",
            "--max-new-tokens", "12", "--seed", "3", "--show-neighbours")
    code, out, err = cli(workdir, *args, capsys=capsys)
    assert code == 0, err
    text, _, shown = out.partition("\n--- neighbours")
    assert text.startswith("the ship sails across") and "12 new tokens" in err
    # The partial prompt chunk, then chunk 0 once 8 tokens exist (prompt 4 + 12 new = 16 tokens).
    assert "chunk 0 (tokens 0-7, partial (4 of 8 tokens)), retrieved at length 4: 'the ship sails across'" in shown
    assert "chunk 0 (tokens 0-7), retrieved at length 8" in shown and "chunk 1" not in shown
    first = shown.splitlines()[2]                               # the first neighbour of the partial prompt
    assert first.startswith("  1. train chunk ") and "ship" in first
    assert cli(workdir, *args, capsys=capsys)[1] == out        # same seed, same output


def test_cli_says_which_neighbours_it_did_not_read(workdir, capsys):
    # retrieval.aligned_only (configs/tiny.yaml): a neighbour that does not line up with the chunk
    # is found, but RETRO does not read it; the listing says so instead of showing its text.
    args = ("--checkpoint", str(workdir / "runs" / "retro"), "--prompt", "zebra xylophone quantum",
            "--max-new-tokens", "2", "--seed", "3", "--show-neighbours")
    code, out, err = cli(workdir, *args, capsys=capsys)
    assert code == 0, err
    shown = out.partition("\n--- neighbours")[2]
    assert "  1. train chunk " in shown and "not read, it does not line up" in shown
    code, out, err = cli(workdir, *args, "--set", "retrieval.aligned_only=false", capsys=capsys)
    assert code == 0 and "not read" not in out and "  1. train chunk " in out, err


def test_cli_gpt2_needs_no_database(workdir, tmp_path, capsys):
    code, out, err = cli(tmp_path, "--checkpoint", str(workdir / "runs" / "gpt2" / "model"), "--prompt", "apples",
                         "--max-new-tokens", "5", capsys=capsys)
    assert code == 0 and out.startswith("apples"), err
    code, out, err = cli(tmp_path, "--checkpoint", str(workdir / "runs" / "gpt2"), "--max-new-tokens", "3",
                         capsys=capsys)                   # no prompt: starts from end-of-text
    assert code == 0 and "3 new tokens" in err, err


def test_cli_errors_are_exit_2_and_say_what_to_do(workdir, tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    code, _, err = cli(workdir, "--checkpoint", str(missing), capsys=capsys)
    assert code == 2 and str(missing) in err and "no model" in err
    code, _, err = cli(tmp_path, "--checkpoint", str(workdir / "runs" / "retro"), capsys=capsys)
    assert code == 2 and str(tmp_path / "retrieval") in err and "build_index.py" in err
    code, _, err = cli(workdir, "--checkpoint", str(workdir / "runs" / "retro"), "--neighbours", "3", capsys=capsys)
    assert code == 2 and "--neighbours 3" in err and "holds 2" in err
    code, _, err = cli(workdir, "--checkpoint", str(workdir / "runs" / "gpt2"), "--top-p", "0", capsys=capsys)
    assert code == 2 and "top_p" in err
    # RETRO[OFF] needs no database.
    code, out, err = cli(tmp_path, "--checkpoint", str(workdir / "runs" / "retro"), "--neighbours", "0",
                         "--max-new-tokens", "3", capsys=capsys)
    assert code == 0 and "0 retrievals" in err, err


# --- --device and --print-config -------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no GPU")
def test_cli_device_cuda_without_a_gpu_is_a_one_line_error(workdir, capsys):
    from retropipe.launch.generate import main

    code = main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", f"workdir={workdir}",
                 "--checkpoint", str(workdir / "runs" / "gpt2"), "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "--device" in err and len(err.strip().splitlines()) == 1, err


def test_cli_print_config_prints_yaml_and_loads_no_model(tmp_path, capsys):
    import yaml

    from retropipe.launch.generate import main

    # The checkpoint does not exist and cuda may be absent: --print-config touches neither.
    with pytest.raises(SystemExit) as exit:   # as argparse's --help: SystemExit(0)
        main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "data.chunk_len=16",
              "--checkpoint", str(tmp_path / "no-such-run"), "--device", "cuda", "--no-progress", "--print-config"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and yaml.safe_load(out)["data"]["chunk_len"] == 16


# --- --prompt-file and --num-samples ----------------------------------------------------------------

def outputs(stdout: str) -> dict[tuple[int, int], str]:
    """The outputs of a run with several, by (prompt, sample), from their "=== prompt P of Q, sample J of N" heads."""
    parts = stdout.split("=== prompt ")[1:]
    return {(int(p.split()[0]), int(p.split("sample ")[1].split()[0])): p.split("===\n", 1)[1] for p in parts}


def test_cli_prompt_file_and_num_samples(workdir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the ship sails across\n\napples and pears grow in\n")      # the empty line is skipped
    run = ("--checkpoint", str(workdir / "runs" / "retro"), "--max-new-tokens", "10", "--temperature", "1",
           "--show-neighbours", "--no-progress")
    code, out, err = cli(workdir, *run, "--prompt-file", str(prompts), "--num-samples", "2", "--seed", "4",
                         capsys=capsys)
    assert code == 0, err
    got = outputs(out)
    assert sorted(got) == [(1, 1), (1, 2), (2, 1), (2, 2)] and err.count("10 new tokens") == 4
    assert got[1, 1].startswith("the ship sails across") and got[2, 2].startswith("apples and pears grow in")
    assert got[1, 1] != got[1, 2]                                          # independent samples
    # Sample 2 of prompt 2 (seed 5), neighbours included, is the single run with --seed 5.
    code, single, _ = cli(workdir, *run, "--prompt", "apples and pears grow in", "--seed", "5", capsys=capsys)
    assert code == 0 and "=== prompt" not in single and got[2, 2] == single


def test_cli_prompt_file_and_num_samples_errors_name_the_flag(workdir, tmp_path, capsys):
    gpt2 = ("--checkpoint", str(workdir / "runs" / "gpt2"))
    code, _, err = cli(workdir, *gpt2, "--prompt-file", str(tmp_path / "none.txt"), capsys=capsys)
    assert code == 2 and "--prompt-file" in err and "none.txt" in err
    (tmp_path / "empty.txt").write_text("\n  \n")
    code, _, err = cli(workdir, *gpt2, "--prompt-file", str(tmp_path / "empty.txt"), capsys=capsys)
    assert code == 2 and "--prompt-file" in err and "no prompt" in err
    (tmp_path / "latin1.txt").write_bytes("first\ncaf\xe9\n".encode("latin-1"))
    code, _, err = cli(workdir, *gpt2, "--prompt-file", str(tmp_path / "latin1.txt"), capsys=capsys)
    assert code == 2 and "line 2" in err and "UTF-8" in err
    code, _, err = cli(workdir, *gpt2, "--num-samples", "0", capsys=capsys)
    assert code == 2 and "--num-samples" in err
    with pytest.raises(SystemExit) as exit:                                # argparse: one or the other
        cli(workdir, *gpt2, "--prompt", "a", "--prompt-file", str(tmp_path / "empty.txt"), capsys=capsys)
    assert exit.value.code == 2 and "--prompt-file" in capsys.readouterr().err
