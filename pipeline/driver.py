"""The driver: config -> rows -> plan -> store -> Ray actors -> verified, summarized store.

Order matters and is chosen so that bad input costs nothing: the store URL is probed first
(credentials, endpoint), then the model's config, tokenizer and the data are checked and packed,
and only then do actors start and the store get created. Anything wrong before that point leaves
nothing behind.

Exactly once comes from the store, not from the scheduler: a unit is done when its commit marker
exists, so the driver may hand a unit out again whenever it is unsure (an actor died, a task
errored) and a re-run of the same config skips committed units. Ray's own machinery does the
retrying where it can (`max_restarts` restarts a killed actor, `max_task_retries` re-runs its
in-flight units on the restarted actor); the driver only re-queues units whose actor is gone for
good.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .config import ConfigError, HarvestConfig, cache_dir, fingerprint, redact_url
from .data import DataStats, iter_texts
from .packing import Packed, PackingError, pack_texts
from .plan import Layout, Unit, check_plan, choose_layout, make_units

log = logging.getLogger("harvest.pipeline")

RUN_ATTR = "harvest_run"
FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "HARVEST_CACHE",
                 "HF_HOME", "HF_HUB_OFFLINE")


class HarvestError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


class ResumeMismatch(HarvestError):
    """The store was made by a different config: resuming would make a mixed store."""


# --------------------------------------------------------------------------------------------------
# Preparation (no Ray, no engine): model facts, points, rows, layout
# --------------------------------------------------------------------------------------------------


def resolve_model_path(path: str) -> str:
    """`smollm2` and `tiny:<arch>` aliases -> checkpoint dirs (built once); others unchanged."""
    if path == "smollm2":
        from engine.models import smollm2_path

        return smollm2_path()
    if path.startswith("tiny:"):
        from engine.models import build_tiny_model

        arch = path.split(":", 1)[1] or "llama"
        return build_tiny_model(cache_dir() / "models" / f"tiny-{arch}", arch)
    local = os.path.expanduser(path)
    return os.path.abspath(local) if os.path.exists(local) else path


def resolve_points(points: list[str], n_layers: int) -> list[str]:
    """Expand `name.*` and range-check every address against the model; errors name the field."""
    from engine.addresses import KNOWN_POINTS, parse_addresses

    expanded: list[str] = []
    for p in points:
        name, _, layer = p.rpartition(".")
        if name not in KNOWN_POINTS:
            raise ConfigError(
                f"capture.points entry {p!r}: unknown point {name!r}; known points are "
                f"{', '.join(KNOWN_POINTS)}"
            )
        if layer == "*":
            expanded += [f"{name}.{i}" for i in range(n_layers)]
        else:
            expanded.append(p)
    try:
        return [str(a) for a in parse_addresses(expanded, n_layers)]
    except ValueError as e:
        raise ConfigError(f"capture.points: {e}") from None


@dataclass
class Prepared:
    cfg: HarvestConfig
    model_path: str
    n_layers: int
    width: int
    max_len: int
    points: list[str]
    packed: Packed
    data_stats: DataStats
    layout: Layout
    units: list[Unit]
    seconds: float

    @property
    def itemsize(self) -> int:
        return 4 if self.cfg.model.dtype == "float32" else 2

    @property
    def bytes_logical(self) -> int:
        return self.packed.n_rows * len(self.points) * self.width * self.itemsize

    def run_key(self) -> dict:
        """What the store remembers about the run, to refuse a mismatched resume."""
        return {
            "content": self.cfg.content_key(),
            "points": self.points,
            "n_rows": self.packed.n_rows,
            "context_size": self.cfg.packing.context_size,
            "tokens_sha256": self.packed.tokens_sha256(),
        }


def model_facts(cfg: HarvestConfig) -> tuple[str, Any]:
    from engine.common import read_model_info

    path = resolve_model_path(cfg.model.path)
    try:
        info = read_model_info(path)
    except Exception as e:
        raise ConfigError(
            f"model.path={cfg.model.path!r}: cannot read its config ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); give a checkpoint dir, a hub name, "
            "smollm2 or tiny:<arch>"
        ) from None
    return path, info


def context_limit(cfg: HarvestConfig, info) -> int:
    limit = min(cfg.model.max_model_len or info.max_position, info.max_position)
    # vLLM generates one token per request, so a prompt may use at most max_model_len - 1
    return limit - 1 if cfg.model.backend == "vllm" else limit


def prepare(cfg: HarvestConfig, store_layout: "tuple[int, int] | None" = None) -> Prepared:
    """Everything the plan needs, computed in the driver without an engine."""
    t0 = time.perf_counter()
    model_path, info = model_facts(cfg)
    points = resolve_points(cfg.capture.points, info.n_layers)
    limit = context_limit(cfg, info)
    C = cfg.packing.context_size
    if C > limit:
        raise ConfigError(
            f"packing.context_size={C} is larger than the model's limit of {limit} tokens per "
            f"context ({cfg.model.path}: max_position {info.max_position}"
            + (", minus 1 for vLLM's generated token" if cfg.model.backend == "vllm" else "")
            + f"): set packing.context_size <= {limit}"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stats = DataStats()
    packed = pack_texts(iter_texts(cfg.data, stats), tokenizer, cfg.packing)
    if packed.n_rows == 0:
        raise PackingError(
            f"the dataset gave no complete context: data.source={cfg.data.source!r} "
            f"(split {cfg.data.split!r}) had {stats.rows_read} rows, {stats.rows_skipped} without "
            f"usable text ({stats.skipped_reasons or 'none'}), {packed.stats.tokens_seen} tokens; "
            f"one context needs packing.context_size={C}: check data.source/data.text_column "
            "or lower packing.context_size"
        )
    if store_layout is not None:
        shard_rows, chunk_rows = store_layout
        layout = Layout(shard_rows, chunk_rows, shard_rows * cfg.store.unit_shards)
    else:
        layout = choose_layout(
            packed.n_rows, C, point_row_bytes=info.width * (4 if cfg.model.dtype == "float32" else 2),
            n_points=len(points), num_actors=cfg.ray.num_actors, shard_rows=cfg.store.shard_rows,
            chunk_rows=cfg.store.chunk_rows, unit_shards=cfg.store.unit_shards,
        )
    units = make_units(packed.n_rows, layout)
    check_plan(units, packed.n_rows, layout.shard_rows, C)
    return Prepared(cfg, model_path, info.n_layers, info.width, limit, points, packed, stats,
                    layout, units, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------
# Store probing and resume checks
# --------------------------------------------------------------------------------------------------


def probe_store(cfg: HarvestConfig):
    """The existing store at store.url, or None if the location is free.

    Fails fast (before any data is read) on a wrong endpoint or credentials, and refuses a
    location that holds something that is not a harvest store.
    """
    from pipeline.store import NotAHarvestStore, open_store
    from pipeline.store.backend import locate

    url = cfg.store.resolved_url
    try:
        return open_store(url, storage_options=cfg.store.storage_options)
    except NotAHarvestStore as e:
        loc = locate(url, cfg.store.storage_options)
        try:
            entries = loc.fs.ls(loc.root, detail=False) if loc.fs.exists(loc.root) else []
        except FileNotFoundError:
            entries = []
        except Exception as exc:
            raise loc.error("listing store.url", exc) from None
        if entries:
            raise HarvestError(
                f"store.url={redact_url(url)} is not empty and is not a harvest store ({e}): "
                "choose a new store.url"
            ) from None
        return None


def store_complete(store) -> bool:
    plan = store.plan()
    if not plan or store.summary is None:
        return False
    committed = store.committed_units()
    return all(u["unit_id"] in committed for u in plan)


def check_resume(store, cfg: HarvestConfig, prep: "Prepared | None") -> None:
    """Refuse to continue a store made by another config, naming the first differing setting."""
    stored = (store.attrs or {}).get(RUN_ATTR)
    if not stored:
        raise ResumeMismatch(
            f"store.url={store.url} is a harvest store not made by this pipeline's driver "
            "(no run attributes): choose a new store.url"
        )
    want = cfg.content_key()
    diffs = _diff(stored.get("content", {}), want)
    if prep is not None:
        for k in ("points", "n_rows", "context_size", "tokens_sha256"):
            if stored.get(k) != prep.run_key()[k]:
                diffs.append((k, stored.get(k), prep.run_key()[k]))
    for name in ("shard_rows", "chunk_rows"):
        v = getattr(cfg.store, name)
        if v is not None and v != getattr(store, name):
            diffs.append((f"store.{name}", getattr(store, name), v))
    if diffs:
        key, old, new = diffs[0]
        if key == "tokens_sha256":
            why = ("the same settings now give different tokens (the dataset changed under the "
                   "same name: pin data.revision, or use a dated path)")
        else:
            why = f"{key}: the store has {old!r}, this config says {new!r}"
        raise ResumeMismatch(
            f"store {store.url} was made by a different config ({why}); resuming would mix two "
            f"runs in one store: use the original config, or a new store.url"
            + (f" ({len(diffs) - 1} more difference(s))" if len(diffs) > 1 else "")
        )


def _diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b)]


# --------------------------------------------------------------------------------------------------
# Ray
# --------------------------------------------------------------------------------------------------


def ensure_ray(cfg: HarvestConfig) -> bool:
    """Connect to the cluster Ray gives us, or start a local one. True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"log_to_driver": True}
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        kw["address"] = address
    elif cfg.ray.local_num_cpus:
        kw["num_cpus"] = cfg.ray.local_num_cpus
    ray.init(**kw)
    return True


def actor_spec(cfg: HarvestConfig, prep: Prepared, index: int) -> dict:
    import multiprocessing

    threads = cfg.ray.threads_per_actor or max(1, multiprocessing.cpu_count() // cfg.ray.num_actors)
    return {
        "index": index,
        "model_path": prep.model_path,
        "engine_kwargs": cfg.model.engine_kwargs(prep.points),
        "points": prep.points,
        "context_size": cfg.packing.context_size,
        "batch_contexts": cfg.capture.batch_contexts,
        "store_url": cfg.store.resolved_url,
        "storage_options": cfg.store.storage_options,
        "threads": threads,
        "env": {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)},
    }


def start_actors(cfg: HarvestConfig, prep: Prepared) -> list:
    import ray

    from .actor import HarvestActor

    Remote = ray.remote(HarvestActor)
    cpus, gpus = cfg.ray.actor_resources(ray.cluster_resources())
    if gpus and cfg.model.tensor_parallel_size > gpus:
        gpus = float(cfg.model.tensor_parallel_size)
    log.info("starting %d actors with %s CPU and %s GPU each", cfg.ray.num_actors, cpus, gpus)
    opts = dict(
        num_cpus=cpus,
        num_gpus=gpus,
        max_restarts=cfg.ray.max_restarts,
        max_task_retries=cfg.ray.max_task_retries,
        max_concurrency=cfg.ray.max_in_flight,
    )
    return [Remote.options(**opts).remote(actor_spec(cfg, prep, i)) for i in range(cfg.ray.num_actors)]


def _root_cause(exc: BaseException) -> str:
    """The actor-side error text without Ray's wrapping traceback."""
    cause = getattr(exc, "cause", None)
    if cause is not None and cause is not exc:
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


@dataclass
class ActorFigures:
    """Per-actor figures. Units in flight overlap (one captures while the other commits), so a
    rate over summed unit times would understate the actor: the rate is over engine-busy time."""

    index: int
    pids: list = field(default_factory=list)
    units: int = 0
    tokens: int = 0
    engine_seconds: float = 0.0
    unit_seconds: float = 0.0
    failures: int = 0

    def as_dict(self) -> dict:
        return {
            "index": self.index, "pids": self.pids, "units": self.units, "tokens": self.tokens,
            "engine_seconds": round(self.engine_seconds, 3),
            "unit_seconds": round(self.unit_seconds, 3),
            "tokens_per_second": (round(self.tokens / self.engine_seconds, 1)
                                  if self.engine_seconds else None),
            "failures": self.failures,
        }


def run(cfg: HarvestConfig, on_event: "Callable[[dict], None] | None" = None) -> dict:
    """Run (or resume) the harvest described by `cfg`; returns the summary written to the store."""
    t_start = time.perf_counter()
    emit = on_event or (lambda e: None)
    url = cfg.store.resolved_url
    shown_url = redact_url(url)
    existing = probe_store(cfg)
    if existing is not None and store_complete(existing):
        check_resume(existing, cfg, None)
        s = dict(existing.summary or {})
        log.info("store %s is already complete (%s units, %s tokens, finished %s): nothing to do",
                 shown_url, s.get("units"), s.get("tokens"), s.get("finished_at"))
        s["noop"] = True
        emit({"event": "noop", "summary": s})
        return s

    store_layout = None
    if existing is not None and existing.plan():
        store_layout = (existing.shard_rows, existing.chunk_rows)
    prep = prepare(cfg, store_layout)
    log.info("plan: %d rows (%d contexts of %d) from %s, %d points x width %d, %d units of %d rows, "
             "%.2f GB uncompressed (prepared in %.1f s)", prep.packed.n_rows, prep.packed.n_contexts,
             cfg.packing.context_size, prep.data_stats.source, len(prep.points), prep.width,
             len(prep.units), prep.layout.unit_rows, prep.bytes_logical / 1e9, prep.seconds)
    if prep.data_stats.rows_skipped:
        log.warning("skipped %d of %d rows without usable text: %s", prep.data_stats.rows_skipped,
                    prep.data_stats.rows_read, prep.data_stats.skipped_reasons)

    fresh = existing is None or not existing.plan()
    if existing is not None:
        check_resume(existing, cfg, prep)
        if not fresh:
            stored_plan = [Unit.from_dict(u) for u in existing.plan()]
            if [u.as_dict() for u in stored_plan] != [u.as_dict() for u in prep.units]:
                raise ResumeMismatch(
                    f"store {shown_url} holds a plan of {len(stored_plan)} units that differs from "
                    f"this config's {len(prep.units)}: was store.unit_shards changed? use the "
                    "original value or a new store.url"
                )

    infos: list[dict] = []
    figures: dict = {}
    dispatch_seconds, retries, deaths = 0.0, 0, 0
    if not fresh and not [u for u in prep.units if u.unit_id not in existing.committed_units()]:
        # every unit committed but never finalized (the driver died at the very end): no actors
        store, todo, skipped = existing, [], len(prep.units)
        log.info("all %d units of %s are committed; finalizing", skipped, shown_url)
    else:
        started_ray = ensure_ray(cfg)
        actors: list = []
        try:
            actors = start_actors(cfg, prep)
            infos = _wait_actors(actors, cfg)
            for inf in infos:
                if inf["width"] != prep.width or inf["n_layers"] != prep.n_layers:
                    raise HarvestError(
                        f"actor {inf['index']} loaded a model of width {inf['width']} x "
                        f"{inf['n_layers']} layers, the config of {cfg.model.path} says "
                        f"{prep.width} x {prep.n_layers}"
                    )
            emit({"event": "actors_ready", "actors": infos})
            log.info("%d actors ready: %s", len(infos), ", ".join(
                f"#{i['index']} pid {i['pid']} ({i['describe'].get('backend')}/"
                f"{i['describe'].get('mode')}, load {i['load_seconds']:.1f} s)" for i in infos))

            store = _create(cfg, prep, infos[0], overwrite=existing is not None) if fresh else existing
            import ray

            for i, ref in enumerate([a.open_store.remote() for a in actors]):
                try:
                    ray.get(ref)
                except Exception as e:  # the dispatch loop handles a dead actor
                    log.warning("actor %d could not open the store: %s", i, _root_cause(e))
            committed = store.committed_units()
            todo = [u for u in prep.units if u.unit_id not in committed]
            skipped = len(prep.units) - len(todo)
            if skipped:
                log.info("resuming %s: %d of %d units already committed, %d to run", shown_url,
                         skipped, len(prep.units), len(todo))
            emit({"event": "plan", "units": len(prep.units), "todo": len(todo), "skipped": skipped})
            figures, dispatch_seconds, retries, deaths = _dispatch(cfg, actors, todo, emit)
        finally:
            import ray

            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
            if started_ray:
                ray.shutdown()

    verify = store.verify()
    if not verify["ok"] or verify["missing_units"]:
        raise HarvestError(
            f"store {shown_url} failed verification: {verify['errors'][:5]}"
            f"{' missing units ' + str(verify['missing_units'][:10]) if verify['missing_units'] else ''}"
        )
    tokens_run = sum(f.tokens for f in figures.values())
    shards = {sh["index"] for m in store.committed_units().values() for sh in m.get("shards", [])}
    stored = sum(store.stored_bytes(p, shards) for p in store.points)
    logical = store.n_rows * len(store.points) * store.row_bytes
    summary = {
        "name": cfg.name,
        "store": shown_url,
        "status": "complete",
        "model": infos[0]["describe"] if infos else (store.attrs or {}).get("model", {}),
        "points": len(store.points),
        "width": store.width,
        "context_size": cfg.packing.context_size,
        "tokens": store.n_rows,
        "tokens_this_run": tokens_run,
        "units": len(prep.units),
        "units_run": len(todo),
        "units_skipped": skipped,
        "bytes_logical": logical,
        "bytes_stored": stored,
        "compression_ratio": round(logical / stored, 4) if stored else None,
        "dispatch_seconds": round(dispatch_seconds, 3),
        "wall_seconds": round(time.perf_counter() - t_start, 3),
        "tokens_per_second": round(tokens_run / dispatch_seconds, 1) if dispatch_seconds else None,
        "per_actor": [f.as_dict() for f in figures.values()],
        "unit_retries": retries,
        "actor_deaths_seen": deaths,
        "data": prep.data_stats.as_dict(),
        "packing": prep.packed.stats.as_dict(),
        "verified": {k: verify[k] for k in ("ok", "planned_units", "committed_units", "committed_rows")},
        "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    store.finalize(summary)
    emit({"event": "done", "summary": summary})
    return summary


def _wait_actors(actors: list, cfg: HarvestConfig) -> list[dict]:
    import ray

    refs = [a.info.remote() for a in actors]
    t0 = time.time()
    while True:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=30)
        if not pending:
            break
        log.info("waiting for %d of %d actors to start (%.0f s; the cluster has %s)",
                 len(pending), len(refs), time.time() - t0,
                 {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")})
    infos = []
    for i, r in enumerate(refs):
        try:
            infos.append(ray.get(r))
        except Exception as e:
            raise HarvestError(
                f"actor {i} could not load the engine for model.path={cfg.model.path!r}: "
                f"{_root_cause(e)}"
            ) from None
    return infos


def _create(cfg: HarvestConfig, prep: Prepared, info0: dict, overwrite: bool):
    from pipeline.store import create_store

    attrs = {
        RUN_ATTR: prep.run_key(),
        "config": cfg.to_dict(redact=True),
        "model": info0["describe"],
        "model_path": prep.model_path,
        "points": prep.points,
        "data": prep.data_stats.as_dict(),
        "packing": prep.packed.stats.as_dict(),
        "tokenizer": {"bos": cfg.packing.bos},
    }
    store = create_store(
        cfg.store.resolved_url, points=prep.points, width=prep.width, n_rows=prep.packed.n_rows,
        shard_rows=prep.layout.shard_rows, chunk_rows=prep.layout.chunk_rows,
        dtype=cfg.model.dtype, compression=cfg.store.compression, attrs=attrs,
        storage_options=cfg.store.storage_options, overwrite=overwrite,
    )
    p = prep.packed
    store.write_row_meta(0, p.token_ids, p.doc_ids, p.positions)
    store.write_plan([u.as_dict() for u in prep.units])
    log.info("created store %s: %d rows, shards of %d rows, chunks of %d", store.url,
             store.n_rows, store.shard_rows, store.chunk_rows)
    return store


def _progress(cfg: HarvestConfig, total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, dynamic_ncols=True, smoothing=0.1,
                disable=not cfg.progress, file=sys.stderr, desc=cfg.name, mininterval=0.5)


def _dispatch(cfg: HarvestConfig, actors: list, todo: list[Unit], emit) -> tuple:
    """Hand units to actors, at most `max_in_flight` each; re-queue units of lost actors."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    n = len(actors)
    figures = {i: ActorFigures(i) for i in range(n)}
    pending: deque = deque((u, 1) for u in todo)
    inflight: dict = {}  # ref -> (unit, actor, attempt)
    load = [0] * n
    alive = set(range(n))
    probing: dict = {}  # ping ref -> actor index (actor under suspicion after an error)
    retries = deaths = 0
    bar = _progress(cfg, sum(u.n_rows for u in todo))
    t0 = time.perf_counter()
    try:
        while pending or inflight:
            for a in sorted(alive - set(probing.values()), key=lambda i: load[i]):
                while pending and load[a] < cfg.ray.max_in_flight:
                    unit, attempt = pending.popleft()
                    ref = actors[a].run_unit.remote(unit.as_dict(), attempt)
                    inflight[ref] = (unit, a, attempt)
                    load[a] += 1
            if not inflight and not probing:
                raise HarvestError(
                    f"every actor is gone ({deaths} deaths) with {len(pending)} units left: the "
                    "store is resumable; check the actor logs and re-run the same config"
                )
            ready, _ = ray.wait(list(inflight) + list(probing), num_returns=1, timeout=5.0)
            for ref in ready:
                if ref in probing:
                    a = probing.pop(ref)
                    try:
                        ray.get(ref)
                        log.info("actor %d answers again after a failure", a)
                    except Exception:
                        alive.discard(a)
                        deaths += 1
                        log.warning("actor %d is gone for good; %d actors left", a, len(alive))
                        emit({"event": "actor_lost", "actor": a})
                    continue
                unit, a, attempt = inflight.pop(ref)
                load[a] -= 1
                try:
                    res = ray.get(ref)
                except (RayActorError, RayTaskError) as e:
                    figures[a].failures += 1
                    actor_died = isinstance(e, RayActorError)
                    why = _root_cause(e)
                    if attempt >= cfg.ray.unit_attempts:
                        raise HarvestError(
                            f"unit {unit.unit_id} rows [{unit.row_start}, {unit.row_end}) failed "
                            f"{attempt} times, last on actor {a}: {why}. The store is resumable: "
                            "fix the cause and re-run the same config"
                        ) from None
                    retries += 1
                    log.warning("unit %d failed on actor %d (attempt %d, %s): %s; re-queued",
                                unit.unit_id, a, attempt,
                                "actor died" if actor_died else "task error", why)
                    emit({"event": "unit_retry", "unit": unit.unit_id, "actor": a,
                          "attempt": attempt, "error": why})
                    pending.appendleft((unit, attempt + 1))
                    if actor_died and a in alive and a not in probing.values():
                        probing[actors[a].ping.remote()] = a
                    continue
                f = figures[a]
                if res["pid"] not in f.pids:
                    f.pids.append(res["pid"])
                if res["status"] == "committed":
                    f.units += 1
                    f.tokens += res["tokens"]
                    f.unit_seconds += res["seconds"]
                    f.engine_seconds += res.get("capture_seconds") or res["seconds"]
                bar.update(unit.n_rows)
                rate = unit.n_rows / res["seconds"] if res.get("seconds") else 0.0
                log.info("unit %d rows [%d, %d) %s by actor %d pid %d in %.2f s (%.0f tok/s, "
                         "attempt %d)", unit.unit_id, unit.row_start, unit.row_end, res["status"],
                         a, res["pid"], res.get("seconds", 0.0), rate, attempt)
                emit({"event": "unit_done", **{k: v for k, v in res.items() if k != "manifest"},
                      "in_flight": {i: load[i] for i in range(n)}})
    finally:
        bar.close()
    return figures, time.perf_counter() - t0, retries, deaths


# --------------------------------------------------------------------------------------------------
# Read-only views for the CLI
# --------------------------------------------------------------------------------------------------


def status(url: str, storage_options: dict | None = None) -> dict:
    """Progress of a running or interrupted job, from the store alone."""
    from pipeline.store import open_store

    store = open_store(url, storage_options=storage_options, read_only=True)
    plan = store.plan()
    committed = store.committed_units()
    planned_rows = sum(u["row_end"] - u["row_start"] for u in plan)
    done_rows = sum(m["row_end"] - m["row_start"] for m in committed.values())
    per_actor: dict = {}
    times = []
    for m in committed.values():
        extra = m.get("extra") or {}
        key = f"{extra.get('host', m.get('host'))}/actor{extra.get('actor', '?')}"
        d = per_actor.setdefault(key, {"units": 0, "tokens": 0, "seconds": 0.0, "pids": set()})
        d["units"] += 1
        d["tokens"] += m["row_end"] - m["row_start"]
        d["seconds"] += float(m.get("seconds") or 0.0)
        d["pids"].add(m.get("pid"))
        if m.get("committed_at"):
            times.append(_dt.datetime.fromisoformat(m["committed_at"]))
    rate = eta = None
    if len(times) >= 2 and max(times) > min(times):
        span = (max(times) - min(times)).total_seconds()
        first_unit = min(committed.values(), key=lambda m: m.get("committed_at", ""))
        rate = (done_rows - (first_unit["row_end"] - first_unit["row_start"])) / span
        eta = (planned_rows - done_rows) / rate if rate > 0 else None
    return {
        "url": store.url,
        "name": ((store.attrs or {}).get("config") or {}).get("name"),
        "planned_units": len(plan),
        "committed_units": len(committed),
        "missing_units": sorted(set(u["unit_id"] for u in plan) - set(committed))[:50],
        "planned_rows": planned_rows,
        "committed_rows": done_rows,
        "fraction": done_rows / planned_rows if planned_rows else 0.0,
        "finalized": store.summary is not None,
        "last_commit": max(times).isoformat() if times else None,
        "recent_tokens_per_second": round(rate, 1) if rate else None,
        "eta_seconds": round(eta, 1) if eta else None,
        "per_actor": {k: {**v, "pids": sorted(p for p in v["pids"] if p is not None)}
                      for k, v in sorted(per_actor.items())},
        "summary": store.summary,
    }


def inspect(url: str, storage_options: dict | None = None, rows: "tuple[int, int] | None" = None,
            tokenizer_path: str | None = None) -> dict:
    """Layout, run attributes and (optionally) some rows with their metadata and norms."""
    from pipeline.store import open_store

    store = open_store(url, storage_options=storage_options, read_only=True)
    out = {k: v for k, v in store.info().items() if k != "stats"}
    if rows is not None:
        a, b = rows
        tok, doc, pos = store.read_row_meta(a, b)
        norms = {}
        for p in store.points[:4]:
            x = np.asarray(store.read(p, a, b)).astype(np.float32)
            norms[p] = np.round(np.linalg.norm(x, axis=1), 3).tolist()
        out["rows"] = {"start": a, "stop": b, "token_id": tok.tolist(), "doc_id": doc.tolist(),
                       "position": pos.tolist(), "norms": norms}
        path = tokenizer_path or (store.attrs or {}).get("model_path")
        if path:
            try:
                from transformers import AutoTokenizer

                t = AutoTokenizer.from_pretrained(path)
                out["rows"]["text"] = [t.decode([int(i)]) for i in tok.tolist()]
            except Exception:
                pass
    return out
