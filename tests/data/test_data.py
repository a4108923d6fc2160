"""Data preparation: tokenizer, chunking, splits, bad input, determinism and resume."""

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retropipe.data.chunking import chunk_tokens, split_of
from retropipe.data.config import DataConfig
from retropipe.data.errors import ConfigError, DataError, TokenizerError
from retropipe.data.prepare import prepare, summary
from retropipe.data.store import ChunkStore
from retropipe.data.tokenizer import get_tokenizer, gpt2_vocab_dir, verify_gpt2_files

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "corpus" / "jargon_devil.jsonl.gz"


def write_jsonl(path, records):
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records))
    return path


def docs(n, words=40):
    return [{"id": f"d{i}", "text": " ".join(f"word{i}-{j}" for j in range(words))} for i in range(n)]


def run(cfg, out, **kw):
    return prepare(cfg, out, progress=False, **kw)


# --- tokenizer --------------------------------------------------------------------------

def test_gpt2_tokenizer_round_trip_offline(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("the tokenizer tried to open a network connection")
    monkeypatch.setattr(socket, "create_connection", no_network)
    get_tokenizer.cache_clear()
    enc = get_tokenizer("gpt2")
    text = "Hello world — naïve café, 12345 <|endoftext|>\n\ttabs"
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's own ids
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_corrupt_or_missing_vocab_is_a_clear_error(tmp_path):
    src = gpt2_vocab_dir()
    shutil.copy(src / "encoder.json", tmp_path / "encoder.json")
    with pytest.raises(TokenizerError, match="vocab.bpe"):
        verify_gpt2_files(tmp_path)
    (tmp_path / "vocab.bpe").write_bytes((src / "vocab.bpe").read_bytes()[:-10])
    with pytest.raises(TokenizerError, match=r"corrupt.*vocab.bpe"):
        get_tokenizer("gpt2", str(tmp_path))
    with pytest.raises(TokenizerError, match="not available offline"):
        get_tokenizer("no_such_encoding")


# --- chunking and splits ----------------------------------------------------------------

def test_chunk_tokens_pads_the_last_chunk():
    chunks, lengths = chunk_tokens(np.arange(10, dtype=np.int32), 4, pad_id=-7)
    assert chunks.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -7, -7]]
    assert lengths.tolist() == [4, 4, 2]


def test_chunks_never_cross_documents(tmp_path):
    records = [{"id": f"d{i}", "text": "x " * (i * 37 % 90 + 1)} for i in range(60)]
    cfg = DataConfig(corpus=str(write_jsonl(tmp_path / "c.jsonl", records)), chunk_len=16,
                     docs_per_shard=7, validation_fraction=0.2)
    run(cfg, tmp_path / "out")
    store, enc = ChunkStore(tmp_path / "out"), get_tokenizer("gpt2")
    texts = {r["id"]: r["text"] for r in records}
    documents = store.documents.to_pylist()
    for split in ("train", "validation"):
        chunks = store.split(split)
        for doc in (d for d in documents if d["split"] == split):
            ids = np.arange(doc["first_chunk"], doc["first_chunk"] + doc["num_chunks"])
            assert (chunks.doc_index[ids] == doc["doc_index"]).all()
            toks = chunks.tokens(ids)
            real = np.concatenate([t[:n] for t, n in zip(toks, chunks.lengths[ids])]).tolist()
            assert real == enc.encode_ordinary(texts[doc["source_id"]]) + [enc.eot_token]
            assert (chunks.lengths[ids][:-1] == 16).all()  # only a document's last chunk is short
    assert sum(len(store.split(s)) for s in ("train", "validation")) == sum(d["num_chunks"] for d in documents)


def test_split_is_deterministic_and_seeded():
    ids = [f"doc-{i}" for i in range(2000)]
    a = [split_of(i, 1, 0.1) for i in ids]
    assert a == [split_of(i, 1, 0.1) for i in ids]
    assert 120 < a.count("validation") < 280
    assert a != [split_of(i, 2, 0.1) for i in ids]


# --- determinism, resume, refusal -------------------------------------------------------

@pytest.mark.slow
def test_one_and_two_ray_workers_give_identical_bytes(tmp_path):
    from retropipe.launch.ray_utils import RayExecutor

    corpus = write_jsonl(tmp_path / "c.jsonl", docs(120))
    fingerprints = []
    executor = RayExecutor(num_cpus=2)
    try:
        for workers in (1, 2):
            cfg = DataConfig(corpus=str(corpus), docs_per_shard=16, num_workers=workers)
            fingerprints.append(run(cfg, tmp_path / f"w{workers}", executor=executor)["fingerprint"])
    finally:
        executor.close()
    assert fingerprints[0] == fingerprints[1]
    # A failed task reaches the user as one line, not Ray's traceback: RetroPipe's own error as it
    # is, anything else named with its task and, for a file error, the shared-storage hint.
    from retropipe.data.store import ChunkStore

    with pytest.raises(DataError, match=r"^no prepared data at /nowhere/data \(missing .*manifest.json\)"):
        list(executor(ChunkStore, [("/nowhere/data",)], 1))
    with pytest.raises(DataError, match=r"^a Ray task \(open\) failed: FileNotFoundError: .*/nowhere/x.*every Ray node mounts"):
        list(executor(open, [("/nowhere/x",)], 1))
    executor.close()
    for path in (tmp_path / "w1").rglob("*.arrow"):
        assert path.read_bytes() == (tmp_path / "w2" / path.relative_to(tmp_path / "w1")).read_bytes()


def test_resume_after_an_interrupted_run(tmp_path):
    cfg = DataConfig(corpus=str(write_jsonl(tmp_path / "c.jsonl", docs(100))), docs_per_shard=10)
    clean = run(cfg, tmp_path / "clean")["fingerprint"]

    def crashing_executor(fn, jobs, max_in_flight):
        for i, args in enumerate(jobs):
            if i == 4:
                raise KeyboardInterrupt  # as if the process died mid-run
            yield fn(*args)

    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path / "out", executor=crashing_executor)
    assert not (tmp_path / "out" / "manifest.json").exists()
    manifest = run(cfg, tmp_path / "out")
    assert manifest["run"]["blocks_resumed"] == 4
    assert manifest["fingerprint"] == clean
    assert run(cfg, tmp_path / "out")["skipped"]  # idempotent


def test_resume_after_sigkill(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs(300, words=60))
    out = tmp_path / "out"
    cfg = DataConfig(corpus=str(corpus), docs_per_shard=40)  # 8 blocks
    script = ("from data.config import DataConfig; from data.prepare import prepare; "
              f"prepare(DataConfig(corpus={str(corpus)!r}, docs_per_shard=40), {str(out)!r}, progress=False)")
    # The process kills itself (SIGKILL) right after its third block is on disk: data/stage.py fault_point.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RETROPIPE_KILL_AFTER": "prepare:3"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(p.name for p in (out / "blocks").glob("*.json")) == ["00000.json", "00001.json", "00002.json"]
    assert not (out / "manifest.json").exists() and not list(out.rglob("*.tmp"))
    resumed = run(cfg, out)
    assert resumed["run"]["blocks_resumed"] == 3
    assert resumed["fingerprint"] == run(cfg, tmp_path / "clean")["fingerprint"]


def test_a_schedulers_sigterm_stops_prepare_data_in_one_line_and_the_rerun_resumes(tmp_path):
    """SIGTERM to the driver of a local Ray (a Kubernetes eviction, `timeout`, a user's kill) after
    its third block: exit 75 with one line saying how to resume, not Ray's C++ signal dump."""
    corpus = write_jsonl(tmp_path / "c.jsonl", docs(300, words=60))
    cmd = [sys.executable, "launch/prepare_data.py", "--config", "configs/tiny.yaml", "--no-progress",
           "--set", f"workdir={tmp_path}", "--set", f"data.corpus={corpus}", "--set", "data.docs_per_shard=40"]
    env = {**os.environ, "RETROPIPE_KILL_AFTER": "prepare:3:SIGTERM"}
    stopped = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    last = stopped.stderr.strip().splitlines()[-1]
    assert stopped.returncode == 75 and last == ("prepare_data: stopped by SIGTERM; the finished work is kept: "
                                                 "rerun the same command to resume (exit 75)"), stopped.stderr[-3000:]
    assert "SIGTERM received" not in stopped.stderr and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert not (tmp_path / "data" / "manifest.json").exists() and not list(tmp_path.rglob("*.tmp"))
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "blocks resumed: 3" in resumed.stdout, resumed.stdout
    clean = run(DataConfig(corpus=str(corpus), docs_per_shard=40), tmp_path / "clean")
    assert ChunkStore(tmp_path / "data").manifest["fingerprint"] == clean["fingerprint"]


def test_different_config_into_same_directory_is_refused(tmp_path):
    corpus = str(write_jsonl(tmp_path / "c.jsonl", docs(20)))
    run(DataConfig(corpus=corpus), tmp_path / "out")
    with pytest.raises(DataError, match="different data config"):
        run(DataConfig(corpus=corpus, chunk_len=32), tmp_path / "out")
    run(DataConfig(corpus=corpus, num_workers=1), tmp_path / "out")  # workers do not change the output


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("line, kind, message", [
    (b'{"id": 1, "text": "ok"', "malformed_json", "malformed JSON"),
    (b'{"id": 1, "body": "no text"}', "missing_text", "record has no text field 'text'"),
    (b'{"id": 1, "text": 42}', "non_string_text", "field 'text' is int, not a string"),
    (b'["a", "list"]', "missing_text", "record has no text field"),
])
def test_bad_record_names_file_and_line_or_is_counted(tmp_path, line, kind, message):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "fine"}, line, {"id": "b", "text": "also"}])
    with pytest.raises(DataError, match=f"{corpus}:2: {message}"):
        run(DataConfig(corpus=str(corpus)), tmp_path / "err")
    assert not (tmp_path / "err" / "manifest.json").exists()
    manifest = run(DataConfig(corpus=str(corpus), on_bad_record="skip"), tmp_path / "skip")
    assert manifest["bad_records"] == {kind: 1}
    assert sum(s["documents"] for s in manifest["splits"].values()) == 2
    assert f"{kind}=1" in summary(manifest)


def test_repairs_are_counted_and_text_normalised(tmp_path):
    big = "lorem ipsum " * 300_000  # a single ~3.6 MB line
    records = [
        b'\xef\xbb\xbf{"id": "bom", "text": "starts with a BOM"}',
        b'{"id": "utf8", "text": "bad \xff\xfe bytes"}',
        b'{"id": "nul", "text": "nul\x00inside"}',
        b'{"id": "crlf", "text": "windows\\r\\nline"}\r',
        {"id": "empty", "text": "   \n"},
        {"id": "big", "text": big},
    ]
    manifest = run(DataConfig(corpus=str(write_jsonl(tmp_path / "c.jsonl", records)), validation_fraction=0.0),
                   tmp_path / "out")
    assert manifest["bad_records"] == {"empty_documents_skipped": 1, "invalid_utf8_replaced": 1,
                                       "nul_bytes_removed": 1}
    store, enc = ChunkStore(tmp_path / "out"), get_tokenizer("gpt2")
    docs_ = {d["source_id"]: d for d in store.documents.to_pylist()}
    assert set(docs_) == {"bom", "utf8", "nul", "crlf", "big"}
    train = store.split("train")

    def text_of(source_id):
        d = docs_[source_id]
        ids = np.arange(d["first_chunk"], d["first_chunk"] + d["num_chunks"])
        toks = np.concatenate([t[:n] for t, n in zip(train.tokens(ids), train.lengths[ids])])
        return enc.decode(toks[:-1].tolist())

    assert text_of("crlf") == "windows\nline" and text_of("nul") == "nulinside"
    assert text_of("utf8") == "bad \ufffd\ufffd bytes" and text_of("bom") == "starts with a BOM"
    assert docs_["big"]["num_bytes"] == len(big.encode())


def test_txt_directory_gz_and_parquet_readers(tmp_path):
    (tmp_path / "txt" / "sub").mkdir(parents=True)
    (tmp_path / "txt" / "a.txt").write_text("first text file")
    (tmp_path / "txt" / "sub" / "b.txt").write_bytes(b"second\r\nfile")
    with gzip.open(tmp_path / "txt" / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "gz", "text": "from gzip"}) + "\n")
    pq.write_table(pa.table({"text": ["pq one", "pq two"], "id": ["p1", "p2"]}), tmp_path / "txt" / "d.parquet")
    manifest = run(DataConfig(corpus=str(tmp_path / "txt"), validation_fraction=0.0), tmp_path / "out")
    ids = ChunkStore(tmp_path / "out").documents.column("source_id").to_pylist()
    assert ids == ["a.txt", "gz", "p1", "p2", "sub/b.txt"]
    assert manifest["splits"]["train"]["documents"] == 5
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet: no column 'text'"):
        run(DataConfig(corpus=str(tmp_path / "bad.parquet")), tmp_path / "bad")


def test_jsonl_zst_across_frames_and_saved_datasets(tmp_path):
    import datasets
    import zstandard

    records = [json.dumps(r).encode() + b"\n" for r in
               [{"id": "z1", "text": "first zstd frame"}, {"text": "second frame, no id"}, {"id": "z3", "text": "ü"}]]
    zst = tmp_path / "c.jsonl.zst"  # two frames end to end, as `cat a.zst b.zst` makes
    zst.write_bytes(zstandard.ZstdCompressor().compress(b"".join(records[:1]))
                    + zstandard.ZstdCompressor().compress(b"".join(records[1:])))
    manifest = run(DataConfig(corpus=str(zst), validation_fraction=0.0), tmp_path / "zst")
    docs_ = ChunkStore(tmp_path / "zst").documents.to_pylist()
    assert [d["source_id"] for d in docs_] == ["z1", "c.jsonl.zst:2", "z3"]
    assert [d["num_bytes"] for d in docs_] == [16, 19, 2] and manifest["splits"]["train"]["documents"] == 3

    texts = ["a saved dataset", "its second row", "", "fourth"]
    datasets.Dataset.from_dict({"body": texts, "key": ["k0", "k1", "k2", None]}).save_to_disk(tmp_path / "ds")
    cfg = DataConfig(corpus=str(tmp_path / "ds"), text_field="body", id_field="key", validation_fraction=0.0)
    manifest = run(cfg, tmp_path / "ds-out")
    assert [d["source_id"] for d in ChunkStore(tmp_path / "ds-out").documents.to_pylist()] == ["k0", "k1", "ds:4"]
    assert manifest["bad_records"] == {"empty_documents_skipped": 1}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t0", "t1"]}),
                          "test": datasets.Dataset.from_dict({"text": ["s0"]})}).save_to_disk(tmp_path / "dd")
    run(DataConfig(corpus=str(tmp_path / "dd"), validation_fraction=0.0), tmp_path / "dd-out")
    ids = ChunkStore(tmp_path / "dd-out").documents.column("source_id").to_pylist()
    assert ids == ["dd/train:1", "dd/train:2", "dd/test:1"]  # every split, in the saved order


def test_bad_zst_and_saved_datasets_are_clear_errors(tmp_path, monkeypatch):
    import datasets
    import zstandard

    whole = zstandard.ZstdCompressor().compress(b"".join(json.dumps(r).encode() + b"\n" for r in docs(200)))
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(DataError, match=r"cut.jsonl.zst: truncated zstd file"):
        run(DataConfig(corpus=str(tmp_path / "cut.jsonl.zst")), tmp_path / "o1")
    (tmp_path / "junk.jsonl.zst").write_bytes(b"not zstd at all" * 10)
    with pytest.raises(DataError, match=r"junk.jsonl.zst: not a readable zstd file"):
        run(DataConfig(corpus=str(tmp_path / "junk.jsonl.zst")), tmp_path / "o2")
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(tmp_path / "ds")
    with pytest.raises(DataError, match=r"ds: no column 'text' \(data.text_field\); columns are \['body'\]"):
        run(DataConfig(corpus=str(tmp_path / "ds")), tmp_path / "o3")
    (tmp_path / "ds" / "state.json").write_text("{ not json")
    with pytest.raises(DataError, match=r"ds: not a readable saved Hugging Face dataset"):
        run(DataConfig(corpus=str(tmp_path / "ds")), tmp_path / "o4")
    (tmp_path / "ds" / "state.json").unlink()
    (tmp_path / "ds" / "dataset_info.json").unlink()
    with pytest.raises(DataError, match=r"holds .arrow files but is not a directory saved by datasets"):
        run(DataConfig(corpus=str(tmp_path / "ds")), tmp_path / "o5")
    datasets.Dataset.from_dict({"text": ["y"]}).save_to_disk(tmp_path / "dd")
    for module, corpus in (("zstandard", "cut.jsonl.zst"), ("datasets", "dd")):
        monkeypatch.setitem(sys.modules, module, None)  # as if the `corpora` extra were not installed
        with pytest.raises(DataError, match=rf"needs the {module} package: pip install 'retropipe\[corpora\]'"):
            run(DataConfig(corpus=str(tmp_path / corpus)), tmp_path / f"no-{module}")
        monkeypatch.undo()
    for out in ("o1", "o2", "o3", "o4", "o5"):
        assert not (tmp_path / out / "manifest.json").exists()


def test_missing_corpus_and_store_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no input files found"):
        run(DataConfig(corpus=str(tmp_path / "nothing-*.jsonl")), tmp_path / "out")
    with pytest.raises(DataError, match="no prepared data"):
        ChunkStore(tmp_path / "nowhere")


# --- the demo's data step -----------------------------------------------------------------

@pytest.mark.slow
def test_prepare_data_cli_on_the_shipped_corpus(tmp_path):
    cmd = [sys.executable, "launch/prepare_data.py", "--config", "configs/tiny.yaml",
           "--set", f"workdir={tmp_path}", "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation" in proc.stdout and "tokens/s" in proc.stdout
    assert " INFO " not in proc.stderr and "Token authentication" not in proc.stderr  # Ray kept quiet
    store = ChunkStore(tmp_path / "data")
    assert store.manifest["splits"]["train"]["documents"] + store.manifest["splits"]["validation"]["documents"] == 3306
    assert (tmp_path / "data" / "config.yaml").exists()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already complete" in again.stdout


def test_collapsed_whitespace_makes_reflowed_copies_tokenize_alike(tmp_path):
    from retropipe.data.prepare import config_fingerprint
    from retropipe.data.stage import fingerprint, output_settings

    # The Jargon File and FOLDOC hold the same sentence wrapped and indented differently.
    records = [{"id": "jargon", "text": "hacker ethic\n n.\n\n    1. The belief that information-sharing\n"
                                        "    is good.\n"},
               {"id": "foldoc", "text": "hacker ethic\n\n   <philosophy> 1. The belief that\n"
                                        "   information-sharing is good."}]
    corpus = str(write_jsonl(tmp_path / "c.jsonl", records))
    kept = run(DataConfig(corpus=corpus, validation_fraction=0.0), tmp_path / "keep")
    collapsed = run(DataConfig(corpus=corpus, validation_fraction=0.0, whitespace="collapse"), tmp_path / "collapse")
    enc = get_tokenizer("gpt2")
    sentence = enc.encode_ordinary(" 1. The belief that information-sharing is good.")

    def tokens(out, source_id):
        store = ChunkStore(tmp_path / out)
        d = next(d for d in store.documents.to_pylist() if d["source_id"] == source_id)
        train = store.split("train")
        ids = np.arange(d["first_chunk"], d["first_chunk"] + d["num_chunks"])
        return np.concatenate([t[:n] for t, n in zip(train.tokens(ids), train.lengths[ids])]).tolist(), d["num_bytes"]

    def holds(seq, sub):
        return any(seq[i:i + len(sub)] == sub for i in range(len(seq)))

    assert not holds(tokens("keep", "jargon")[0], sentence) and not holds(tokens("keep", "foldoc")[0], sentence)
    jargon, foldoc = tokens("collapse", "jargon"), tokens("collapse", "foldoc")
    assert holds(jargon[0], sentence) and holds(foldoc[0], sentence)
    assert jargon[1] == len("hacker ethic n. 1. The belief that information-sharing is good.")  # bytes as collapsed
    assert kept["fingerprint"] != collapsed["fingerprint"]
    # "keep" is what data was before the key existed: prepared directories keep their fingerprint.
    settings = {k: v for k, v in output_settings(DataConfig()).items() if k != "whitespace"}
    assert config_fingerprint(DataConfig()) == fingerprint({**settings, "manifest_version": 2})
    with pytest.raises(ConfigError, match="data.whitespace"):
        DataConfig(whitespace="strip")
