"""The driver: config -> blocks -> (tokenising workers -> plan -> capture actors) -> verified,
summarized store.

The write follows Ray Data's Datasink shape (sink.py): `on_write_start` (probe the store URL,
refuse a store another driver holds, take this driver's lease), the writes (units run by the
actors), `on_write_complete` (verify, finalize) or `on_write_failed` (release the lease, or
remove it when nothing was created). Order matters and is chosen so that bad input costs nothing:
the lease is the first write (a read-only location fails there), then the model's config,
tokenizer and the data source are checked from metadata (prepare.py); only then does Ray start.
Tokenising workers and capture actors start together; the store is created when the actors are
ready and the first unit is placed, so a corpus that yields no complete context leaves nothing
behind either.

The driver holds descriptors only (see dispatch.py): its memory and its time to the first
committed unit do not grow with the corpus.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import time
from typing import Callable, cast

from .cluster import (actor_request, actor_spec, collect_infos, ensure_ray, kill_all,
                      start_actors, start_report)
from ..config.run import HarvestConfig
from .dispatch import Scheduler
from .tally import DispatchReport, RunSummary
from ..errors import HarvestError
from .exits import orderly_signals, shutdown_ray
from ..logs import StartWatch, progress_bar
from ..data.packing import PackingError
from ..data.row_frontier import sum_stats
from ..data.documents import shown_source
from .prepare import Prepared, prepare
from .resume import check_resume_plan, fresh_state, resume_state
from .sink import StoreSink, settle_or_fail
from ...store import redact_url, THROTTLE, VerifyReport
from ..data.tokenpool import TokenPool, env_for_workers

log = logging.getLogger("harvest.pipeline")

DATA_KEYS = ("rows_read", "rows_skipped", "skipped_reasons")


def run(cfg: HarvestConfig, on_event: "Callable[[dict], None] | None" = None,
        engine_factory: str | None = None, stop_tokens: int | None = None,
        stream=None) -> RunSummary:
    """Run (or resume) the harvest described by `cfg`; returns the summary written to the store.

    `engine_factory` ("module:callable") replaces the capture engine (benchmarks of the
    bookkeeping alone); runs never set it. `stop_tokens` (a scheduled tick, pipeline/driver/schedule.py)
    pauses the run once that many more tokens are placed, rounded up to whole units: the store
    stays unfinalized and the next run resumes where this one paused (summary `"paused": True`).
    `stream` (a streamed run, pipeline/stream/hooks.py): the trainers' deal, each actor's stream
    section, the actors' handles for the trainers, and the sink (the store's with a tee, one
    that writes nothing without).
    """
    # SIGTERM/SIGHUP unwind like Ctrl-C from here on (exits.py): the finally blocks below release
    # the lease and stop the Ray this driver started on every way out
    with orderly_signals():
        return _run_leased(cfg, on_event, engine_factory, stop_tokens, stream)


def _run_leased(cfg: HarvestConfig, on_event, engine_factory, stop_tokens=None,
                stream=None) -> RunSummary:
    t_start = time.perf_counter()
    sink = StoreSink(cfg) if stream is None else stream.sink(cfg)
    sink.on_write_start()
    try:
        summary = _run(cfg, on_event, engine_factory, sink, t_start, stop_tokens, stream)
    except BaseException:
        sink.on_write_failed()
        raise
    sink.on_write_done()
    return summary


def _run(cfg: HarvestConfig, on_event, engine_factory, sink: StoreSink, t_start: float,
         stop_tokens: "int | None" = None, stream=None) -> RunSummary:
    """Prepare, then write: tokenising workers and capture actors run the units into the sink's
    store; then the sink completes (verify, finalize)."""
    emit = on_event or (lambda e: None)
    shown_url, existing, lease = sink.shown_url, sink.existing, sink.lease
    prep = prepare(cfg, existing)
    log.info("prepared in %.1f s: %d blocks of %s, %d points x width %d", prep.seconds,
             len(prep.sources["blocks"]), prep.sources["description"], len(prep.points), prep.width)
    C = cfg.packing.context_size
    max_contexts = None if cfg.packing.max_tokens is None else cfg.packing.max_tokens // C
    if existing is not None:
        check_resume_plan(existing, prep, cfg.data)   # the config was checked at on_write_start
        sink.on_resume(existing, prep.layout.capacity_rows)
        state = resume_state(existing, prep, max_contexts)
        if state.complete and existing.summary is not None:
            s = cast(RunSummary, dict(existing.summary or {}))
            log.info("store %s is already complete (%s units, %s tokens, finished %s): nothing to do",
                     shown_url, s.get("units"), s.get("tokens"), s.get("finished_at"))
            s["noop"] = True
            return s
    else:
        state = fresh_state(prep, max_contexts)
    if not prep.sources["blocks"]:
        raise PackingError(f"data.source={shown_source(cfg.data)!r} has no data files: nothing to harvest")
    if existing is not None and state.complete:
        # every unit committed but never finalized (the driver died at the very end): no actors
        log.info("all %d units of %s are committed; finalizing", len(state.units), shown_url)
        return _finish(cfg.name, prep, sink, existing, None, t_start, emit, len(state.units))
    if stop_tokens is not None:
        U = prep.layout.unit_contexts
        state.frontier.stop_contexts = state.frontier.placed + -(-stop_tokens // (C * U)) * U
    if existing is not None and state.committed:
        log.info("resuming %s: %d of %d planned units committed, %d to run; %d tokenising jobs",
                 shown_url, len(state.committed), len(state.units), len(state.todo), len(state.jobs))

    remote = bool(cfg.ray.address or os.environ.get("RAY_ADDRESS"))
    started_ray = ensure_ray(cfg.ray)
    pool = actors = sched = None
    try:
        chunk_contexts = max(1, cfg.packing.chunk_tokens // C)
        if existing is not None:
            chunk_contexts = int((existing.ledger.plans.read_sources() or {}).get("chunk_contexts", chunk_contexts))
        pool = TokenPool.start(cfg.data, cfg.packing, cfg.ray, prep, list(state.jobs),
                               state.fresh_from, chunk_contexts, max_contexts, env_for_workers())
        section = None if stream is None else stream.actor_section(prep)
        specs = [actor_spec(cfg, prep, i, engine_factory, section, sink.writes_store)
                 for i in range(cfg.ray.num_actors)]
        actors = start_actors(cfg.ray, cfg.model.tensor_parallel_size, specs,
                              local=started_ray and not remote)
        if stream is not None:
            stream.on_actors(actors, prep)   # the trainers take their rows from these
        sched = Scheduler(cfg.ray, prep, state, pool, emit, lease,
                          deal=None if stream is None else stream.deal,
                          plan_in_store=sink.writes_store)
        bar = progress_bar(cfg.progress, None if max_contexts is None else max_contexts * C,
                           cfg.name)
        try:
            store = _start(cfg, prep, sched, actors, sink, chunk_contexts, bar, emit,
                           skipped=len(state.committed))
            t_dispatch = time.perf_counter()
            while not sched.finished():
                sched.step(bar)
            dispatch_seconds = time.perf_counter() - t_dispatch
            sched.flush_plan(force=True)
            sched.collect_figures()
        finally:
            bar.close()
    finally:
        if sched is not None:
            sched.close()
        if pool is not None:
            pool.close()
        if actors:
            kill_all(actors)
        if started_ray:
            shutdown_ray()   # exits.py: and the watcher of a local cluster (reaper.py)
    if sched.frontier.paused:
        return _paused(cfg.name, prep, store, sched, t_start, emit, len(state.committed),
                       dispatch_seconds)
    return _finish(cfg.name, prep, sink, store, sched, t_start, emit, len(state.committed),
                   dispatch_seconds=dispatch_seconds)


def _paused(name: str, prep: Prepared, store, sched: Scheduler, t_start: float, emit, skipped: int,
            dispatch_seconds: float) -> RunSummary:
    """A tick's end (stop_tokens reached): every planned unit is committed, nothing finalized.
    The same verify as at the end (markers, plan coverage) so a tick never reports rows it lost;
    the summary is the caller's to keep (schedule.py records it beside the store)."""
    settle_or_fail(store, redact_url(store.url))   # sink.py: every committed unit published
    verify = store.verify(objects=False)
    if not verify.complete:
        raise HarvestError(f"store {redact_url(store.url)} failed verification after a paused "
                           f"run: {verify.errors[:5]} missing {verify.missing_units[:10]}")
    summary = _summary(name, prep, store, sched, verify, t_start, skipped, dispatch_seconds)
    summary["status"], summary["paused"] = "paused", True
    summary["planned_tokens"] = sched.frontier.placed * prep.context_size
    emit({"event": "done", "summary": summary})
    return summary


def _start(cfg, prep: Prepared, sched: Scheduler, actors: list, sink: StoreSink,
           chunk_contexts: int, bar, emit, skipped: int):
    """Tokenise while the actors load; create the store once both are ready. Returns the store."""
    import ray

    existing = sink.existing

    refs = [a.info.remote() for a in actors]
    pending = list(refs)
    watch = StartWatch(len(refs), time.time())
    infos = None
    while True:
        got = sched.step(bar, extra=pending, timeout=2.0)
        pending = [r for r in pending if not any(r is g for g in got)]
        if not pending and infos is None:
            infos = collect_infos(refs, cfg.model, prep)
            _model_check(infos[0].check, cfg.model.path)
            emit({"event": "actors_ready", "actors": [i.as_dict() for i in infos]})
            log.info("%d actors ready: %s", len(infos), ", ".join(
                f"#{i.index} pid {i.pid} ({i.describe.get('backend')}/"
                f"{i.describe.get('mode')}, load {i.load_seconds:.1f} s)" for i in infos))
        if existing is None and sched.frontier.done and sched.frontier.placed == 0:
            d = sched.data_stats()
            raise PackingError(
                f"the dataset gave no complete context: data.source={shown_source(cfg.data)!r} "
                f"(split {cfg.data.split!r}) had {d.get('rows_read', 0)} rows, "
                f"{d.get('rows_skipped', 0)} without usable text ({d.get('skipped_reasons') or 'none'}), "
                f"{d.get('tokens_seen', 0)} tokens; one context needs packing.context_size="
                f"{cfg.packing.context_size}: check data.source/data.text_column or lower "
                "packing.context_size")
        have_work = sched.has_work() or existing is not None
        if infos is not None and have_work:
            break
        if pending:
            watch.tick(len(pending))
            if time.time() - watch.t0 > cfg.ray.start_timeout_s:
                request = actor_request(cfg.ray, cfg.model.tensor_parallel_size)
                raise HarvestError(start_report(cfg.ray, actors, request, time.time() - watch.t0))
    if existing is None:
        store = sink.create(prep, infos[0], chunk_contexts)
    else:
        store = sink.reopen(prep, chunk_contexts)
    limit = cfg.ray.unit_timeout_s or cfg.ray.unit_timeout_min_s
    for i, ref in enumerate([a.open_store.remote() for a in actors] if store is not None else []):
        try:  # bounded: a hung actor is the dispatch loop's to handle (its unit deadline)
            ray.get(ref, timeout=limit)
        except Exception as e:  # the dispatch loop handles a dead actor
            log.warning("actor %d could not open the store: %s", i, e)
    plan = sched.attach(store, actors, infos)
    emit({"event": "plan", "planned": plan["planned"], "todo": plan["todo"], "skipped": skipped,
          "slots_per_actor": plan["slots_per_actor"]})
    return store


def _model_check(check: dict | None, model_path: str) -> None:
    """Stop before anything is written when actor 0's engine disagrees with Hugging Face fp32
    (capture.check_model; `check` is ActorInfo.check, None when it did not run): the store would
    otherwise fill with rows that look fine and are not."""
    if check is None:
        return
    if check.get("ok"):
        worst = (check.get("points") or {}).get(check.get("worst_point"), {})
        log.info("model check passed on actor 0 in %s s (worst point %s: p99 error %.4f vs HF fp32)",
                 check.get("seconds"), check.get("worst_point"), worst.get("p99", float("nan")))
        return
    if check.get("error"):
        why = check["error"]
    else:
        from ...engine.model_check import format_check

        why = "\n" + format_check(check)
    raise HarvestError(
        f"model check failed on actor 0: the engine's rows for model.path={model_path!r} do "
        f"not match Hugging Face fp32: {why}\nNothing was written. Run `harvest check-model "
        f"{model_path}` for details; set capture.check_model: false only if you know why.")


def _finish(name: str, prep: Prepared, sink: StoreSink, store, sched: "Scheduler | None",
            t_start: float, emit, skipped: int, dispatch_seconds: float = 0.0) -> RunSummary:
    summary = sink.on_write_complete(
        store, lambda verify: _summary(name, prep, store, sched, verify, t_start, skipped,
                                       dispatch_seconds))
    emit({"event": "done", "summary": summary})
    return summary


def _summary(name: str, prep: Prepared, store, sched: "Scheduler | None", verify: VerifyReport,
             t_start: float, skipped: int, dispatch_seconds: float) -> RunSummary:
    """The run's summary (`name`: the config's), recorded in the store at finalize and returned
    to the caller."""
    report = sched.report() if sched is not None else DispatchReport()
    tokens_run = report.tokens_run
    if store is None:   # a streamed run without a store (pipeline/stream/): nothing to verify
        return _streamed_summary(name, prep, report, t_start, dispatch_seconds)
    stats = report.data if report.data is not None else _plan_stats(store)
    stored = verify.stored_bytes or 0
    logical = verify.committed_rows * len(store.points) * store.row_bytes
    summary: RunSummary = {
        "name": name,
        "store": redact_url(store.url),
        "status": "complete",
        "model": (store.attrs or {}).get("model", {}),
        "points": len(store.points),
        "width": store.width,
        "context_size": prep.context_size,
        "tokens": verify.committed_rows,
        "tokens_this_run": tokens_run,
        # of those rows, the ones holding activations (not zeroed by capture.roles, not a
        # generation slot's padding or last token): what a reader yields by default
        "rows_with_activations_this_run": report.rows_with_activations_run,
        "units": verify.planned_units,
        "units_run": report.units_run,
        "units_skipped": skipped,
        "bytes_logical": logical,
        "bytes_stored": stored,
        "compression_ratio": round(logical / stored, 4) if stored else None,
        "dispatch_seconds": round(dispatch_seconds, 3),
        "wall_seconds": round(time.perf_counter() - t_start, 3),
        "tokens_per_second": round(tokens_run / dispatch_seconds, 1) if dispatch_seconds else None,
        "per_actor": report.per_actor,
        **report.fault_figures(),
        # storage requests the server throttled, retried after a shared backoff: the actors'
        # and this driver's (a unit is re-captured only when its data is lost, never for these)
        "throttled_requests": sum(a.get("throttled_requests") or 0 for a in report.per_actor)
        + THROTTLE.throttled,
        "blocks": len(prep.sources["blocks"]),
        "tokenised_jobs": report.tokenised_jobs,
        "data": {"source": prep.sources["description"], **{k: stats.get(k, 0) for k in DATA_KEYS}},
        "packing": {k: v for k, v in stats.items() if k not in DATA_KEYS},
        "verified": {"ok": verify.ok, "planned_units": verify.planned_units,
                     "committed_units": verify.committed_units, "committed_rows": verify.committed_rows},
        "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return summary


def _streamed_summary(name: str, prep: Prepared, report: DispatchReport, t_start: float,
                      dispatch_seconds: float) -> RunSummary:
    """A streamed run's summary when no store was written: what was captured and handed to the
    trainers (the trainers' own figures are theirs: pipeline/stream/)."""
    stats = report.data or {}
    tokens = report.tokens_run
    summary: RunSummary = {
        "name": name, "store": None, "status": "complete", "model": {"path": prep.model_path},
        "points": len(prep.points), "width": prep.width, "context_size": prep.context_size,
        "tokens": tokens, "tokens_this_run": tokens,
        "rows_with_activations_this_run": report.rows_with_activations_run,
        "units": report.units_run, "units_run": report.units_run, "units_skipped": 0,
        "bytes_logical": tokens * sum(prep.point_bytes().values()),
        "bytes_stored": 0, "compression_ratio": None,
        "dispatch_seconds": round(dispatch_seconds, 3),
        "wall_seconds": round(time.perf_counter() - t_start, 3),
        "tokens_per_second": round(tokens / dispatch_seconds, 1) if dispatch_seconds else None,
        "per_actor": report.per_actor, **report.fault_figures(), "throttled_requests": 0,
        "blocks": len(prep.sources["blocks"]), "tokenised_jobs": report.tokenised_jobs,
        "data": {"source": prep.sources["description"], **{k: stats.get(k, 0) for k in DATA_KEYS}},
        "packing": {k: v for k, v in stats.items() if k not in DATA_KEYS},
        "verified": None,
        "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return summary


def _plan_stats(store) -> dict:
    chunks: dict = {}
    for p in store.ledger.plans.read(payloads=True).payloads:
        chunks.update(p.get("chunks") or {})
    return sum_stats(chunks.values())


