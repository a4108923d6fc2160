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
from retropipe.retrieval import RetrievalError
from retropipe.retrieval.bert import plain_bert_layout
from retropipe.retrieval.embed_job import cached_embedder, embed, load_embedder, token_lengths
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


def cls_pooling_without_normalize(model):
    (model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (model / "modules.json").write_text(json.dumps(json.loads((model / "modules.json").read_text())[:2]))


def a_pretraining_head_beside_the_weights(model):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model / "model.safetensors"))
    save_file({**weights, "cls.predictions.bias": weights["embeddings.word_embeddings.weight"][:, 0].clone()},
              str(model / "model.safetensors"))


def config_defaults_left_out(model):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                   if k not in ("layer_norm_eps", "type_vocab_size", "hidden_act")}))


@pytest.mark.parametrize("change", [
    cls_pooling_without_normalize,
    lambda model: edit_json(model / "sentence_bert_config.json", do_lower_case=True),  # its normalizer lower-cases too
    a_pretraining_head_beside_the_weights,                                               # transformers leaves it too
    config_defaults_left_out,                                                            # BertConfig's defaults
], ids=["cls pooling, no normalize", "lower case twice", "a pre-training head", "config defaults"])
def test_other_bert_directories_are_computed_too_bit_for_bit(tmp_path, change):
    model = copy_of_bundled(tmp_path, "changed")
    change(model)
    plain, reference = load_embedder(model), load_embedder(model, backend="sentence-transformers")
    assert type(plain).__name__ == "PlainBert"
    texts = corpus_texts(20) + EDGES
    assert np.array_equal(embed(plain, texts), embed(reference, texts))


def left(model, key):
    edit_json(model / "tokenizer_config.json", **{key: "left"})


# Directories transformers or sentence-transformers would read otherwise than tokenizer.json and the
# configs say here: each loads through sentence-transformers.
OTHER_LAYOUTS = {
    "max pooling": lambda m: edit_json(m / "1_Pooling" / "config.json", pooling_mode_mean_tokens=False,
                                       pooling_mode_max_tokens=True),
    "dense": lambda m: (m / "modules.json").write_text(json.dumps(json.loads((m / "modules.json").read_text())[:2] + [
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}])),
    "roberta": lambda m: edit_json(m / "config.json", model_type="roberta", architectures=["RobertaModel"]),
    "a decoder": lambda m: edit_json(m / "config.json", is_decoder=True),
    "no safetensors": lambda m: (m / "model.safetensors").unlink(),
    "truncated": lambda m: (m / "config_sentence_transformers.json").write_text(json.dumps({"truncate_dim": 64})),
    "longer than its positions": lambda m: edit_json(m / "sentence_bert_config.json", max_seq_length=1024),
    "tokenizer arguments": lambda m: edit_json(m / "sentence_bert_config.json", tokenizer_args={"model_max_length": 64}),
    # transformers builds the normalizer from tokenizer_config.json, not from tokenizer.json
    "cased by its tokenizer config": lambda m: edit_json(m / "tokenizer_config.json", do_lower_case=False),
    "accents kept by its tokenizer config": lambda m: edit_json(m / "tokenizer_config.json", strip_accents=False),
    "another normalizer": lambda m: edit_json(m / "tokenizer.json", normalizer={"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, json.loads((m / "tokenizer.json").read_text())["normalizer"]]}),
    "truncated on the left": lambda m: left(m, "truncation_side"),
    "padded on the left": lambda m: left(m, "padding_side"),
    # transformers adds or renames special tokens that tokenizer.json does not have
    "a bos token": lambda m: edit_json(m / "tokenizer_config.json", bos_token="[unused1]"),
    "an added-tokens file": lambda m: (m / "added_tokens.json").write_text(json.dumps({"[unused0]": 1})),
    "another cls token": lambda m: edit_json(m / "special_tokens_map.json", cls_token="[unused2]"),
    "no mask among tokenizer.json's added tokens": lambda m: edit_json(m / "tokenizer.json", added_tokens=[
        a for a in json.loads((m / "tokenizer.json").read_text())["added_tokens"] if a["content"] != "[MASK]"]),
    # the config asks transformers for another computation
    "eager attention": lambda m: edit_json(m / "config.json", attn_implementation="eager"),
    "fp16 weights asked for": lambda m: edit_json(m / "config.json", dtype="float16"),
    "a module outside sentence-transformers": lambda m: (m / "modules.json").write_text(json.dumps(
        [{**mod, "type": "torch.nn.Normalize"} if mod["type"].endswith("Normalize") else mod
         for mod in json.loads((m / "modules.json").read_text())])),
    "two copies of the weights": lambda m: two_copies_of_the_weights(m),
}


def two_copies_of_the_weights(model):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model / "model.safetensors"))
    save_file({**weights, **{f"bert.{k}": v + 1 for k, v in weights.items()}}, str(model / "model.safetensors"))


@pytest.mark.parametrize("change", list(OTHER_LAYOUTS))
def test_any_other_layout_loads_through_sentence_transformers(tmp_path, change):
    model = copy_of_bundled(tmp_path, change.replace(" ", "_"))
    OTHER_LAYOUTS[change](model)
    assert plain_bert_layout(model) is None and embedding_backend(model) == "sentence-transformers"
    if change == "cased by its tokenizer config":  # a model sentence-transformers loads: embedded as before
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
            "from retropipe.retrieval.embed_job import embed, load_embedder, resolve_model_path\n"
            "print(embed(load_embedder(resolve_model_path('')), ['a text']).shape)\n"
            "print(sorted(m for m in ('transformers', 'sentence_transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["(1, 384)", "[]"]
