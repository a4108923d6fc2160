"""Bits per byte by hand vs the tool, the overlap ratio α, and the sliding window."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from retropipe.data.config import DataConfig
from retropipe.data.prepare import prepare
from retropipe.data.store import ChunkStore
from retropipe.data.tokenizer import get_tokenizer
from retropipe.training.evaluation.leakage import alpha_buckets, longest_common_substring, overlap_ratios
from retropipe.training.evaluation.scoring import score_split, token_byte_lengths
from retropipe.training.models.config import ModelConfig
from retropipe.training.models.gpt2 import GPT2

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Bits per byte — naïve café ☕", "short"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    prepare(DataConfig(corpus=str(corpus), chunk_len=8, validation_fraction=0.0), root / "data", progress=False)
    torch.manual_seed(0)
    model = GPT2(ModelConfig(n_layer=1, n_head=2, n_embd=16, n_positions=128, chunk_len=8)).eval()
    enc = get_tokenizer("gpt2")
    return ChunkStore(root / "data").split("train"), model, enc


def test_bits_per_byte_equals_a_hand_computation(tiny):
    chunks, model, enc = tiny
    # By hand: the documents' tokens + end-of-text, back to back, one forward pass, every
    # token after the first is a target, bytes are the UTF-8 bytes of the texts.
    stream = [t for text in TEXTS for t in enc.encode_ordinary(text) + [enc.eot_token]]
    # ...except that the model sees each document padded to whole chunks: rebuild that input.
    padded, real = [], []
    for text in TEXTS:
        toks = enc.encode_ordinary(text) + [enc.eot_token]
        pad = -len(toks) % 8
        padded += toks + [enc.eot_token] * pad
        real += [True] * len(toks) + [False] * pad
    x = torch.tensor([padded])
    with torch.no_grad():
        nll = F.cross_entropy(model(x)[0, :-1], x[0, 1:], reduction="none").numpy()
    total = sum(v for v, r in zip(nll, real[1:]) if r)
    n_bytes = sum(len(t.encode()) for t in TEXTS) - len(enc.decode_single_token_bytes(stream[0]))
    expected = total / math.log(2) / n_bytes

    window = len(padded)
    scores = score_split(model, chunks, token_byte_lengths(enc), window=window, stride=window)
    assert scores.bytes.sum() == n_bytes
    assert scores.tokens.sum() == len(stream) - 1
    assert scores.bits_per_byte() == pytest.approx(expected, rel=1e-5)


def test_sliding_window_scores_every_token_once(tiny):
    chunks, model, enc = tiny
    full = score_split(model, chunks, token_byte_lengths(enc), window=len(chunks) * 8, stride=len(chunks) * 8)
    for window, stride in ((32, 16), (24, 8), (16, 8)):
        s = score_split(model, chunks, token_byte_lengths(enc), window=window, stride=stride)
        assert (s.tokens == full.tokens).all(), (window, stride)  # each target scored exactly once
        assert (s.bytes == full.bytes).all()
    with pytest.raises(ValueError, match="multiples of chunk_len"):
        score_split(model, chunks, token_byte_lengths(enc), window=30, stride=10)


class TableNeighbours:
    """A neighbour source over a fixed (chunks, k, r) table of tokens (evaluate_models reads any)."""

    def __init__(self, table):
        self.table, self.reading = table, self

    def neighbour_tokens(self, split, ids, k):
        return self.table[ids][..., :k, :].copy()

    def but(self, **_):
        return self

    def read_as(self, _):
        return TableNeighbours(self.table[::-1].copy())  # SHUFFLED: another chunk's neighbours


def test_a_database_curve_point_that_reads_what_retro_on_read_is_not_scored_again(tiny):
    from retropipe.training.evaluation.config import EvalConfig
    from retropipe.training.evaluation.report_rows import evaluate_models
    from retropipe.training.models.retro import Retro

    chunks, _, enc = tiny
    torch.manual_seed(0)
    retro = Retro(ModelConfig(kind="retro", n_layer=2, n_head=2, n_embd=16, n_positions=64, chunk_len=8,
                              encoder_layers=1, encoder_embd=8, encoder_head=2)).eval()
    table = np.random.default_rng(0).integers(0, 1000, (len(chunks), 2, 16))
    on = TableNeighbours(table)
    other = TableNeighbours(np.where(np.arange(16) < 8, table, -1))   # the same chunks, no continuations
    scored = []
    report = evaluate_models([("retro", retro)], chunks, token_byte_lengths(enc),
                             EvalConfig(window=16, stride=8, neighbours=2, precision="fp32"), on,
                             [("fewer", 10, other), ("all", 20, TableNeighbours(table))],
                             progress=lambda name: scored.append(name) or (lambda xs: xs))
    assert scored == ["retro RETRO[ON] k=2", "retro RETRO[OFF]", "retro RETRO[SHUFFLED]",
                      "retro RETRO[ON] k=2 (fewer)"]                         # "all" reused RETRO[ON]'s scores
    fewer, full = report["database_curve"]["points"]
    assert full["retro"] == report["rows"][0]["bits_per_byte"] != fewer["retro"]


def test_scoring_in_bf16_runs_in_bf16_and_agrees_with_fp32(tiny):
    """eval.precision: bf16 scores differ from fp32's (the matmuls and the head's softmax run in
    bf16) by bf16's rounding only; the report names the precision it scored in."""
    from retropipe.training.evaluation.config import EvalConfig
    from retropipe.training.evaluation.report_rows import evaluate_models

    chunks, model, enc = tiny
    reports = {p: evaluate_models([("gpt2", model)], chunks, token_byte_lengths(enc),
                                  EvalConfig(window=16, stride=8, precision=p)) for p in ("fp32", "bf16")}
    fp32, bf16 = (reports[p]["rows"][0]["bits_per_byte"] for p in ("fp32", "bf16"))
    assert [reports[p]["precision"] for p in ("fp32", "bf16")] == ["fp32", "bf16"]
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=1e-2)


def test_retro_scores_equal_a_forward_that_reads_every_neighbour(tiny):
    """Scoring leaves each window's last chunk's neighbours unread (they steer only the last
    position, which predicts past the window), and evaluation encodes only the chunks that have a
    neighbour: neither changes a score."""
    from retropipe.training.models.retro import Retro

    chunks, _, enc = tiny
    torch.manual_seed(0)
    retro = Retro(ModelConfig(kind="retro", n_layer=2, n_head=2, n_embd=16, n_positions=128, chunk_len=8,
                              encoder_layers=1, encoder_embd=8, encoder_head=2)).eval()
    c = len(chunks)
    table = np.random.default_rng(0).integers(0, 1000, (c, 2, 16))
    table[1] = -1                                                  # a chunk without neighbours
    source = TableNeighbours(table)
    ids = np.arange(c)
    x = torch.from_numpy(chunks.tokens(ids).reshape(1, -1).astype(np.int64))
    with torch.enable_grad():                                      # every chunk through encoder and CCA
        logits = retro(x, torch.from_numpy(source.neighbour_tokens("train", ids[None], k=2))).detach()
    nll = F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none").numpy()
    real = (np.arange(8)[None] < chunks.lengths[ids][:, None]).reshape(-1)[1:]
    scores = score_split(retro, chunks, token_byte_lengths(enc), window=c * 8, stride=c * 8, neighbours=source, k=2)
    assert scores.nll.sum() == pytest.approx(nll[real].sum(), rel=1e-6)
    off = score_split(retro, chunks, token_byte_lengths(enc), window=c * 8, stride=c * 8)
    assert abs(off.nll.sum() - scores.nll.sum()) > 1e-3           # the neighbours are read


def test_scoring_makes_its_tensors_on_the_models_device(tiny):
    """The CUDA path checked on CPU: under a "meta" default device, a tensor made without device=
    would land on meta and fail against the CPU model; the scores are unchanged."""
    from retropipe.training.models.retro import Retro

    chunks, model, enc = tiny
    torch.manual_seed(0)
    retro = Retro(ModelConfig(kind="retro", n_layer=2, n_head=2, n_embd=16, n_positions=128, chunk_len=8,
                              encoder_layers=1, encoder_embd=8, encoder_head=2)).eval()

    class Neighbours:  # any source of (b, l, k, r) ids: each chunk's own tokens, twice
        def neighbour_tokens(self, split, ids, k=None):
            own = chunks.tokens(ids.reshape(-1)).astype(np.int64).reshape(*ids.shape, 1, 8)
            return np.concatenate([own, own], -1).repeat(2, axis=-2)

    for net, source in ((model, None), (retro, Neighbours())):
        expected = score_split(net, chunks, token_byte_lengths(enc), 16, 8, source, k=2).bits_per_byte()
        with torch.device("meta"):
            assert score_split(net, chunks, token_byte_lengths(enc), 16, 8, source, k=2).bits_per_byte() == expected


def test_longest_common_substring_and_alpha():
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    assert longest_common_substring(a, np.array([9, 3, 4, 5, 9, 1, 2])) == 3
    assert longest_common_substring(a, np.array([8, 7, 6])) == 1
    assert longest_common_substring(a, np.array([], dtype=int)) == 0
    chunks = np.stack([a, a + 100])
    nbrs = np.stack([np.stack([np.r_[a, a], np.r_[a[:2], [0] * 14]]),             # full copy, k=2
                     np.stack([np.r_[[0] * 8, a + 100], np.full(16, 7)])])       # copy in the continuation
    nbrs[1, 0, 8:] = -1  # ...but the continuation is missing: it must not count
    alpha = overlap_ratios(chunks, np.array([8, 8]), nbrs, chunk_len=8)
    assert alpha.tolist() == [1.0, 0.0]
    buckets = dict(alpha_buckets(np.array([0.0, 0.1, 0.5, 0.9])))
    assert buckets["α ≤ 12.5%"].tolist() == [True, True, False, False]
    assert buckets["α ≥ 50%"].tolist() == [False, False, True, True]


# --- the command: every report file, on a split and on a held-out corpus ---------------------------

@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Untrained tiny GPT-2 and RETRO checkpoints over a real retrieval database (8-token chunks)."""
    from retropipe.retrieval.build_database import build_retrieval
    from retropipe.training.models.io import save_model
    from retropipe.training.models.retro import Retro
    from tests.corpora import make_store, retrieval_cfg, topic_docs

    root = tmp_path_factory.mktemp("evaluate")
    store = make_store(root, topic_docs(n_train=14, n_val=4))
    build_retrieval(retrieval_cfg(), store, root / "retrieval", chunks_per_seq=4)
    shape = dict(n_layer=2, n_head=2, n_embd=16, n_positions=64, chunk_len=8)
    torch.manual_seed(0)
    for kind, model in (("gpt2", GPT2(ModelConfig(**shape))),
                        ("retro", Retro(ModelConfig(kind="retro", encoder_layers=1, encoder_embd=8, encoder_head=2,
                                                    **shape)))):
        save_model(model, root / "runs" / kind / "model")
        (root / "runs" / kind / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 4)))
    # The runs' config.yaml, as training leaves it (the parts the report reads): RETRO warm-started.
    (root / "runs" / "gpt2" / "config.yaml").write_text(json.dumps({"model": {"kind": "gpt2"},
                                                                    "train": {"steps": 3, "seed": 1234}}))
    (root / "runs" / "retro" / "config.yaml").write_text(json.dumps(
        {"model": {"kind": "retro"}, "train": {"steps": 3, "seed": 1234, "init_from": str(root / "runs" / "gpt2" / "model")}}))
    sets = [f"workdir={root}", "data.chunk_len=8", "data.validation_fraction=0.2", "train.seq_len=32",
            "model.n_positions=64", "eval.window=32", "eval.stride=16", "eval.more_neighbours=0"]
    return root, [a for s in sets for a in ("--set", s)]


def direct_neighbours(database_dir, store, split, found_ids, k):
    """(expected (q, k), found (q, k)) squared L2 distances of a split's chunks' k nearest database chunks,
    by an exact FAISS search over the database's stored vectors, and of `found_ids`; own (q,) whether a
    query's nearest chunk was one of its own document's, excluded. The queries are embedded here with
    the bundled MiniLM and rounded to float16, as the embedding stage stores them. A copy of the same
    chunk (same document text, same place) counts once, as retrieval/neighbour_search.py keeps one."""
    import faiss

    from retropipe.data.database_reader import Database
    from retropipe.data.tokenizer import get_tokenizer
    from retropipe.retrieval.database_parts import open_vectors
    from retropipe.retrieval.embed_job import chunk_texts, embed, load_embedder, resolve_model_path

    db, chunks, doc_hash = Database(database_dir), store.split(split), store.text_hashes(split)
    vectors = open_vectors(db).rows(np.arange(len(db))).astype(np.float32)         # (N, d)
    ids = np.arange(len(chunks))
    texts = chunk_texts(chunks.tokens(ids), chunks.lengths[ids], get_tokenizer("gpt2"), get_tokenizer("gpt2").eot_token)
    queries = embed(load_embedder(resolve_model_path("")), texts).astype(np.float16).astype(np.float32)
    index = faiss.IndexFlatL2(vectors.shape[1])
    index.add(vectors)
    dist, order = index.search(queries, len(db))                                  # every database chunk, nearest first
    expected, own = np.zeros((len(ids), k)), np.zeros(len(ids), dtype=bool)
    for q in ids:
        seen, picked = set(), []
        for d, i in zip(dist[q], order[q]):
            key = (db.text_hashes[i], db.positions[i])
            if db.text_hashes[i] == doc_hash[q]:
                own[q] |= not picked
                continue
            if key not in seen:
                seen.add(key)
                picked.append(d)
            if len(picked) == k:
                break
        expected[q] = picked
    found = ((vectors[found_ids] - queries[:, None]) ** 2).sum(-1)
    return expected, found, own


def test_evaluate_writes_every_report_file(evaluated, capsys):
    from retropipe.launch.evaluate import main

    root, sets = evaluated
    assert main(["--config", "configs/tiny.yaml", *sets, "--set", "eval.retro_knn_lm=true",
                 "--checkpoint", str(root / "runs" / "gpt2"), "--checkpoint", str(root / "runs" / "retro")]) == 0
    out = root / "reports"
    report = json.loads((out / "report.json").read_text())
    assert [r["model"] for r in report["rows"]] == ["gpt2 (baseline)", "gpt2 in-context k=1", "gpt2 kNN-LM",
                                                    "retro RETRO[ON] k=2", "retro RETRO[OFF]", "retro RETRO[SHUFFLED]",
                                                    "retro RETRO[ON] k=2 + kNN-LM"]
    assert all(r["bits_per_byte"] > 0 and r["tokens"] == report["rows"][0]["tokens"] for r in report["rows"])
    bpb = [r["bits_per_byte"] for r in report["rows"]]
    assert len(set(bpb[3:])) == 4 and bpb[1] != bpb[0] != bpb[2]  # RETRO and the rivals read the neighbours
    everything = next(b for b in report["alpha"]["buckets"] if b["bucket"] == "α ≤ 100.0%")
    assert everything["chunks"] == report["chunks"] == len(ChunkStore(root / "data").split("validation"))
    for name in ("report.md", "loss_curves.png", "bpb.png", "bpb_by_alpha.png", "config.yaml"):
        assert (out / name).stat().st_size > 0, name
    said, md = capsys.readouterr(), (out / "report.md").read_text()   # precision auto: never emulated bf16's warning
    assert "RETRO[OFF]" in md and "bits/byte" in said.out and "warning" not in said.err
    trained = report["trained"]  # how each model was trained, from its run's config.yaml: RETRO from the baseline's
    assert trained["gpt2"] == "GPT-2, 3 steps of training, seed 1234"
    assert f"starting from the weights of {root / 'runs' / 'gpt2' / 'model'} (train.init_from)" in trained["retro"]
    assert f"- retro: {trained['retro']}" in md and "retro RETRO[ON] k=2 + kNN-LM: " in md  # beside the best rival


def test_a_warm_started_model_is_reported_as_one(tmp_path):
    """A model trained from another's weights has trained longer than its steps say: the report says so."""
    import yaml

    from retropipe.launch.report import how_trained

    run = tmp_path / "runs" / "retro"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"kind": "retro", "freeze_trunk": False},
                                                     "train": {"steps": 100, "seed": 2, "init_from": "runs/gpt2/model"}}))
    for checkpoint in (run, run / "model"):
        line = how_trained(checkpoint, "retro")
        assert line.startswith("RETRO, 100 steps of training, seed 2, starting from the weights of runs/gpt2/model")
        assert "trunk trained further" in line and "ON against OFF" in line
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"kind": "retro", "freeze_trunk": True},
                                                     "train": {"steps": 100, "seed": 2, "init_from": "runs/gpt2/model"}}))
    assert "trunk frozen" in how_trained(run, "retro")
    assert how_trained(run, "gpt2") is None             # not this model's run: say nothing
    assert how_trained(tmp_path / "elsewhere", "retro") is None  # a bare model directory: nothing to say
    for broken in (b"\xff\xfe not utf-8", b"- a list", b"model: [retro]\ntrain: 3"):
        (run / "config.yaml").write_bytes(broken)
        assert how_trained(run, "retro") is None  # never fails an evaluation that has scored
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"kind": "gpt2"}, "train": {"steps": 5, "seed": 1,
                                                                                         "init_from": "hf-gpt2"}}))
    assert how_trained(run, "gpt2") == "GPT-2, 5 steps of training, seed 1, starting from the weights of hf-gpt2 (train.init_from)"


def test_evaluation_is_skipped_for_the_same_inputs_and_redone_for_others(evaluated, tmp_path, capsys):
    from retropipe.launch.evaluate import main

    root, sets = evaluated
    args = ["--config", "configs/tiny.yaml", *sets, "--checkpoint", str(root / "runs" / "gpt2"), "--out", str(tmp_path)]
    assert main(args) == 0
    first = (tmp_path / "report.json").read_text()
    capsys.readouterr()
    assert main(args) == 0  # the same models, data and eval settings: the manifest says it is done
    assert "nothing to do" in capsys.readouterr().out and (tmp_path / "report.json").read_text() == first
    assert main([*args, "--set", "eval.stride=8"]) == 0  # another setting: scored again
    again = json.loads((tmp_path / "report.json").read_text())
    assert "nothing to do" not in capsys.readouterr().out and again["inputs"] != json.loads(first)["inputs"]


def test_evaluate_a_held_out_corpus_against_the_training_database(evaluated, tmp_path):
    from retropipe.launch.evaluate import main

    root, sets = evaluated
    corpus = tmp_path / "other.jsonl"
    # The last document is a copy of a training document: its chunks must not retrieve that document.
    corpus.write_text("".join(json.dumps({"id": f"o{i}", "text": t}) + "\n" for i, t in enumerate(
        ["the ship sails across stormy ocean waves at night", "bakers knead dough for fresh bread and rolls",
         "apples and pears grow in the orchard"])))
    out = tmp_path / "report"
    assert main(["--config", "configs/tiny.yaml", *sets, "--corpus", str(corpus), "--out", str(out),
                 "--checkpoint", str(root / "runs" / "gpt2"), "--checkpoint", str(root / "runs" / "retro")]) == 0
    report = json.loads((out / "report.json").read_text())
    names = [r["model"].split(" ", 1)[1] for r in report["rows"]]  # the rivals read the corpus's neighbours too
    assert report["corpus"] == str(corpus) and names[:3] == ["(baseline)", "in-context k=1", "kNN-LM"] and len(names) == 6
    assert f"(held-out corpus {corpus})" in (out / "report.md").read_text().splitlines()[0]
    ids = np.load(next((out / "neighbours").glob("*/validation.npy")), allow_pickle=False)
    assert ids.shape[1] == 2 and (ids >= 0).all()                   # the database's k
    # They are the right neighbours: a direct exact search of the database's vectors with the
    # chunks embedded anew, own-document chunks excluded, gives the same distances.
    expected, found, own = direct_neighbours(root / "retrieval", ChunkStore(out / "data"), "validation", ids, k=2)
    np.testing.assert_allclose(found, expected, atol=1e-3)
    assert own.any()                                                # the copied document was there to exclude
    # A missing corpus is a clear error, exit 2.
    assert main(["--config", "configs/tiny.yaml", *sets, "--corpus", str(tmp_path / "nope.jsonl"), "--out",
                 str(tmp_path / "r2"), "--checkpoint", str(root / "runs" / "retro")]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no GPU")
def test_evaluate_device_cuda_without_a_gpu_is_a_one_line_error_and_writes_nothing(evaluated, tmp_path, capsys):
    from retropipe.launch.evaluate import main

    root, sets = evaluated
    out = tmp_path / "report"
    code = main(["--config", "configs/tiny.yaml", *sets, "--checkpoint", str(root / "runs" / "gpt2"),
                 "--out", str(out), "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "--device" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_evaluate_print_config_prints_yaml_and_loads_no_model(tmp_path, capsys):
    import yaml

    from retropipe.launch.evaluate import main

    with pytest.raises(SystemExit) as exit:   # as argparse's --help: SystemExit(0)
        main(["--config", "configs/tiny.yaml", "--set", "eval.stride=64", "--checkpoint",
              str(tmp_path / "no-such-run"), "--device", "cuda", "--no-progress", "--print-config"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and yaml.safe_load(out)["eval"]["stride"] == 64
    assert not any(tmp_path.iterdir())


def test_faiss_searches_the_cpu_index_unless_faiss_and_a_gpu_can(evaluated):
    import faiss

    from retropipe.retrieval.query import GPU_MAX_K, Retriever, gpu_index
    from tests.corpora import retrieval_cfg

    root, _ = evaluated
    retriever = Retriever(root / "retrieval", retrieval_cfg())
    assert retriever.gpu is None and retriever.index_for() is retriever.index
    assert gpu_index(retriever.index, "cpu", 16, 10) is None
    assert gpu_index(retriever.index, "cuda", 16, GPU_MAX_K + 1) is None       # beyond the GPU's top-k
    gpu_faiss = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    if not gpu_faiss:                                                            # faiss-cpu: no copy, no error
        assert gpu_index(retriever.index, "cuda", 16, 10) is None
        return
    on_gpu = Retriever(root / "retrieval", retrieval_cfg(), device="cuda")       # faiss-gpu on a GPU machine
    assert on_gpu.gpu is not None and on_gpu.index_for() is on_gpu.gpu[0]
    allowed = np.arange(3, dtype=np.int64)
    assert on_gpu.index_for(allowed) is on_gpu.index                            # GPU indexes ignore IDSelectors
    queries = retriever.vectors.rows(np.arange(8)).astype(np.float32)
    np.testing.assert_array_equal(on_gpu.search(queries, 2), retriever.search(queries, 2))
