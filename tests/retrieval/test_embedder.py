"""The embedder: sentence-transformers embeddings of chunks, and the models retrieval.embedder names.

retrieval.embedder is "" (the bundled MiniLM), a local directory or a Hugging Face hub id. The
hub is reached only for a hub id; these tests run offline (conftest.py), so a hub id is served from
a huggingface_hub cache laid out by the test, as the library lays out its downloads.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from retropipe.data.store import ChunkStore
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.build_database import build_retrieval
from retropipe.retrieval.embed_job import cached_embedder, embed
from retropipe.retrieval.embedder import local_model_path, model_identity, resolve_model_path
from tests.corpora import ROOT, SEQ_CHUNKS, make_store, neighbours_of, retrieval_cfg, topic_docs

REPO, COMMIT = "sentence-transformers/all-MiniLM-L6-v2", "0123456789abcdef0123456789abcdef01234567"


def test_embed_matches_sentence_transformers_encode():
    """embed's path for any model of another layout than retrieval/bert.py's: a SentenceTransformer."""
    model = cached_embedder(str(resolve_model_path("")), backend="sentence-transformers")
    texts = ["a", "The ship sails across stormy ocean waves, far from home.", "", "naïve café — 12345",
             "compilers " * 40, "bread"]
    ours = embed(model, texts, sub_batch=4)
    reference = model.encode(texts, batch_size=3, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.shape == (6, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_embed_pads_sub_batches_sorted_by_the_embedders_tokens_not_characters():
    """A text's characters say little about its WordPiece count; sub-batches of texts sorted by
    tokens are padded less, and the vectors come back in the input order."""
    from retropipe.retrieval.embed_job import token_lengths

    model = cached_embedder(str(resolve_model_path("")))
    texts = ["word " * 20, "pneumonoultramicroscopicsilicovolcanoconiosis tachyphylaxis", "ok",
             "zyzzyva quixotic sphygmomanometer", "a b c d e f g h"]
    tokens = np.array(token_lengths(model, texts))

    def padded(order):                                   # tokens fed in sub-batches of 2 in this order
        return sum(len(g) * g.max() for g in np.split(tokens[order], range(2, len(texts), 2)))
    by_tokens, by_chars = padded(np.argsort(tokens, kind="stable")), padded(np.argsort([len(t) for t in texts]))
    assert by_tokens < by_chars
    fed = []
    hook = model.register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))   # tokens (b, n)
    try:
        ours = embed(model, texts, sub_batch=2)
    finally:
        hook.remove()
    assert sum(fed) == by_tokens
    one_by_one = np.concatenate([embed(model, [t]) for t in texts])
    np.testing.assert_allclose(ours, one_by_one, atol=2e-5)


def test_embeddings_are_aligned_with_chunk_shards(built):
    root, store, result = built
    manifest = result["embeddings"]
    assert manifest["dim"] == 384 and manifest["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert manifest["backend"] == "torch"  # retrieval/bert.py computed it
    assert manifest["chunk_store_fingerprint"] == store.fingerprint
    for split in ("train", "validation"):
        names = [n.replace(".arrow", ".npy") for n in store.manifest["shards"][split]]
        assert manifest["shards"][split] == names
        for name, count in zip(names, store.manifest["shard_chunks"][split]):
            arr = np.load(root / "retrieval" / "embeddings" / split / name, allow_pickle=False)
            assert arr.shape == (count, 384) and arr.dtype == np.float16


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache for this test (the library reads its location at each call)."""
    import huggingface_hub.constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_model(cache, repo: str = REPO, commit: str = COMMIT):
    """Put the bundled MiniLM into the cache as `repo` at `commit`: refs/main → snapshots/<commit>/."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    shutil.copytree(resolve_model_path(""), snapshot, copy_function=os.symlink)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_id_is_resolved_through_the_hub_cache(built, tmp_path, hub_cache):
    snapshot = cache_model(hub_cache)
    assert resolve_model_path(REPO) == snapshot
    assert model_identity(snapshot, REPO)["name"] == REPO and model_identity(snapshot, REPO)["revision"] == COMMIT
    # A node whose driver path does not exist fetches the same commit into its own cache.
    assert local_model_path(f"/elsewhere/snapshots/{COMMIT}", REPO) == snapshot
    # The same weights under a hub id: the same neighbours as the bundled model's database.
    ref_root = built[0]
    shutil.copytree(ref_root / "data", tmp_path / "data")
    result = build_retrieval(retrieval_cfg(embedder=REPO), ChunkStore(tmp_path / "data"), tmp_path / "retrieval",
                             chunks_per_seq=SEQ_CHUNKS)
    assert result["embeddings"]["model"] == REPO and result["embeddings"]["model_path"] == str(snapshot)
    for split, ids in neighbours_of(tmp_path).items():
        np.testing.assert_array_equal(ids, neighbours_of(ref_root)[split])


def test_a_hub_id_offline_and_not_cached_is_one_line_naming_the_key(built, tmp_path, hub_cache, capsys):
    from retropipe.launch.build_index import main

    shutil.copytree(built[0] / "data", tmp_path / "data")
    code = main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--no-progress", "--set", f"workdir={tmp_path}",
                 "--set", "data.chunk_len=8", "--set", "train.seq_len=32", "--set", f"retrieval.embedder={REPO}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "'retrieval.embedder'" in err and REPO in err and "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "retrieval").exists()  # failed before writing anything


@pytest.mark.parametrize("embedder, message", [("./no/such/model", "not a sentence-transformers model directory"),
                                               ("owner/no-such-model", "neither a local directory nor in the")])
def test_a_bad_embedder_names_the_key(hub_cache, embedder, message):
    with pytest.raises(RetrievalError, match=f"'retrieval.embedder'.*{message}"):
        resolve_model_path(embedder)


NO_NETWORK = """
import socket, sys
tried = []
def refuse(host, *args, **kwargs):
    tried.append(str(host))
    raise OSError("no network in this test")
socket.getaddrinfo = refuse
socket.create_connection = lambda address, *a, **k: refuse(address[0])
from retropipe.retrieval.embed_job import embed, load_embedder, model_identity, resolve_model_path
bundled = str(resolve_model_path(""))
for name in ("", bundled):  # the default, and a local directory
    path = resolve_model_path(name)
    vectors = embed(load_embedder(path), ["no network needed"])
    model_identity(path, name)
print("tried:", tried, vectors.shape)
"""


def test_the_bundled_and_a_local_model_never_touch_the_network():
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run([sys.executable, "-c", NO_NETWORK], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tried: [] (1, 384)" in proc.stdout, proc.stdout


def test_embed_precision_auto_follows_the_hardware_and_queries_follow_their_database(monkeypatch, kernels_unheld):
    """bf16 where the CPU has bf16 matmuls (AVX512-BF16, AMX), fp16 on a GPU, fp32 elsewhere; the
    choice is recorded in the embeddings' manifest and a Retriever embeds queries the same way
    where its device computes that precision (query_precision)."""
    import retropipe.data.cpu as cpu
    from retropipe.retrieval.embedder import query_precision, resolve_embed_precision

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert resolve_embed_precision("auto", "cpu") == "bf16" and resolve_embed_precision("auto", "cuda") == "fp16"
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert resolve_embed_precision("auto", "cpu") == "fp32" and resolve_embed_precision("fp16", "cpu") == "fp32"
    assert resolve_embed_precision("bf16", "cpu") == "bf16"  # asked for: emulated, but done
    # Queries follow their database's precision where this device computes it, else fp32: a database
    # embedded in bf16 (a CPU with bf16) or fp16 (a GPU), queried on a CPU without bf16 instructions.
    assert [query_precision(p, "cpu") for p in ("bf16", "fp16", "fp32")] == ["fp32", "fp32", "fp32"]
    assert [query_precision(p, "cuda") for p in ("bf16", "fp16", "fp32")] == ["bf16", "fp16", "fp32"]
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert [query_precision(p, "cpu") for p in ("bf16", "fp16", "fp32")] == ["bf16", "fp32", "fp32"]


def test_bf16_by_name_on_a_cpu_that_emulates_it_embeds_in_bf16_with_a_warning(monkeypatch, capsys, kernels_unheld):
    import retropipe.data.cpu as cpu
    from retropipe.retrieval.embed_job import runner_precision, serial_embed_runner

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert runner_precision(serial_embed_runner, "bf16") == "bf16"
    assert "build_index: warning: retrieval.embed_precision is bf16, but this CPU has no bf16" in capsys.readouterr().err
    assert runner_precision(serial_embed_runner, "auto") == "fp32" and not capsys.readouterr().err
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert runner_precision(serial_embed_runner, "bf16") == "bf16" and not capsys.readouterr().err


def test_bf16_embeddings_keep_the_neighbours(tmp_path):
    """The embedder in bf16 (retrieval.embed_precision): vectors within 1e-3 of fp32's cosine, and
    for ≥ 98% of the chunks a nearest neighbour as near (by fp32 cosine, within 2e-3) as fp32's own:
    the topic corpus's 8-token chunks repeat and nearly repeat, so which of two near-ties comes
    first is rounding (docs/benchmarks.md counts unchanged ids on the demo's database)."""
    store = make_store(tmp_path, topic_docs(n_train=30, n_val=6))
    vectors, nearest = {}, {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision / "retrieval"
        result = build_retrieval(retrieval_cfg(embed_precision=precision), ChunkStore(store.root), out, SEQ_CHUNKS)
        assert result["embeddings"]["precision"] == precision
        vectors[precision] = {s: np.concatenate([np.load(p, allow_pickle=False).astype(np.float32) for p in
                                                 sorted((out / "embeddings" / s).glob("*.npy"))]) for s in
                              ("train", "validation")}
        nearest[precision] = neighbours_of(out.parent)
    exact = vectors["fp32"]
    cos = (exact["train"] * vectors["bf16"]["train"]).sum(1)
    assert cos.min() > 0.999, cos.min()
    for split in ("train", "validation"):
        def similarity(precision):
            ids = nearest[precision][split][:, 0]
            return np.where(ids >= 0, (exact[split] * exact["train"][np.maximum(ids, 0)]).sum(1), -1)
        as_near = (similarity("bf16") >= similarity("fp32") - 2e-3).mean()
        assert as_near >= 0.98, (split, as_near)


def test_the_width_is_read_from_the_model_files_as_the_loaded_model_reports_it(tmp_path):
    """A database build learns the embedding width from the model's files (its driver then never
    loads the model); where the files do not say it plainly the caller loads the model instead."""
    import json

    from sentence_transformers import SentenceTransformer
    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer import modules as models
        two_modes = {"pooling_mode": ("mean", "max")}
    except ImportError:
        from sentence_transformers import models
        two_modes = {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}

    from retropipe.retrieval.embed_job import embedding_dim
    from retropipe.retrieval.embedder import embedding_dim_from_files

    bundled = resolve_model_path("")
    assert embedding_dim_from_files(bundled) == embedding_dim(cached_embedder(str(bundled))) == 384
    # Two pooling modes side by side, a Dense layer, normalised: what sentence-transformers saves.
    stacked = tmp_path / "stacked"
    SentenceTransformer(modules=[models.Transformer(str(bundled)), models.Pooling(384, **two_modes),
                                 models.Dense(768, 48), models.Normalize()], device="cpu").save(str(stacked))
    assert embedding_dim_from_files(stacked) == embedding_dim(SentenceTransformer(str(stacked), device="cpu")) == 48
    # The same pooling in the older config format, one flag per mode.
    legacy = tmp_path / "legacy"
    shutil.copytree(stacked, legacy)
    pooling = next(legacy / m["path"] / "config.json" for m in json.loads((legacy / "modules.json").read_text())
                   if m["type"].endswith("Pooling"))
    pooling.write_text(json.dumps({"word_embedding_dimension": 384, "pooling_mode_cls_token": False,
                                   "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}))
    assert embedding_dim_from_files(legacy) == embedding_dim(SentenceTransformer(str(legacy), device="cpu")) == 48
    # Not said plainly: a truncation, a module it does not know, no Pooling after the Transformer, no
    # modules.json (a bare transformers model).
    for name, change in (("truncated", lambda p: (p / "config_sentence_transformers.json").write_text(
                             json.dumps({"truncate_dim": 16}))),
                         ("unpooled", lambda p: (p / "modules.json").write_text(json.dumps(
                             [m for m in json.loads((p / "modules.json").read_text())
                              if m["type"].rsplit(".", 1)[-1] in ("Transformer", "Normalize")]))),
                         ("unknown", lambda p: (p / "modules.json").write_text(json.dumps(
                             json.loads((p / "modules.json").read_text()) + [{"path": "", "type": "x.LayerNorm"}]))),
                         ("bare", lambda p: (p / "modules.json").unlink())):
        copy = tmp_path / name
        shutil.copytree(stacked, copy)
        change(copy)
        assert embedding_dim_from_files(copy) is None, name


def test_a_database_build_checks_its_index_without_loading_the_model(tmp_path):
    code = ("import sys; from pathlib import Path; from retropipe.retrieval.build_database import _expected_dim; "
            "from retropipe.retrieval.config import RetrievalConfig; "
            "print(_expected_dim(RetrievalConfig(), Path(sys.argv[1])), 'sentence_transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "embeddings")], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["384", "False"], proc.stdout + proc.stderr[-2000:]


def test_sub_batches_by_count_on_a_cpu_and_by_padded_tokens_on_a_gpu():
    """A CPU's forwards take SUB_BATCH texts; a GPU's as many as fit GPU_SUB_BATCH_TOKENS padded
    tokens, so a job's longest texts go in small groups of their own instead of padding a big one."""
    from retropipe.retrieval.embed_job import GPU_SUB_BATCH_TOKENS, SUB_BATCH, sub_batches

    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(20, 60, 1000), [250, 240, 120]])     # a few long texts
    order = np.argsort(lengths, kind="stable")
    cpu = sub_batches(lengths, "cpu")
    assert [len(g) for g in cpu] == [SUB_BATCH] * (len(lengths) // SUB_BATCH) + [len(lengths) % SUB_BATCH]
    np.testing.assert_array_equal(np.concatenate(cpu), order)
    gpu = sub_batches(lengths, "cuda:0")
    np.testing.assert_array_equal(np.concatenate(gpu), order)                    # every text once, shortest first
    def padded(groups):
        return [len(g) * lengths[g].max() for g in groups]
    assert max(padded(gpu)) <= GPU_SUB_BATCH_TOKENS and len(gpu) <= 4
    # 512 at a time, the group of the three long texts would be padded to 250 tokens a text
    assert sum(padded(gpu)) < 0.5 * sum(padded(sub_batches(lengths, "cuda", sub_batch=512)))
    assert [len(g) for g in sub_batches(lengths, "cuda", sub_batch=100)][:2] == [100, 100]
    assert sub_batches([], "cuda") == [] and [list(g) for g in sub_batches([7], "cuda")] == [[0]]
    for bad in (0, -4):                                  # not a silent run of no forward at all
        with pytest.raises(ValueError, match="sub_batch"):
            sub_batches(lengths, "cpu", sub_batch=bad)
