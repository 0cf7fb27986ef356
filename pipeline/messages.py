"""The messages between the driver, the capture actors and the trainers, as typed records.

The capture run's five messages cross process boundaries (Ray pickles them): an actor's spec (cluster.py builds
it, pipeline/actor/capture.py reads it), what the actor loaded (ActorInfo: pipeline/actor/capture.py builds it, cluster.py,
health.py, dispatch.py and sink.py read it), a unit of work (dispatch.py builds it, pipeline/actor/capture.py and
unit_rows.py read it), the unit's result (pipeline/actor/capture.py builds it, dispatch.py reads it) and the actor's
figures at the end of a run (ActorFigures: pipeline/actor/capture.py builds it, health.py reads it). A streamed
run (pipeline/stream/) adds its own: the actor's stream section (StreamSpec, on the ActorSpec),
which rank gets which row of a unit (UnitDeal, on the UnitTask), a trainer rank's rows
(StreamRows: actor -> trainer), what a joining trainer learns (StreamInfo) and where the stream
stands (StreamStatus: coordinator -> trainer). As dicts, a misspelt or missing key
would fail only where it is read, in another process and often minutes into a run. Frozen
dataclasses fail at construction, in the process that builds the message, naming the field; readers use attributes a type checker
follows (the same choice as vLLM's EngineCoreRequest).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import numpy as np

    from ..store import RowFilter


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
    store_url: str | None
    """The store the actor writes its units into; None: a streamed run without a tee writes no
    store (the rows go to the trainers only: `stream`)."""
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
    stream: "StreamSpec | None" = None
    """A streamed run: what the actor hands the trainer ranks (pipeline/actor/outbox.py)."""

    def __repr__(self) -> str:
        """Every field, but `env` with its values masked and `storage_options` and `store_url`
        through the store's redaction (credentials.py): a spec is logged and shown in Ray's
        errors, and both carry credentials."""
        from ..store import REDACTED, redact_options, redact_url

        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["env"] = {k: REDACTED for k in self.env}
        shown["storage_options"] = redact_options(self.storage_options)
        shown["store_url"] = None if self.store_url is None else redact_url(self.store_url)
        return f"ActorSpec({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def __post_init__(self):
        if not isinstance(self.points, tuple) or not self.points:
            raise ValueError(f"ActorSpec.points must be a non-empty tuple of addresses, got "
                             f"{self.points!r}")
        if self.context_size <= 0:
            raise ValueError(f"ActorSpec.context_size must be positive, got {self.context_size}")
        if self.store_url is None and self.stream is None:
            raise ValueError("ActorSpec: no store_url and no stream: the rows would go nowhere")
        if self.engine_factory is not None and ":" not in self.engine_factory:
            raise ValueError(f"ActorSpec.engine_factory must be 'module:callable', got "
                             f"{self.engine_factory!r}")


@dataclass(frozen=True, slots=True)
class UnitTask:
    """One unit of work, driver -> actor: rows [row_start, row_end) and where their tokens are.

    The tokens themselves never travel in the message: `refs` are Ray references to the
    tokenising workers' chunks (owned by the driver), fetched by the actor (pipeline/data/unit_rows.py)."""

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
    deal: "UnitDeal | None" = None
    """A streamed run: which trainer rank gets each of the unit's kept rows."""

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


UnitStatus = Literal["committed", "already_committed", "streamed"]
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
    """"committed" (this call wrote and committed it), "already_committed" (a marker was
    there: an earlier attempt's, or a racing one's) or "streamed" (no store: every trainer rank
    took the unit's rows)."""
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




@dataclass(frozen=True, slots=True)
class ChunkDescriptor:
    """A tokenised chunk without its tokens, tokenize worker -> driver (TokenizeWorker.tokenize
    yields the chunk's arrays, then this): what the driver places into units and checks a resume
    against; `plan_record()` is what the plan keeps of it."""

    block: int
    chunk: int
    """The chunk's index in its block."""
    n_contexts: int
    cursor: dict | None
    """Where in the block the chunk's first context starts ({"row", "pos", "offset"}, JSON: the
    plan keeps it, a resume restarts tokenising there)."""
    final: bool
    """The block ends with this chunk."""
    rows: int
    """Source rows read so far in the block (all of them once final)."""
    digest: tuple[int, ...]
    """The chunk's rows' digest (unit_rows.chunk_digest): the same data gives the same digest."""
    stats: dict = field(default_factory=dict)
    """Source-row and packing figures (packing.PackStats.as_dict)."""
    capped: bool = False
    """Stopped at the run's context budget, not at the block's end."""
    pid: int | None = None
    """The tokenize worker's process (the run's events name it)."""

    def plan_record(self) -> dict[str, Any]:
        """The plan's JSON record of the chunk (FORMAT.md "The plan")."""
        return {"n_contexts": self.n_contexts, "cursor": self.cursor, "final": self.final,
                "rows": self.rows, "digest": list(self.digest), "stats": self.stats,
                "capped": self.capped}

@dataclass(frozen=True, slots=True)
class StreamFigures:
    """A streaming actor's memory and flow now, actor -> whoever asks (HarvestActor.stream_figures;
    the memory figures of a streamed run)."""

    actor: int
    pid: int
    held_rows: tuple[int, ...]
    """Rows held for each trainer rank, in rank order."""
    held_bytes: int
    peak_held_bytes: int
    rows_sent: int
    bytes_sent: int
    put_wait_s: float
    """Seconds the engine waited for trainers (backpressure)."""
    rss_bytes: int

# ---- a streamed run (pipeline/stream/) ---------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StreamSpec:
    """A capture actor's part of a streamed run: which rows it hands which trainer rank, in
    what form, and how many it may hold for one rank before its capture pauses."""

    world_size: int
    """Trainer ranks: kept row k of the run (in row order) goes to rank k % world_size."""
    points: tuple[int, ...]
    """Indices into the captured points (ActorSpec.points) of the points streamed, in order."""
    widths: tuple[int, ...]
    """Each streamed point's width."""
    dtype: str
    """The rows on the wire: the model's dtype name, or "float8_e4m3fn" (packed with a
    float32 scale per row, store/format/fp8.py)."""
    filter: "RowFilter"
    """The rows kept (store/read/filters.RowFilter): the same rule the store's reader applies."""
    send_buffer_rows: int
    """Rows held for one rank before the capture pauses (at least one context's share)."""

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"StreamSpec.world_size must be >= 1, got {self.world_size}")
        if not self.points or len(self.points) != len(self.widths):
            raise ValueError(f"StreamSpec: {len(self.points)} points and {len(self.widths)} "
                             "widths; one width per streamed point, at least one point")
        if self.send_buffer_rows < 1:
            raise ValueError(f"StreamSpec.send_buffer_rows must be >= 1, got "
                             f"{self.send_buffer_rows}")


@dataclass(frozen=True, slots=True)
class UnitDeal:
    """Which trainer rank gets each kept row of one unit (driver -> actor, on UnitTask.deal).

    The unit's k-th kept row is the run's (kept_before + k)-th, and goes to rank
    (kept_before + k) % world_size, unless it is at or past `cut` (the run's last N mod
    world_size kept rows, dropped so that every rank gets N // world_size rows)."""

    kept_before: int
    """Kept rows of the units before this one (the run's row order)."""
    kept: int
    """Kept rows of this unit, as the driver counted them from its metadata."""
    cut: int | None = None
    """Rows with ordinal >= cut go to no rank; None when the cut cannot reach this unit."""
    ranks: tuple[int, ...] | None = None
    """Only these ranks get their rows (a rejoining rank's replay); None: every rank."""
    replay: bool = False
    """A replay for rejoining ranks: stream the rows, never write them to a store."""

    def __post_init__(self):
        if self.kept_before < 0 or self.kept < 0:
            raise ValueError(f"UnitDeal: kept_before={self.kept_before} and kept={self.kept} "
                             "must be >= 0")


@dataclass(frozen=True, slots=True)
class StreamRows:
    """One trainer rank's rows from one capture actor (HarvestActor.take), actor -> trainer.

    Rows come in parts, one per (unit, context): a part may hold no row (the context's kept
    rows all went to other ranks) and is sent all the same, so the trainer can tell which
    contexts of a unit it has (a unit re-captured after its actor died sends them again; the
    trainer keeps the first copy)."""

    actor: int
    pid: int
    parts: "np.ndarray"
    """int64 [n_parts, 5]: unit_id, context index in the unit, contexts in the unit, rows, and
    the context's global index (its first row // context size)."""
    rows: "np.ndarray"
    """int64 [m]: each row's global row (the store's row number)."""
    token_id: "np.ndarray"
    doc_id: "np.ndarray"
    position: "np.ndarray"
    acts: tuple
    """Each part's rows, [rows of the part, n_points, row width] raw bits of the stream dtype
    (fp8: packed rows with their scales), one array per part in `parts` order."""
    held_rows: int = 0
    """Rows still held for this rank at this actor after this take."""
    token: int = 0
    """This take's number at its actor (0: no part): the trainer names it in its next take
    (`ack`), and only then do the parts count as delivered (pipeline/actor/outbox.py)."""

    def __post_init__(self):
        m = int(self.rows.shape[0])
        counted = int(self.parts[:, 3].sum()) if len(self.parts) else 0
        if counted != m:
            raise ValueError(f"StreamRows: parts count {counted} rows, {m} given")
        if not self.token_id.shape[0] == self.doc_id.shape[0] == self.position.shape[0] == m:
            raise ValueError("StreamRows: rows, token_id, doc_id and position must have one "
                             "entry per row")
        if len(self.acts) != len(self.parts) or any(
                a.shape[0] != n for a, n in zip(self.acts, self.parts[:, 3].tolist())):
            raise ValueError("StreamRows: acts must hold one array per part, of its rows")


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What a trainer rank learns when it joins a stream (coordinator -> trainer)."""

    name: str
    world_size: int
    actors: tuple
    """The capture actors' Ray handles: the trainer takes its rows from each."""
    points: tuple[str, ...]
    widths: tuple[int, ...]
    dtype: str
    context_size: int
    sink_positions: int
    """Leading context positions left out of the normalisation window (filters.sink_positions)."""
    filter: dict
    """The rows kept (RowFilter.describe()), for the trainer's state and its checks."""
    tee: str | None = None
    """The store the run also writes (its URL, credentials masked), None without a tee."""


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """Where a stream stands (coordinator -> trainer)."""

    units_planned: int
    units_done: int
    done: bool
    """Every unit's rows were taken by every rank: nothing more will come."""
    kept_rows: int | None = None
    """Kept rows of the whole run, once known (then each rank gets kept_rows // world_size)."""
    error: str | None = None
    """Why the capture stopped, when it failed."""
    summary: dict | None = None
    """The run's summary, once it ended."""
