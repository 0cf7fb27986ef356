"""The messages between the driver and the capture actors, as typed records.

Five messages cross process boundaries (Ray pickles them): an actor's spec (cluster.py builds
it, pipeline/actor/capture.py reads it), what the actor loaded (ActorInfo: pipeline/actor/capture.py builds it, cluster.py,
health.py, dispatch.py and sink.py read it), a unit of work (dispatch.py builds it, pipeline/actor/capture.py and
rows.py read it), the unit's result (pipeline/actor/capture.py builds it, dispatch.py reads it) and the actor's
figures at the end of a run (ActorFigures: pipeline/actor/capture.py builds it, health.py reads it). As dicts, a misspelt or missing key
would fail only where it is read, in another process and often minutes into a run. Frozen
dataclasses fail at construction, in the process that builds the message, naming the field; readers use attributes a type checker
follows (the same choice as vLLM's EngineCoreRequest).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args


@dataclass(frozen=True, slots=True)
class ActorSpec:
    """Everything a capture actor needs to load its engine and write its units."""

    index: int
    """The actor's number, 0 .. num_actors-1: its log file, its CPU slice on a CPU node."""
    model_path: str
    """The checkpoint the engine loads (resolved: a local path or a hub name)."""
    engine_kwargs: dict
    """`harvest.engine.load_model`'s keyword arguments beside the path (ModelConfig's)."""
    points: tuple
    """The points captured, in the store's order: engine Addresses, parsed once by the driver
    (prepare.resolve_points); `str(a)` is the store's point name."""
    context_size: int
    """Tokens per context: a unit's rows are cut into contexts of this many."""
    store_url: str
    """The store the actor writes its units into."""
    storage_options: dict | None = None
    """fsspec options for `store_url` (credentials, endpoint); None for a local store."""
    threads: int = 1
    """Forward threads of a CPU engine: the driver splits this node's cores over its actors."""
    threads_requested: int | None = None
    """ray.threads_per_actor as configured; a GPU actor sizes its host threads from its own CPU
    share unless this is set."""
    check_model: bool = False
    """Run `harvest.engine.check_loaded` on the engine before the first unit (one actor does)."""
    env: dict = field(default_factory=dict)
    """Environment variables set in the actor's process before the engine loads (credentials,
    caches, log folder: cluster.FORWARDED_ENV)."""
    engine_factory: str | None = None
    """"module:callable" that builds the engine from this spec instead of `load_model`
    (benchmarks and tests: a stub engine measures the bookkeeping alone)."""
    factory_options: dict = field(default_factory=dict)
    """Options only an `engine_factory` reads (a test engine's fault to inject); load_model
    never sees them."""
    generate: dict | None = None
    """capture.generate (GenerateConfig.describe()): complete each context's prompt and write
    its slot (pipeline/actor/generation.py); None captures the contexts as they are."""

    def __repr__(self) -> str:
        """Every field, but `env` with its values masked and `storage_options` and `store_url`
        through the store's redaction (credentials.py): a spec is logged and shown in Ray's
        errors, and both carry credentials."""
        from harvest.store.storage.credentials import REDACTED, redact_options, redact_url

        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["env"] = {k: REDACTED for k in self.env}
        shown["storage_options"] = redact_options(self.storage_options)
        shown["store_url"] = redact_url(self.store_url)
        return f"ActorSpec({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def __post_init__(self):
        if not isinstance(self.points, tuple) or not self.points:
            raise ValueError(f"ActorSpec.points must be a non-empty tuple of addresses, got "
                             f"{self.points!r}")
        if self.context_size <= 0:
            raise ValueError(f"ActorSpec.context_size must be positive, got {self.context_size}")
        if self.engine_factory is not None and ":" not in self.engine_factory:
            raise ValueError(f"ActorSpec.engine_factory must be 'module:callable', got "
                             f"{self.engine_factory!r}")


@dataclass(frozen=True, slots=True)
class UnitTask:
    """One unit of work, driver -> actor: rows [row_start, row_end) and where their tokens are.

    The tokens themselves never travel in the message: `refs` are Ray references to the
    tokenising workers' chunks (owned by the driver), fetched by the actor (pipeline/data/rows.py)."""

    unit_id: int
    row_start: int
    row_end: int
    pieces: tuple[tuple[int, int, int, int, int], ...] = ()
    """Per chunk the unit takes contexts from: (block, chunk, ctx_lo, ctx_hi, doc_base), in row
    order (store.planlog.Unit.pieces)."""
    refs: tuple = ()
    """Ray object references to those chunks' arrays, one per piece."""
    digests: tuple[tuple[int, ...], ...] = ()
    """Each chunk's digest as its tokeniser recorded it (rows.chunk_digest), one per piece."""

    def __post_init__(self):
        if self.row_end < self.row_start:
            raise ValueError(f"UnitTask {self.unit_id}: row_end {self.row_end} < row_start "
                             f"{self.row_start}")
        if not len(self.pieces) == len(self.refs) == len(self.digests):
            raise ValueError(f"UnitTask {self.unit_id}: {len(self.pieces)} pieces, "
                             f"{len(self.refs)} refs and {len(self.digests)} digests; one each "
                             "per chunk")

    @property
    def n_rows(self) -> int:
        return self.row_end - self.row_start


UnitStatus = Literal["committed", "already_committed"]
UNIT_STATUSES: tuple[str, ...] = get_args(UnitStatus)


@dataclass(frozen=True, slots=True)
class UnitResult:
    """What an actor returns for a unit, actor -> driver: small (the rows are in the store)."""

    unit_id: int
    row_start: int
    row_end: int
    actor: int
    """The actor's index (ActorSpec.index)."""
    pid: int
    """The process that ran the unit: a changed pid means Ray restarted the actor meanwhile."""
    attempt: int
    """The driver's attempt number for this unit, 1 for the first."""
    status: UnitStatus
    """"committed" (this call wrote and committed it) or "already_committed" (a marker was
    there: an earlier attempt's, or a racing one's)."""
    tokens: int
    """Rows this call committed: 0 when already committed."""
    seconds: float
    """Wall time of the unit in the actor, commit included."""
    capture_seconds: float | None = None
    """Of `seconds`, until the engine delivered the last row; None when nothing was captured."""
    marker: dict | None = None
    """The commit marker written (the driver copies it into the commit index); None when
    already committed."""
    rows_with_activations: int | None = None
    """Of `tokens`, the rows that hold activations: not chat padding zeroed by capture.roles,
    a role outside capture.roles, or a generation slot's row without (FORMAT.md). None from an
    actor that did not count them."""

    def __post_init__(self):
        if self.status not in UNIT_STATUSES:
            raise ValueError(f"UnitResult.status must be one of {UNIT_STATUSES}, got "
                             f"{self.status!r}")

    def event(self) -> dict[str, Any]:
        """The fields of the driver's `unit_done` event: all but the marker (the commit index
        holds it; ~0.5 MB of JSON per unit at an 8B model's shape), `capture_seconds` only
        where it was measured."""
        out = {"unit_id": self.unit_id, "row_start": self.row_start, "row_end": self.row_end,
               "actor": self.actor, "pid": self.pid, "attempt": self.attempt,
               "status": self.status, "tokens": self.tokens, "seconds": self.seconds}
        if self.capture_seconds is not None:
            out["capture_seconds"] = self.capture_seconds
        return out


@dataclass(frozen=True, slots=True)
class ActorInfo:
    """What an actor loaded, actor -> driver, once its engine is up (HarvestActor.info)."""

    index: int
    pid: int
    host: str
    gpus: list
    """The GPU ids this process sees (empty on CPU)."""
    n_layers: int
    width: int
    max_model_len: int
    dtype: str
    """The engine's row dtype, "bfloat16" style (no "torch." prefix)."""
    describe: dict
    """The engine's describe(): model, backend, mode, versions (the store's `model` attribute)."""
    load_seconds: float
    threads: int
    platform: str
    """The platform profile's name the engine was loaded with ("cpu", ...: engine.platform)."""
    check: dict | None
    """The model check's result (capture.check_model), None when it did not run."""
    queue_tokens: int
    """Tokens the driver keeps queued at this actor so the engine never runs dry between units."""

    def as_dict(self) -> dict[str, Any]:
        """The `actors_ready` event's record (JSON-able)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ActorFigures:
    """An actor's own figures since its engine loaded, actor -> driver at the end of a run
    (HarvestActor.figures): units, tokens and step fill (scheduled tokens / (steps x
    max_num_batched_tokens))."""

    index: int
    pid: int
    units: int
    tokens: int
    streams: int
    rows_in_place: int
    steps: int
    scheduled_tokens: int
    max_num_batched_tokens: int
    step_fill: float | None
    """None when the engine took no step."""
    rows_placed: int | None = None
    """Tensor parallel: rows the publishing rank wrote straight into shared destinations."""
    throttled_requests: int = 0
    """Storage requests the server throttled (503 SlowDown), each retried after the process's
    shared backoff (store/storage/retries.Throttle)."""
    throttle_wait_s: float = 0.0
