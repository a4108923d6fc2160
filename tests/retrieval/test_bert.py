"""retrieval/bert.py: a sentence-transformers BERT directory computed in plain torch.

The claim is exact: from the same files, the same vectors as sentence-transformers, bit for bit,
in fp32 and bf16; and the same WordPiece lengths (embed sorts by them). Directories of any other
layout are left to sentence-transformers.
"""

import gzip
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from retropipe.data.config import DEFAULT_CORPUS
from retropipe.data.errors import RetrievalError
from retropipe.retrieval.bert import plain_bert_layout
from retropipe.retrieval.embed import cached_embedder, embed, load_embedder, token_lengths
from retropipe.retrieval.embedder import embedding_backend, resolve_model_path
from tests.corpora import ROOT

EDGES = ["", "   ", "  leading and trailing  ", "naïve café — Ünïcödé 日本語 ½", "tab\tand\nnewline",
         "word " * 600]  # the last is cut at the model's 256 WordPiece tokens


def corpus_texts(n: int, width: int = 320) -> list[str]:
    """n pieces of the embedded corpus, each about `width` characters, as chunks decode to."""
    texts = []
    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            texts += [text[i:i + width] for i in range(0, min(len(text), 4 * width), width)]
            if len(texts) >= n:
                return texts[:n]
    return texts


def test_the_bundled_model_gives_sentence_transformers_vectors_bit_for_bit():
    bundled = resolve_model_path("")
    plain, reference = cached_embedder(str(bundled)), cached_embedder(str(bundled), backend="sentence-transformers")
    assert type(plain).__name__ == "PlainBert" and type(reference).__name__ == "SentenceTransformer"
    assert embedding_backend(bundled) == "torch"
    texts = corpus_texts(120) + EDGES
    assert token_lengths(plain, texts) == token_lengths(reference, texts)
    assert max(token_lengths(plain, texts)) == 256
    ours = embed(plain, texts)
    assert ours.shape == (len(texts), 384) and np.array_equal(ours, embed(reference, texts))
    encoded = reference.encode(texts, batch_size=7, normalize_embeddings=True, convert_to_numpy=True)
    np.testing.assert_allclose(ours, encoded, atol=2e-5)  # its own batching pads differently


def test_bf16_gives_sentence_transformers_bf16_vectors_bit_for_bit():
    """A bf16 model runs every op in bf16 (and this CPU may emulate it: a few short texts)."""
    bundled = resolve_model_path("")
    texts = corpus_texts(6, width=80) + EDGES[:4]
    ours = embed(load_embedder(bundled, precision="bf16"), texts)
    assert np.array_equal(ours, embed(load_embedder(bundled, precision="bf16", backend="sentence-transformers"), texts))
    assert 0 < np.abs(ours - embed(cached_embedder(str(bundled)), texts)).max() < 0.02


def copy_of_bundled(tmp_path, name: str):
    copy = tmp_path / name
    shutil.copytree(resolve_model_path(""), copy)
    return copy


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_cls_pooling_without_normalize_is_computed_too(tmp_path):
    model = copy_of_bundled(tmp_path, "cls")
    (model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    modules = json.loads((model / "modules.json").read_text())
    (model / "modules.json").write_text(json.dumps(modules[:2]))
    plain, reference = load_embedder(model), load_embedder(model, backend="sentence-transformers")
    assert type(plain).__name__ == "PlainBert" and not plain.normalize and plain.pooling == "cls"
    texts = corpus_texts(20) + EDGES
    assert np.array_equal(embed(plain, texts), embed(reference, texts))


@pytest.mark.parametrize("change", ["max pooling", "dense", "roberta", "lower case", "no safetensors", "truncated",
                                    "longer than its positions"])
def test_any_other_layout_loads_through_sentence_transformers(tmp_path, change):
    model = copy_of_bundled(tmp_path, change.replace(" ", "_"))
    if change == "max pooling":
        edit_json(model / "1_Pooling" / "config.json", pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    elif change == "dense":
        modules = json.loads((model / "modules.json").read_text())
        (model / "modules.json").write_text(json.dumps(modules[:2] + [
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    elif change == "roberta":
        edit_json(model / "config.json", model_type="roberta", architectures=["RobertaModel"])
    elif change == "lower case":
        edit_json(model / "sentence_bert_config.json", do_lower_case=True)
    elif change == "no safetensors":
        (model / "model.safetensors").unlink()
    elif change == "truncated":
        (model / "config_sentence_transformers.json").write_text(json.dumps({"truncate_dim": 64}))
    else:
        edit_json(model / "sentence_bert_config.json", max_seq_length=1024)
    assert plain_bert_layout(model) is None and embedding_backend(model) == "sentence-transformers"
    if change == "lower case":  # still a model sentence-transformers loads: it is, and embeds as before
        loaded = load_embedder(model)
        assert type(loaded).__name__ == "SentenceTransformer" and embed(loaded, ["a text"]).shape == (1, 384)


def test_weights_that_do_not_match_the_config_are_an_error_naming_the_key(tmp_path):
    model = copy_of_bundled(tmp_path, "mismatched")
    edit_json(model / "config.json", num_hidden_layers=7)
    with pytest.raises(RetrievalError, match="retrieval.embedder.*encoder.layer.6"):
        load_embedder(model)


def test_embedding_with_the_bundled_model_imports_neither_library():
    """What the plain path saves: importing sentence-transformers and transformers, 5–6 s of one
    core in every process that embeds (docs/benchmarks.md)."""
    code = ("import sys\n"
            "from retropipe.retrieval.embed import embed, load_embedder, resolve_model_path\n"
            "print(embed(load_embedder(resolve_model_path('')), ['a text']).shape)\n"
            "print(sorted(m for m in ('transformers', 'sentence_transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["(1, 384)", "[]"]
