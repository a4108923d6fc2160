"""A sentence-transformers BERT model computed in plain torch, from its own files.

    model = load_plain_bert(path)        # None where the directory is not this layout
    ids = model.token_ids(texts)         # WordPiece ids, [CLS] … [SEP], truncated as sentence-transformers does
    pooled = model.embed_ids(ids)        # (b, d) in the model's dtype, not normalised

sentence-transformers saves a BERT sentence embedder (the bundled all-MiniLM-L6-v2 among them) as a
Transformer module (a transformers `BertModel`), a Pooling module (mean or CLS) and often a
Normalize. Loading it through sentence-transformers imports that package and transformers, 5–6 s
of one core in every process that embeds (each Ray actor of a database build, every generate.py
that retrieves), and its forward runs through transformers' general machinery. This computes the
same function from the same files: the weights from model.safetensors, the tokens from
tokenizer.json through `tokenizers`, the width, pooling and length from the configs. Its vectors
are within 1e-6 of sentence-transformers' (tests/retrieval/test_bert.py), and the bundled model
embeds faster (docs/benchmarks.md). Any other layout (another architecture, pooling or
tokenizer, a Dense layer, a truncation, weights only as a pickle) is None here and loads through
sentence-transformers (retrieval/embedder.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# The modules (modules.json, by class name) and Pooling modes computed here (a Pooling's legacy flags named).
LAYOUTS = (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"])
POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
# Weights in the files that the sentence embedding never reads.
UNUSED_WEIGHTS = ("pooler.", "embeddings.position_ids")


def plain_bert_layout(path: Path) -> dict | None:
    """What load_plain_bert needs from a sentence-transformers directory (config, pooling mode,
    max length), or None where it is not exactly Transformer(BertModel) → Pooling(mean | cls) →
    [Normalize] with safetensors weights and a WordPiece tokenizer.json."""
    def read(p: Path) -> dict:
        return json.loads(p.read_text())

    try:
        modules = read(path / "modules.json")
        if [m["type"].rsplit(".", 1)[-1] for m in modules] not in LAYOUTS or modules[0].get("path"):
            return None
        config, st = read(path / "config.json"), read(path / "sentence_bert_config.json")
        pooling, tokenizer = read(path / modules[1]["path"] / "config.json"), read(path / "tokenizer.json")
        settings = path / "config_sentence_transformers.json"
        if settings.exists() and read(settings).get("truncate_dim") is not None:
            return None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    modes = pooling.get("pooling_mode")
    if modes is None:  # the legacy format: one flag per mode
        modes = [POOLING_FLAGS.get(flag, flag) for flag, on in pooling.items()
                 if flag.startswith("pooling_mode_") and on]
    modes = [modes] if isinstance(modes, str) else modes
    bert = (config.get("model_type") == "bert" and config.get("architectures", ["BertModel"]) == ["BertModel"]
            and config.get("position_embedding_type", "absolute") == "absolute" and config.get("hidden_act") == "gelu")
    length = st.get("max_seq_length")
    if not (bert and modes in (["mean"], ["cls"]) and not st.get("do_lower_case")
            and isinstance(length, int) and 0 < length <= config.get("max_position_embeddings", 0)
            and pooling.get("word_embedding_dimension", pooling.get("embedding_dimension")) == config.get("hidden_size")
            and (tokenizer.get("model") or {}).get("type") == "WordPiece" and tokenizer.get("post_processor")
            and (path / "model.safetensors").is_file()):
        return None
    return {"config": config, "pooling": modes[0], "max_length": length, "normalize": len(modules) == 3}


def load_plain_bert(path: Path) -> "PlainBert | None":
    """The model of a sentence-transformers BERT directory, fp32 on the CPU, in eval mode; None
    where plain_bert_layout says it is another layout. Raises what reading the files raises."""
    layout = plain_bert_layout(path)
    if layout is None:
        return None
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    model = PlainBert(layout["config"], layout["pooling"], layout["normalize"])
    weights = {k.removeprefix("bert."): v for k, v in load_file(str(path / "model.safetensors")).items()
               if not k.removeprefix("bert.").startswith(UNUSED_WEIGHTS)}
    expected = model.state_dict()
    reshaped = {k for k in expected.keys() & weights.keys() if expected[k].shape != weights[k].shape}
    for what, names in (("lacks", expected.keys() - weights.keys()), ("has no place for", weights.keys() - expected.keys()),
                        ("has another shape for", reshaped)):
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
        d, eps = config["hidden_size"], config["layer_norm_eps"]
        self.pooling, self.normalize, self.dim = pooling, normalize, d
        self.embeddings = nn.ModuleDict({
            "word_embeddings": nn.Embedding(config["vocab_size"], d),
            "position_embeddings": nn.Embedding(config["max_position_embeddings"], d),
            "token_type_embeddings": nn.Embedding(config.get("type_vocab_size", 2), d),
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
        n = max(len(i) for i in ids)
        tokens = torch.tensor([i + [0] * (n - len(i)) for i in ids], device=self.device)          # (b, n)
        lengths = torch.tensor([len(i) for i in ids], device=self.device)
        return self(tokens, torch.arange(n, device=self.device)[None] < lengths[:, None])

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
