"""Run configuration: one dataclass per component, loaded from YAML and `--set a.b=v` overrides.

Everything is validated before any data is read, any actor starts or any byte is written, because
a typo found after an hour of capture (or, worse, silently ignored) costs the hour. Every error
names the field as it is written in YAML (`packing.context_size`) and says how to fix it.

The sections live in pipeline/config/sections.py (model, capture, store, ray),
pipeline/config/corpus.py (data, packing) and pipeline/config/generate.py (capture.generate);
they are leaves that import only config helpers, never the runtime modules using them (data,
generation, ...: those import the sections, one way, so loading a config is no import cycle).
The YAML and override helpers are in pipeline/config/yamltext.py, the cache paths in
pipeline/config/paths.py (import them from there).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .fields import ConfigError, check_bool, check_str
from ...engine.models import REPO_ROOT
from .corpus import DataConfig, PackingConfig
from .sections import CaptureConfig, ModelConfig, RayConfig, StoreConfig
from .stream import StreamConfig
from .yamltext import deep_merge, load_yaml_unique, parse_override, read_text, unknown_msg


@dataclass(frozen=True)
class HarvestConfig:
    """A run's whole config, one frozen dataclass per section: built and validated once by
    load_config and never changed afterwards, so what was checked is what every consumer
    reads (another run is another config: `--set`, or dataclasses.replace, then validate())."""

    name: str = "harvest"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    progress: bool = True

    def validate(self) -> "HarvestConfig":
        check_str("name", self.name)
        check_bool("progress", self.progress)
        for section in SECTIONS:
            getattr(self, section).validate()
        check_store_sizes(self)
        check_chat(self)
        check_generate(self)
        if self.store.dtype not in (None, "float8_e4m3fn", self.model.dtype):
            raise ConfigError(
                f"store.dtype={self.store.dtype!r} differs from model.dtype={self.model.dtype!r}: a "
                "store holds the model's rows bit for bit, or quantised (float8_e4m3fn); set "
                f"model.dtype: {self.store.dtype}, store.dtype: float8_e4m3fn, or leave store.dtype out")
        if self.stream.tee and self.stream.dtype not in (None, self.store_dtype()):
            raise ConfigError(
                f"stream.dtype={self.stream.dtype!r} with stream.tee: the stream hands trainers the "
                f"rows the store holds ({self.store_dtype()}); set stream.dtype to it, or leave it "
                "out")
        if self.ray.num_gpus_per_actor is not None and self.model.tensor_parallel_size > 1:
            if self.ray.num_gpus_per_actor < self.model.tensor_parallel_size:
                raise ConfigError(
                    f"model.tensor_parallel_size={self.model.tensor_parallel_size} needs that many "
                    f"GPUs per actor, but ray.num_gpus_per_actor={self.ray.num_gpus_per_actor}: "
                    "set them equal"
                )
        return self

    def store_dtype(self) -> str:
        """The point arrays' dtype: store.dtype, else the model's."""
        return self.store.dtype or self.model.dtype

    def stream_dtype(self) -> str:
        """The dtype of streamed rows: stream.dtype, else the store's."""
        return self.stream.dtype or self.store_dtype()

    def to_dict(self, redact: bool = True) -> dict:
        """The config as plain data. `redact` (for everything recorded or shown: store
        attributes, provenance, logs): store.storage_options replaced whole, and every URL,
        credential-looking value and query credential masked (store/storage/credentials.py:
        `data.source` keeps its scheme, host, path and non-secret parameters)."""
        d = dataclasses.asdict(self)
        if redact:
            # here, not at import: the store package loads zarr and numcodecs (~2 s, ~500
            # modules), which `harvest plan`/`status --config` and every config load would pay
            from ...store import redact_attrs

            d["store"]["storage_options"] = (
                None if self.store.storage_options is None else "<redacted>"
            )
            d = redact_attrs(d, self.store.storage_options)
        return d

    def content_key(self) -> dict:
        """The settings that decide what lands in the store's rows.

        Resume compares these with the ones stored at creation: a difference would make a mixed
        store. Cluster and engine tuning knobs (actors, batch sizes, memory) are left out on
        purpose, so a resumed run may use a different cluster.
        """
        return {
            "model": {
                "path": self.model.path,
                "backend": self.model.backend,
                "dtype": self.model.dtype,
            },
            "data": self.data.content_key(),
            "packing": {
                k: v for k, v in dataclasses.asdict(self.packing).items()
                if k not in ("tokenize_batch", "chunk_tokens")
            },
            # roles, generate: only when set, so stores made before they existed keep their key
            "capture": {"points": list(self.capture.points),
                        **({"roles": sorted(self.capture.roles)} if self.capture.roles else {}),
                        **({"generate": self.capture.generate.describe()}
                           if self.capture.generate is not None else {})},
            "store": {"stats_skip_positions": self.store.stats_skip_positions},
        }


def check_store_sizes(cfg: "HarvestConfig") -> None:
    """store.shard_rows and store.chunk_rows against packing.context_size, by the store's own
    rule (layout.check_sizes; store/FORMAT.md, "Sizes"). Imported here, not at the top: loading
    a config imports no zarr (harvest.store's package does), and only sizes given explicitly
    need the check."""
    if cfg.store.shard_rows is None and cfg.store.chunk_rows is None:
        return
    from ...store import check_sizes

    try:
        check_sizes(cfg.store.shard_rows, cfg.store.chunk_rows, cfg.packing.context_size,
                    names=("store.shard_rows", "store.chunk_rows", "packing.context_size"))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_chat(cfg: "HarvestConfig") -> None:
    """Settings that only make sense together with data.format: chat."""
    chat = cfg.data.format == "chat"
    if cfg.capture.roles is not None and not chat:
        raise ConfigError(
            f"capture.roles={cfg.capture.roles!r} needs data.format: chat (plain text has no "
            "roles): set data.format: chat and data.messages_column, or drop capture.roles")
    if chat and cfg.packing.bos != "none":
        raise ConfigError(
            f"packing.bos={cfg.packing.bos!r} with data.format: chat: the chat template writes "
            "the conversation's own start tokens (SmolLM2's BOS is <|im_start|>, so an inserted "
            "one would be a stray turn marker); set packing.bos: none")


def check_generate(cfg: "HarvestConfig") -> None:
    """capture.generate against the other sections."""
    if cfg.capture.generate is None:
        return
    cfg.capture.generate.validate(cfg.packing.context_size)
    if cfg.model.backend != "vllm":
        raise ConfigError(
            f"capture.generate needs model.backend: vllm (the {cfg.model.backend} "
            "backend captures prompts only): set model.backend: vllm or drop "
            "capture.generate")
    # chat input: each conversation is a prompt ending in the template's generation prompt, its
    # generated rows are the assistant's (pipeline/actor/generation.py); capture.roles applies to
    # prompt and generated rows alike
    if cfg.model.tensor_parallel_size > 1:
        # built apart and never run together: the step ring (engine/capture/stepring.py) carries prompt
        # steps, and the retired-request bookkeeping generation needs lives in the in-process
        # runner; refused rather than shipped untested
        raise ConfigError(
            f"capture.generate with model.tensor_parallel_size={cfg.model.tensor_parallel_size} "
            "is not supported yet: generate with tensor_parallel_size: 1, or drop capture.generate")


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "packing": PackingConfig,
    "capture": CaptureConfig,
    "store": StoreConfig,
    "ray": RayConfig,
    "stream": StreamConfig,
}
TOP_LEVEL = ("name", "progress")


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def default_config_path() -> Path:
    return REPO_ROOT / "jobs" / "configs" / "default.yaml"


def load_config(
    path: "str | Path | None" = None,
    overrides: "list[str] | None" = None,
    data: "dict | None" = None,
) -> HarvestConfig:
    """YAML file (or dict) + `a.b=value` overrides -> validated HarvestConfig."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist: pass --config <file.yaml>")
        try:
            raw = load_yaml_unique(read_text(p), f"config file {str(p)!r}") or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    if data:
        raw = deep_merge(raw, data)
    for item in overrides or []:
        raw = deep_merge(raw, parse_override(item))
    return from_dict(raw)


def from_dict(raw: dict) -> HarvestConfig:
    raw = copy.deepcopy(raw)
    unknown = [k for k in raw if k not in SECTIONS and k not in TOP_LEVEL]
    if unknown:
        raise ConfigError(unknown_msg(unknown[0], list(SECTIONS) + list(TOP_LEVEL), ""))
    kwargs: dict[str, Any] = {k: raw[k] for k in TOP_LEVEL if k in raw}
    for section, cls in SECTIONS.items():
        values = raw.get(section) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{section} must be a mapping of fields, got {values!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        for k in values:
            if k not in names:
                raise ConfigError(unknown_msg(k, names, section + "."))
        kwargs[section] = cls(**values)
    return HarvestConfig(**kwargs).validate()
