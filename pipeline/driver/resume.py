"""The existing store at store.url: probe it, refuse a mismatched resume, decide what is left.

One listing per decision: which units are committed comes from the marker names alone (they
carry unit id and row range), and the plan from its compacted object plus the segments written
since. Deciding a resume of 10^5 units is then two small reads and one listing, not a GET per
marker (per unit!) as before. A resumed run never re-tokenises a block all of whose contexts are
committed: it re-creates only the chunks of units planned but not committed, from their recorded
cursors, and checks their digests against the plan's (the data changed under the same name
otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config.run import HarvestConfig
from ..config.corpus import DataConfig
from ..config.sections import StoreConfig
from ..errors import HarvestError, ResumeMismatch
from ..data.row_frontier import Frontier, chunk_key
from ..data.corpus_blocks import check_sizes
from ..data.provenance import fingerprint_changed
from ...store import redact_url, Unit
from ..data.tokenpool import Job

RUN_ATTR = "harvest_run"


def probe_store(st: StoreConfig, loc=None, create_bucket: bool = False):
    """The existing store at `st`'s url (the store section; `loc`: its location when the
    caller has one, `st.location()` otherwise), or None if the location is free.

    Fails fast (before any data is read) on a wrong endpoint or credentials, or a missing bucket
    (created instead when `create_bucket`: the driver passes store.create_bucket, `plan` writes
    nothing), and refuses a location that holds something that is not a harvest store.
    """
    from ...store import NotAHarvestStore, open_store

    url = st.resolved_url
    loc = st.location() if loc is None else loc
    try:
        return open_store(loc)
    except NotAHarvestStore as e:
        loc.ensure_container(create_bucket)   # the bucket, on S3; nothing elsewhere
        try:
            entries = loc.fs.ls(loc.root, detail=False) if loc.fs.exists(loc.root) else []
        except FileNotFoundError:
            entries = []
        except Exception as exc:
            raise loc.error("listing store.url", exc) from None
        # a store being created holds only the driver's lease so far (pipeline/driver/lease.py)
        entries = [e for e in entries if e.rstrip("/").rsplit("/", 1)[-1] != "_harvest"]
        if entries:
            raise HarvestError(
                f"store.url={redact_url(url)} is not empty and is not a harvest store ({e}): "
                "choose a new store.url"
            ) from None
        return None


def _refuse(store, diffs: list[tuple[str, Any, Any]]) -> None:
    if diffs:
        key, old, new = diffs[0]
        raise ResumeMismatch(
            f"store {store.url} was made by a different config ({key}: the store has {old!r}, "
            f"this config says {new!r}); resuming would mix two runs in one store: use the "
            "original config, or a new store.url"
            + (f" ({len(diffs) - 1} more difference(s))" if len(diffs) > 1 else "")
        )


def _diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def check_resume(store, cfg: HarvestConfig) -> None:
    """Refuse to continue a store made by another config, naming the first differing setting
    (before anything is prepared; check_resume_plan then compares what prepare found)."""
    stored = (store.attrs or {}).get(RUN_ATTR)
    if not stored:
        raise ResumeMismatch(
            f"store.url={store.url} is a harvest store not made by this pipeline's driver "
            "(no run attributes): choose a new store.url"
        )
    want = cfg.store_dtype()
    if store.dtype != want:
        raise ResumeMismatch(
            f"store {store.url} holds {store.dtype} rows and this config asks for {want} "
            f"(store.dtype / model.dtype): one store holds one dtype, and resuming would mix "
            f"two; set store.dtype: {store.dtype} to go on with it, or use a new store.url")
    diffs = _diff(stored.get("content", {}), cfg.content_key())
    for name in ("shard_rows", "chunk_rows"):
        v = getattr(cfg.store, name)
        if v is not None and v != getattr(store, name):
            diffs.append((f"store.{name}", getattr(store, name), v))
    _refuse(store, diffs)


def check_resume_plan(store, prep, data: DataConfig) -> None:
    """After check_resume passed: refuse a resume whose prepared run differs from the store's
    (the points as resolved for the model, the context size), or whose data changed since the
    store was planned (block sizes, a save_to_disk fingerprint; `data`: the data section)."""
    stored = (store.attrs or {}).get(RUN_ATTR) or {}
    key = prep.run_key()
    _refuse(store, [(k, stored.get(k), key[k]) for k in ("points", "context_size")
                    if stored.get(k) != key[k]])
    changed = check_sizes(prep.sources["blocks"]) or fingerprint_changed(
        (store.attrs or {}).get("provenance"), data, prep.source)
    if changed:
        raise ResumeMismatch(
            f"store {store.url}: the data changed since the store was planned ({changed}); "
            "resuming would mix two corpora in one store: restore the data, or use a new "
            "store.url")


@dataclass
class ResumeState:
    units: list[Unit]                 # every planned unit
    committed: set                    # unit ids with a marker that agrees with the plan
    todo: list[Unit]                  # planned, not committed
    chunks: dict                      # chunk_key -> planned descriptor (counts, cursor, digest)
    frontier: Frontier
    jobs: list[Job] = field(default_factory=list)
    fresh_from: int | None = None
    next_seq: int = 0
    payloads: list = field(default_factory=list)
    final: bool = False

    @property
    def complete(self) -> bool:
        return self.final and not self.todo


def fresh_state(prep, max_contexts: int | None) -> ResumeState:
    n = len(prep.sources["blocks"])
    f = Frontier(prep.context_size, prep.layout.unit_contexts, n, max_contexts)
    return ResumeState([], set(), [], {}, f, [], 0 if n else None)


def resume_state(store, prep, max_contexts: int | None) -> ResumeState:
    """What is committed, what is left, and which chunks must be tokenised again."""
    plan = store.ledger.plans.read(payloads=True)
    if not plan.units and not plan.final:
        st = fresh_state(prep, max_contexts)
        st.next_seq = plan.next_seq
        return st
    chunks: dict = {}
    state = None
    for p in plan.payloads:
        chunks.update(p.get("chunks") or {})
        state = p.get("state") or state
    rows = plan.rows()
    committed = {n.unit_id for n in store.ledger.marker_names() if rows.get(n.unit_id) == n.rows}
    todo = [u for u in plan.units if u.unit_id not in committed]
    n_blocks = len(prep.sources["blocks"])
    f = Frontier.resume(prep.context_size, prep.layout.unit_contexts, n_blocks,
                        max_contexts, state)
    needed: dict[int, list[int]] = {}
    for u in todo:
        for b, j, *_ in u.pieces:
            needed.setdefault(int(b), []).append(int(j))
    cont = f.continuation()
    jobs: list[Job] = []
    for b in sorted(needed):
        lo, hi = min(needed[b]), max(needed[b])
        if cont is not None and cont[0] == b:
            continue  # the continuation job covers this block
        jobs.append(Job(b, chunks[chunk_key(b, lo)]["cursor"], lo, hi))
    fresh_from = None
    if cont is not None:
        b, cursor, j = cont
        if b in needed:
            lo = min(min(needed[b]), j)
            cursor = chunks[chunk_key(b, lo)]["cursor"] if lo != j or cursor is None else cursor
            j = lo
        # the packer counts packing.max_tokens from where it starts: from a cursor, only what the
        # run has left there, or it packs (and the driver receives) chunks past the run's end
        budget = None if max_contexts is None else \
            max(0, max_contexts - _contexts_before(chunks, b, j))
        jobs.append(Job(b, cursor, j, None, budget=budget))
        fresh_from = b + 1
    jobs.sort(key=lambda jb: jb.block)
    return ResumeState(plan.units, committed, todo, chunks, f, jobs, fresh_from,
                       plan.next_seq, plan.payloads, plan.final)


def _contexts_before(chunks: dict, block: int, chunk: int) -> int:
    """Where chunk (block, chunk)'s first context lands in the run: the contexts of every planned
    chunk before it (all placed and planned: a continuation starts at or before the frontier)."""
    n = 0
    for key, d in chunks.items():
        b, j = (int(x) for x in key.split(":"))
        if (b, j) < (block, chunk):
            n += int(d["n_contexts"])
    return n
