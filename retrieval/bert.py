"""A sentence-transformers BERT model computed in plain torch, from its own files.

    model = load_plain_bert(path)        # None where the directory is not this layout
    ids = model.token_ids(texts)         # WordPiece ids, [CLS] … [SEP], truncated as sentence-transformers does
    pooled = model.embed_ids(ids)        # (b, d) in the model's dtype, pooled (and normalised where it says so)

sentence-transformers saves a BERT sentence embedder (the bundled all-MiniLM-L6-v2 among them) as a
Transformer module (a transformers `BertModel`), a Pooling module (mean or CLS) and often a
Normalize. Loading it through sentence-transformers imports that package and transformers, 5–6 s
of one core in every process that embeds (each Ray actor of a database build, every generate.py
that retrieves), and its forward runs through transformers' general machinery. This computes the
same function from the same files: the weights from model.safetensors, the tokens from
tokenizer.json through `tokenizers`, the width, pooling and length from the configs; its vectors
are sentence-transformers' bit for bit (tests/retrieval/test_bert.py). The layout is accepted only
where every file holds nothing but keys known to leave the computation as it is here (CONFIG_KEYS,
TOKENIZER_CONFIG_KEYS, SENTENCE_BERT_KEYS, BERT's five special tokens and no others), and where
transformers' tokenizer would compute what tokenizer.json does (it rebuilds the normalizer and the
[CLS] … [SEP] template from tokenizer_config.json, keeping only the vocabulary of tokenizer.json).
Anything else (another architecture, pooling or tokenizer, a Dense layer, a truncation, left
padding or truncation, added special tokens, an attention implementation or dtype asked for,
settings of sentence-transformers' own, the format sentence-transformers 6 saves, weights only as
a pickle or twice over) is None here and loads through sentence-transformers (retrieval/embedder.py).
Weights missing for the config are an error here, where transformers would start them at random.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


# The modules (modules.json, by class name) computed here.
LAYOUTS = (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"])
# Weights in the files that the sentence embedding never reads.
UNUSED_WEIGHTS = ("pooler.", "embeddings.position_ids")
# transformers' BertConfig defaults, for keys a config.json leaves out.
BERT_DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512, "type_vocab_size": 2,
                 "layer_norm_eps": 1e-12, "position_embedding_type": "absolute", "is_decoder": False,
                 "add_cross_attention": False}
# transformers' BertTokenizer defaults (tokenizer_config.json), from which it builds its normalizer and template.
TOKENIZER_DEFAULTS = {"do_lower_case": True, "strip_accents": None, "tokenize_chinese_chars": True, "unk_token": "[UNK]",
                      "cls_token": "[CLS]", "sep_token": "[SEP]", "padding_side": "right", "truncation_side": "right",
                      "tokenizer_class": "BertTokenizer"}
# sentence_bert_config.json keys understood here (sentence-transformers reads more: tokenizer_args, model_args, ...).
SENTENCE_BERT_KEYS = {"max_seq_length", "do_lower_case"}
# BERT's special tokens as BertTokenizer names them by default: a directory that names others, or adds
# any (bos, additional or extra special tokens, added_tokens.json), tokenizes otherwise in transformers.
SPECIAL_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                  "mask_token": "[MASK]"}
# The keys each file may hold, all of which leave the computation as it is here (the rest, e.g. an
# attention implementation, a dtype, a quantization, feed-forward chunking, bos or added tokens, may not).
CONFIG_KEYS = {*BERT_DEFAULTS, "architectures", "model_type", "hidden_dropout_prob", "attention_probs_dropout_prob",
               "initializer_range", "pad_token_id", "use_cache", "transformers_version", "gradient_checkpointing",
               "_name_or_path", "classifier_dropout"}
TOKENIZER_CONFIG_KEYS = {*TOKENIZER_DEFAULTS, *SPECIAL_TOKENS, "name_or_path", "do_basic_tokenize", "never_split",
                         "model_max_length", "clean_up_tokenization_spaces"}


# The pooling modes of a sentence-transformers Pooling module's config: the legacy flags, one per
# mode (named here as the newer format names them), and the newer `pooling_mode` (a name or a list
# of names). Each mode adds a width's worth.
LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                        "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def pooling_modes(pooling: dict) -> list[str]:
    """The modes a Pooling module's config.json names, in either format; a legacy flag this does
    not know counts as a mode of its own name."""
    modes = pooling.get("pooling_mode")
    if modes is None:
        return [LEGACY_POOLING_FLAGS.get(flag, flag) for flag, on in pooling.items()
                if flag.startswith("pooling_mode_") and on]
    return [modes] if isinstance(modes, str) else list(modes)


def plain_bert_layout(path: Path) -> dict | None:
    """What load_plain_bert needs from a sentence-transformers directory (config, pooling mode,
    max length, normalize), or None where it is not exactly Transformer(BertModel) →
    Pooling(mean | cls) → [Normalize], with safetensors weights and a tokenizer as transformers
    would build it (`_tokenizer_as_transformers_builds_it`)."""
    def read(p: Path) -> dict:
        return json.loads(p.read_text())

    try:
        modules = read(path / "modules.json")
        if [m["type"].rsplit(".", 1)[-1] for m in modules] not in LAYOUTS or modules[0].get("path") \
                or not all(m["type"].startswith("sentence_transformers.") for m in modules):
            return None
        config, st = _bert_config(read(path / "config.json")), read(path / "sentence_bert_config.json")
        names = _weight_names(path / "model.safetensors")
        if any(k.startswith("bert.") and k.removeprefix("bert.") in names for k in names):
            return None  # two copies of a weight: which one transformers loads is its own rule
        specials = path / "special_tokens_map.json"
        if (path / "added_tokens.json").exists() or (specials.exists() and read(specials) != SPECIAL_TOKENS):
            return None
        pooling, tokenizer = read(path / modules[1]["path"] / "config.json"), read(path / "tokenizer.json")
        tokenizer_config = read(path / "tokenizer_config.json") if (path / "tokenizer_config.json").exists() else {}
        settings = path / "config_sentence_transformers.json"
        if settings.exists() and read(settings).get("truncate_dim") is not None:
            return None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    modes = pooling_modes(pooling)
    length = st.get("max_seq_length")
    if not (config and modes in (["mean"], ["cls"]) and set(st) <= SENTENCE_BERT_KEYS
            and isinstance(length, int) and 0 < length <= config["max_position_embeddings"]
            and pooling.get("word_embedding_dimension", pooling.get("embedding_dimension")) == config["hidden_size"]
            and _tokenizer_as_transformers_builds_it(tokenizer, tokenizer_config, bool(st.get("do_lower_case")))):
        return None
    return {"config": config, "pooling": modes[0], "max_length": length, "normalize": len(modules) == 3}


def _weight_names(file: Path) -> set[str]:
    """The tensor names of a safetensors file, from its header (8 bytes of length, then JSON)."""
    with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return set(header) - {"__metadata__"}


def _bert_config(config: dict) -> dict | None:
    """config.json with BertConfig's defaults filled in, where it is a plain bidirectional BertModel."""
    c = {**BERT_DEFAULTS, **config}
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "max_position_embeddings", "type_vocab_size")
    plain = (set(config) <= CONFIG_KEYS and all(type(c[k]) is int and c[k] > 0 for k in sizes)
             and c["hidden_size"] % c["num_attention_heads"] == 0
             and (c.get("pad_token_id") is None or 0 <= c["pad_token_id"] < c["vocab_size"])
             and c.get("model_type") == "bert" and c.get("architectures", ["BertModel"]) == ["BertModel"]
             and c["hidden_act"] == "gelu" and c["position_embedding_type"] == "absolute"
             and not c["is_decoder"] and not c["add_cross_attention"])
    return c if plain else None


def _tokenizer_as_transformers_builds_it(tokenizer: dict, tokenizer_config: dict, lower_case: bool) -> bool:
    """Whether tokenizer.json computes what transformers' BertTokenizer computes from these files:
    it keeps the vocabulary and rebuilds the normalizer, pre-tokenizer and [CLS] A [SEP] template
    from tokenizer_config.json; pads and truncates on the side that file (or tokenizer.json) names.
    sentence_bert_config's do_lower_case lower-cases before a normalizer that does so anyway."""
    t = {**TOKENIZER_DEFAULTS, **tokenizer_config}
    if set(tokenizer_config) - TOKENIZER_CONFIG_KEYS or any(t.get(k, v) != v for k, v in SPECIAL_TOKENS.items()):
        return False
    model, post = tokenizer.get("model") or {}, tokenizer.get("post_processor") or {}
    added = {(a.get("content"), a.get("id"), a.get("special"), a.get("single_word"), a.get("lstrip"), a.get("rstrip"),
              a.get("normalized")) for a in tokenizer.get("added_tokens") or []}
    normalizer = {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": t["tokenize_chinese_chars"],
                  "strip_accents": t["strip_accents"], "lowercase": t["do_lower_case"]}
    single = [{"SpecialToken": {"id": t["cls_token"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
              {"SpecialToken": {"id": t["sep_token"], "type_id": 0}}]
    vocab, special = model.get("vocab") or {}, post.get("special_tokens") or {}
    sides = [t["padding_side"], t["truncation_side"],
             *((tokenizer.get(key) or {}).get("direction", "Right") for key in ("truncation", "padding"))]
    return (t["tokenizer_class"] in ("BertTokenizer", "BertTokenizerFast")
            and added == {(token, vocab.get(token), True, False, False, False, False) for token in SPECIAL_TOKENS.values()}
            and tokenizer.get("normalizer") == normalizer and tokenizer.get("pre_tokenizer") == {"type": "BertPreTokenizer"}
            and post.get("type") == "TemplateProcessing" and post.get("single") == single
            and all((special.get(t[k]) or {}).get("ids") == [vocab.get(t[k])] for k in ("cls_token", "sep_token"))
            and model.get("type") == "WordPiece" and model.get("unk_token") == t["unk_token"]
            and model.get("continuing_subword_prefix", "##") == "##" and model.get("max_input_chars_per_word", 100) == 100
            and all(str(side).lower() == "right" for side in sides) and (t["do_lower_case"] or not lower_case))


def load_plain_bert(path: Path) -> "PlainBert | None":
    """The model of a sentence-transformers BERT directory, fp32 on the CPU, in eval mode; None
    where plain_bert_layout says it is another layout. Raises what reading the files raises."""
    layout = plain_bert_layout(path)
    if layout is None:
        return None
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    raw = load_file(str(path / "model.safetensors"))
    model = PlainBert(layout["config"], layout["pooling"], layout["normalize"])
    weights = {k.removeprefix("bert."): v for k, v in raw.items() if not k.removeprefix("bert.").startswith(UNUSED_WEIGHTS)}
    expected = model.state_dict()
    reshaped = {k for k in expected.keys() & weights.keys() if expected[k].shape != weights[k].shape}
    # Weights the model has no place for (a pre-training head's) are left, as transformers leaves them.
    weights = {k: v for k, v in weights.items() if k in expected}
    for what, names in (("lacks", expected.keys() - weights.keys()), ("has another shape for", reshaped)):
        if names:  # one line: the first name and how many more
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise ValueError(f"model.safetensors {what} {sorted(names)[0]}{more} of the model config.json describes")
    model.load_state_dict(weights)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()  # padded per sub-batch by embed_ids, to the sub-batch's longest text
    tokenizer.enable_truncation(max_length=layout["max_length"])  # [CLS] and [SEP] included, as transformers counts
    model.tokenizer = tokenizer
    return model.eval()


class BertLayer(nn.Module):
    """A post-LayerNorm BERT layer: self-attention, then a GELU MLP, each added and normalised.
    Submodules are named as transformers' BertLayer's, so its state dict loads as is."""

    def __init__(self, d: int, inner: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.attention = nn.ModuleDict({
            "self": nn.ModuleDict({name: nn.Linear(d, d) for name in ("query", "key", "value")}),
            "output": nn.ModuleDict({"dense": nn.Linear(d, d), "LayerNorm": nn.LayerNorm(d, eps=eps)})})
        self.intermediate = nn.ModuleDict({"dense": nn.Linear(d, inner)})
        self.output = nn.ModuleDict({"dense": nn.Linear(inner, d), "LayerNorm": nn.LayerNorm(d, eps=eps)})

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        # x (b, n, d); keys (b, 1, 1, n) bool, True = a real token (padding is never attended to), or None: all are.
        b, n, d = x.shape
        attn = self.attention
        q, k, v = (attn["self"][name](x).view(b, n, self.heads, -1).transpose(1, 2)      # (b, h, n, c)
                   for name in ("query", "key", "value"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keys).transpose(1, 2).reshape(b, n, d)
        x = attn["output"]["LayerNorm"](attn["output"]["dense"](y) + x)
        y = self.output["dense"](F.gelu(self.intermediate["dense"](x)))                # transformers' "gelu": erf
        return self.output["LayerNorm"](y + x)


class PlainBert(nn.Module):
    """BertModel's embeddings and layers, then the Pooling module's mean or CLS and, where the
    directory has one, the Normalize module's (in the model's dtype, as sentence-transformers)."""

    def __init__(self, config: dict, pooling: str, normalize: bool):
        super().__init__()
        d, eps = config["hidden_size"], config["layer_norm_eps"]        # config: _bert_config's, defaults filled in
        self.pooling, self.normalize, self.dim = pooling, normalize, d
        self.embeddings = nn.ModuleDict({
            "word_embeddings": nn.Embedding(config["vocab_size"], d),
            "position_embeddings": nn.Embedding(config["max_position_embeddings"], d),
            "token_type_embeddings": nn.Embedding(config["type_vocab_size"], d),
            "LayerNorm": nn.LayerNorm(d, eps=eps)})
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList(
            BertLayer(d, config["intermediate_size"], config["num_attention_heads"], eps)
            for _ in range(config["num_hidden_layers"]))})
        self.tokenizer = None  # a tokenizers.Tokenizer, set by load_plain_bert

    @property
    def device(self) -> torch.device:
        return self.embeddings["word_embeddings"].weight.device

    def get_embedding_dimension(self) -> int:
        return self.dim

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def embed_ids(self, ids: list[list[int]]) -> torch.Tensor:
        """(b, d) pooled embeddings of b token-id lists, padded to the longest on the model's device."""
        # Laid out by numpy from one flat array: padding each Python list and converting the lists
        # took 13 µs a text on the 2-core EPYC, against 36 µs a chunk for the whole of an H200's
        # embedding (docs/benchmarks.md); this takes 1.3.
        lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))                         # (b,)
        real = np.arange(int(lengths.max())) < lengths[:, None]                                # (b, n)
        tokens = np.zeros(real.shape, np.int64)
        tokens[real] = np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=int(lengths.sum()))
        return self(torch.from_numpy(tokens).to(self.device), torch.from_numpy(real).to(self.device))

    def forward(self, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        # tokens (b, n) int64; real (b, n) bool, False at padding → (b, d).
        emb = self.embeddings
        x = emb["word_embeddings"](tokens) + emb["token_type_embeddings"].weight[0]       # token type 0 throughout
        x = emb["LayerNorm"](x + emb["position_embeddings"].weight[:tokens.shape[1]])
        # No mask where no text is padded (most sub-batches: embed sorts texts by length), as
        # transformers passes none: SDPA then runs its unmasked kernel.
        keys = None if bool(real.all()) else real[:, None, None, :]
        for layer in self.encoder["layer"]:
            x = layer(x, keys)
        if self.pooling == "cls":
            pooled = x[:, 0]
        else:  # as sentence-transformers' Pooling: a half-precision model's mean is summed in fp32
            acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
            mask = real[..., None].to(x.dtype)
            pooled = ((x * mask).sum(1, dtype=acc) / mask.sum(1, dtype=acc).clamp(min=1e-9)).to(x.dtype)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled
