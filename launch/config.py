"""Compose the per-package config sections, load them from YAML and apply `--set` overrides.

    cfg = load_config("configs/tiny.yaml", ["workdir=/tmp/x", "data.chunk_len=32"])

Unknown keys, wrong types and impossible values raise `ConfigError` naming the key and the
file (or the override) they came from. Cross-section rules (e.g. `train.seq_len` must be a
multiple of `data.chunk_len`) live here because no single section can see both sides.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from retropipe.data.config import DataConfig
from retropipe.data.errors import ConfigError
from retropipe.retrieval.config import RetrievalConfig
from retropipe.retrieval.methods import lexical
from retropipe.training.evaluation.config import EvalConfig
from retropipe.training.models.config import ModelConfig
from retropipe.training.run.config import TrainConfig, resolve_auto_lessons


@dataclass
class Config:
    # Root under which each stage writes its own subdirectory (see the properties below).
    workdir: str = "runs/tiny"
    data: DataConfig = field(default_factory=DataConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    # Stage output directories: one place defines the layout of a workdir.
    @property
    def data_dir(self) -> Path:
        return Path(self.workdir) / "data"

    @property
    def retrieval_dir(self) -> Path:
        return Path(self.workdir) / "retrieval"

    @property
    def runs_dir(self) -> Path:
        return Path(self.workdir) / "runs"

    @property
    def reports_dir(self) -> Path:
        return Path(self.workdir) / "reports"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "workdir"}
_SECTION_TYPES = typing.get_type_hints(Config)


def _check_type(key: str, value, hint, source: str):
    """Return value coerced to hint (int → float only), or raise ConfigError."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) > 1:  # e.g. float | str: a share or "auto"; the section's own check says which strings
            for kind in kinds:
                try:
                    return _check_type(key, value, kind, source)
                except ConfigError:
                    pass
            raise ConfigError(key, f"expected {' or '.join(k.__name__ for k in kinds)}, got {value!r}", source)
        hint = kinds[0]
        origin = typing.get_origin(hint)
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1] or (object,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}", source)
        return [_check_type(key, v, item, source) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint in (int, float) and isinstance(value, bool):
        raise ConfigError(key, f"expected {hint.__name__}, got {value!r}", source)
    if hint in (int, float, str, bool) and not isinstance(value, hint):
        raise ConfigError(key, f"expected {hint.__name__}, got {type(value).__name__} {value!r}", source)
    return value


def _build_section(name: str, values: dict, source: str):
    cls = _SECTION_TYPES[name]
    hints = typing.get_type_hints(cls)
    if not isinstance(values, dict):
        raise ConfigError(name, f"expected a mapping of keys, got {values!r}", source)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            known = ", ".join(sorted(hints))
            raise ConfigError(f"{name}.{key}", f"unknown key (known keys: {known})", source)
        kwargs[key] = _check_type(f"{name}.{key}", value, hints[key], source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(e.key, str(e).split(": ", 1)[1], source) from None


def _parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise ConfigError(text, "an override must look like section.key=value", "--set")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw != "" else ""


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    """A YAML config, merged over the file its `base:` key names (relative to it), recursively."""
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError("<top>", "the file must be a mapping of sections", str(path))
    base = raw.pop("base", None)
    if base is None:
        return raw
    base_path = (path.parent / base).resolve()
    if not base_path.is_file() or base_path in seen:
        raise ConfigError("base", f"{base_path} is missing or included in a cycle", str(path))
    merged = _read_yaml(base_path, seen + (base_path,))
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load YAML at `path` (or the defaults), apply `--set` overrides, validate, compose."""
    raw: dict = {}
    sources: dict[str, str] = {}
    if path is not None:
        text = Path(path).read_text() if Path(path).exists() else None
        if text is None:
            raise ConfigError("--config", f"file not found: {path}")
        raw = _read_yaml(Path(path))
        sources = {k: str(path) for k in raw}
    for item in overrides:
        keys, value = _parse_override(item)
        if len(keys) == 1:
            raw[keys[0]] = value
        elif len(keys) == 2:
            section = raw.setdefault(keys[0], {})
            if not isinstance(section, dict):
                raise ConfigError(keys[0], "is not a section", "--set")
            section[keys[1]] = value
        else:
            raise ConfigError(".".join(keys), "overrides take the form section.key=value", "--set")
        if not sources.get(keys[0], "").endswith("--set"):
            sources[keys[0]] = f"{sources[keys[0]]} / --set" if keys[0] in sources else "--set"

    for name in raw:
        if name != "workdir" and name not in SECTIONS:
            known = ", ".join(["workdir", *SECTIONS])
            raise ConfigError(name, f"unknown section (known: {known})", sources.get(name, "--set"))
    kwargs = {}
    if "workdir" in raw:
        kwargs["workdir"] = str(_check_type("workdir", raw["workdir"], str, sources.get("workdir", "--set")))
    for name in SECTIONS:  # in field order: data before model, whose chunk_len it gives
        values = raw.get(name)
        if name == "model":
            data = kwargs.get("data") or DataConfig()
            values = _model_with_chunk_len(values or {}, data.chunk_len, sources.get("model"))
        elif name not in raw:
            continue
        kwargs[name] = _build_section(name, values or {}, sources.get(name, "--set"))
    cfg = Config(**kwargs)
    cfg.train = resolve_auto_lessons(cfg.train, cfg.model.retrieves or cfg.model.in_context > 0,
                                     lexical(cfg.retrieval.method))
    _validate_across_sections(cfg, str(path) if path else "--set")
    return cfg


def _model_with_chunk_len(values, chunk_len: int, source: str | None):
    """The model section with chunk_len = data.chunk_len (one source of truth: the data's chunking),
    composed in before the section validates itself; a different model.chunk_len is refused."""
    if not isinstance(values, dict):
        return values  # _build_section names the section and what it expected
    if "chunk_len" in values and values["chunk_len"] != chunk_len:
        raise ConfigError("model.chunk_len", "is copied from data.chunk_len; set data.chunk_len instead", source)
    return {**values, "chunk_len": chunk_len}


def _validate_across_sections(cfg: Config, source: str) -> None:
    chunk_len = cfg.data.chunk_len
    if cfg.train.seq_len % chunk_len:
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} is not a multiple of data.chunk_len "
                          f"({chunk_len}): a training sequence is a run of whole chunks", source)
    if cfg.train.seq_len > cfg.model.n_positions:
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} exceeds model.n_positions "
                          f"({cfg.model.n_positions})", source)
    for key in ("window", "stride"):
        if getattr(cfg.eval, key) % chunk_len:
            raise ConfigError(f"eval.{key}", f"{getattr(cfg.eval, key)} is not a multiple of data.chunk_len ({chunk_len})",
                              source)
    if cfg.eval.window > cfg.model.n_positions:
        raise ConfigError("eval.window", f"{cfg.eval.window} exceeds model.n_positions ({cfg.model.n_positions})", source)
    for key in ("neighbours", "more_neighbours", "in_context_neighbours"):
        if getattr(cfg.eval, key) > cfg.retrieval.k:
            raise ConfigError(f"eval.{key}", f"{getattr(cfg.eval, key)} exceeds retrieval.k ({cfg.retrieval.k})", source)
    if cfg.model.retrieves and cfg.train.neighbours > cfg.retrieval.k:
        raise ConfigError("train.neighbours", f"{cfg.train.neighbours} exceeds retrieval.k "
                          f"({cfg.retrieval.k}), the neighbours stored per chunk", source)
    if cfg.model.in_context > cfg.retrieval.k:
        raise ConfigError("model.in_context", f"{cfg.model.in_context} exceeds retrieval.k ({cfg.retrieval.k})", source)
    if cfg.model.freeze_trunk and not cfg.train.init_from:
        raise ConfigError("model.freeze_trunk", "a RETRO-fit freezes a trained trunk: set train.init_from "
                          "to a GPT-2 checkpoint (ours or a Hugging Face directory)", source)


def save_config(cfg: Config, out_dir: str | os.PathLike) -> Path:
    """Write the resolved config as YAML into a stage's output directory (atomically)."""
    out = Path(out_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, out)
    return out
