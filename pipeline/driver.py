"""The driver: config -> blocks -> (tokenising workers -> plan -> capture actors) -> verified,
summarized store.

Order matters and is chosen so that bad input costs nothing: the store URL is probed first
(credentials, endpoint; every request under store.timeout_s), a live lease of another driver
refuses the run, then this driver's lease is taken (lease.py: the first write, so a read-only
location fails here), then the model's config, tokenizer and the data source are checked from
metadata (prepare.py); only then does Ray start. A run that fails before the store is created
removes its lease again: bad input leaves nothing behind. Tokenising workers and capture actors start
together; the store is created when the actors are ready and the first unit is placed, so a
corpus that yields no complete context leaves nothing behind either.

The driver holds descriptors only (see dispatch.py): its memory and its time to the first
committed unit do not grow with the corpus.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from typing import Callable

from .cluster import collect_infos, ensure_ray, kill_all, start_actors
from .config import HarvestConfig, redact_url
from .dispatch import Scheduler
from .errors import HarvestError, ResumeMismatch  # noqa: F401 -- re-exported for callers
from .logs import StartWatch, progress_bar
from .packing import PackingError
from .placement import sum_stats
from .prepare import Prepared, prepare
from .lease import Lease, refuse_if_held
from .resume import RUN_ATTR, check_resume, fresh_state, probe_store, resume_state
from .store.backend import locate
from .tokenpool import TokenPool, env_for_workers

log = logging.getLogger("harvest.pipeline")

DATA_KEYS = ("rows_read", "rows_skipped", "skipped_reasons")


def run(cfg: HarvestConfig, on_event: "Callable[[dict], None] | None" = None,
        engine_factory: str | None = None) -> dict:
    """Run (or resume) the harvest described by `cfg`; returns the summary written to the store.

    `engine_factory` ("module:callable") replaces the capture engine (benchmarks of the
    bookkeeping alone); runs never set it.
    """
    t_start = time.perf_counter()
    shown_url = redact_url(cfg.store.resolved_url)
    existing = probe_store(cfg, create_bucket=cfg.store.create_bucket)
    loc = existing.location if existing is not None else locate(cfg.store.resolved_url,
                                                                cfg.store.fs_options())
    refuse_if_held(loc, cfg.store.lease_seconds, shown_url)
    if existing is not None:
        check_resume(existing, cfg)
    # the first write, before the data is read or Ray starts: a read-only place fails here
    lease = Lease(loc, cfg.store.lease_seconds, shown_url, cfg.content_key(), cfg.name).acquire()
    created = [existing is not None]
    try:
        return _run(cfg, on_event, engine_factory, existing, lease, created, t_start)
    finally:
        if created[0]:
            lease.release()
        else:  # failed before the store existed: leave nothing behind
            lease.remove_if_alone()


def _run(cfg: HarvestConfig, on_event, engine_factory, existing, lease: Lease, created: list,
         t_start: float) -> dict:
    emit = on_event or (lambda e: None)
    shown_url = redact_url(cfg.store.resolved_url)
    prep = prepare(cfg, existing)
    log.info("prepared in %.1f s: %d blocks of %s, %d points x width %d", prep.seconds,
             len(prep.sources["blocks"]), prep.sources["description"], len(prep.points), prep.width)
    C = cfg.packing.context_size
    max_contexts = None if cfg.packing.max_tokens is None else cfg.packing.max_tokens // C
    if existing is not None:
        check_resume(existing, cfg, prep)
        state = resume_state(existing, prep, max_contexts)
        if state.complete and existing.summary is not None:
            s = dict(existing.summary or {})
            log.info("store %s is already complete (%s units, %s tokens, finished %s): nothing to do",
                     shown_url, s.get("units"), s.get("tokens"), s.get("finished_at"))
            return {**s, "noop": True}
    else:
        state = fresh_state(prep, max_contexts)
    if not prep.sources["blocks"]:
        raise PackingError(f"data.source={cfg.data.source!r} has no data files: nothing to harvest")
    if existing is not None and state.complete:
        # every unit committed but never finalized (the driver died at the very end): no actors
        log.info("all %d units of %s are committed; finalizing", len(state.units), shown_url)
        lease.assert_held("finalizing")
        return _finish(cfg, prep, existing, None, t_start, emit, len(state.units))
    if existing is not None and state.committed:
        log.info("resuming %s: %d of %d planned units committed, %d to run; %d tokenising jobs",
                 shown_url, len(state.committed), len(state.units), len(state.todo), len(state.jobs))

    started_ray = ensure_ray(cfg)
    pool = actors = sched = None
    try:
        chunk_contexts = max(1, cfg.packing.chunk_tokens // C)
        if existing is not None:
            chunk_contexts = int((existing.plans.read_sources() or {}).get("chunk_contexts", chunk_contexts))
        pool = TokenPool.start(cfg, prep, list(state.jobs), state.fresh_from, chunk_contexts,
                               max_contexts, env_for_workers())
        actors = start_actors(cfg, prep, engine_factory)
        sched = Scheduler(cfg, prep, state, pool, emit, lease)
        bar = _progress(cfg, None if max_contexts is None else max_contexts * C)
        try:
            store = _start(cfg, prep, sched, actors, existing, chunk_contexts, bar, emit, lease,
                           created)
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
            import ray

            ray.shutdown()
    lease.assert_held("finalizing")
    return _finish(cfg, prep, store, sched, t_start, emit, len(state.committed),
                   dispatch_seconds=dispatch_seconds)


def _start(cfg, prep: Prepared, sched: Scheduler, actors: list, existing, chunk_contexts: int,
           bar, emit, lease: Lease, created: list):
    """Tokenise while the actors load; create the store once both are ready. Returns the store."""
    import ray

    refs = [a.info.remote() for a in actors]
    pending = list(refs)
    watch = StartWatch(len(refs), time.time())
    infos = None
    while True:
        got = sched.step(bar, extra=pending, timeout=2.0)
        pending = [r for r in pending if not any(r is g for g in got)]
        if not pending and infos is None:
            infos = collect_infos(refs, cfg, prep)
            _model_check(infos[0], cfg)
            emit({"event": "actors_ready", "actors": infos})
            log.info("%d actors ready: %s", len(infos), ", ".join(
                f"#{i['index']} pid {i['pid']} ({i['describe'].get('backend')}/"
                f"{i['describe'].get('mode')}, load {i['load_seconds']:.1f} s)" for i in infos))
        if existing is None and sched.frontier.done and sched.frontier.placed == 0:
            d = sched.data_stats()
            raise PackingError(
                f"the dataset gave no complete context: data.source={cfg.data.source!r} "
                f"(split {cfg.data.split!r}) had {d.get('rows_read', 0)} rows, "
                f"{d.get('rows_skipped', 0)} without usable text ({d.get('skipped_reasons') or 'none'}), "
                f"{d.get('tokens_seen', 0)} tokens; one context needs packing.context_size="
                f"{cfg.packing.context_size}: check data.source/data.text_column or lower "
                "packing.context_size")
        have_work = sched.unplanned or sched.ready or sched.waiting or existing is not None
        if infos is not None and have_work:
            break
        if pending:
            watch.tick(len(pending))
    if existing is None:
        lease.assert_held("creating the store")
        store = _create(cfg, prep, infos[0], chunk_contexts)
        created[0] = True
        store.location.budget_s = cfg.store.retry_budget_s  # re-opened by create_store
    else:
        store = existing
        if store.plans.read_sources() is None:  # its creator died before recording them
            lease.assert_held("recording the store's sources")
            store.plans.write_sources({**prep.sources, "unit_rows": prep.layout.unit_rows,
                                       "chunk_contexts": chunk_contexts})
    limit = cfg.ray.unit_timeout_s or cfg.ray.unit_timeout_min_s
    for i, ref in enumerate([a.open_store.remote() for a in actors]):
        try:  # bounded: a hung actor is the dispatch loop's to handle (its unit deadline)
            ray.get(ref, timeout=limit)
        except Exception as e:  # the dispatch loop handles a dead actor
            log.warning("actor %d could not open the store: %s", i, e)
    sched.attach(store, actors, infos)
    emit({"event": "plan", "planned": len(sched.plan_units), "todo": len(sched.waiting),
          "skipped": len(sched.state.committed), "slots_per_actor": sched.slots})
    return store


def _model_check(info0: dict, cfg: HarvestConfig) -> None:
    """Stop before anything is written when actor 0's engine disagrees with Hugging Face fp32
    (capture.check_model): the store would otherwise fill with rows that look fine and are not."""
    check = info0.get("check")
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
        from harvest.engine.check import format_check

        why = "\n" + format_check(check)
    raise HarvestError(
        f"model check failed on actor 0: the engine's rows for model.path={cfg.model.path!r} do "
        f"not match Hugging Face fp32: {why}\nNothing was written. Run `harvest check-model "
        f"{cfg.model.path}` for details; set capture.check_model: false only if you know why.")


def _create(cfg: HarvestConfig, prep: Prepared, info0: dict, chunk_contexts: int):
    from harvest.pipeline.store import create_store

    attrs = {
        RUN_ATTR: prep.run_key(),
        "config": cfg.to_dict(redact=True),
        "model": info0["describe"],
        "model_path": prep.model_path,
        "model_check": info0.get("check"),
        "points": prep.points,
        "data": {"source": prep.sources["description"], "blocks": len(prep.sources["blocks"])},
        "tokenizer": {"bos": cfg.packing.bos, "bos_token_id": prep.bos_token_id,
                      "special_token_ids": prep.special_token_ids, "path": prep.model_path},
    }
    L = prep.layout
    store = create_store(
        cfg.store.resolved_url, points=prep.points, width=prep.width, n_rows=L.capacity_rows,
        shard_rows=L.shard_rows, chunk_rows=L.chunk_rows, dtype=cfg.model.dtype,
        compression=cfg.store.compression, attrs=attrs, storage_options=cfg.store.fs_options(),
        create_bucket=cfg.store.create_bucket, context_size=cfg.packing.context_size,
        special_token_ids=prep.special_token_ids,
        bos_token_id=prep.bos_token_id, tokenizer=cfg.model.path,
        stats_skip_positions=prep.stats_skip_positions)
    store.plans.write_sources({**prep.sources, "unit_rows": L.unit_rows,
                               "chunk_contexts": chunk_contexts})
    log.info("created store %s: shards of %d rows, chunks of %d, units of %d rows, %d blocks",
             store.url, store.shard_rows, store.chunk_rows, L.unit_rows, len(prep.sources["blocks"]))
    return store


def _finish(cfg, prep: Prepared, store, sched: "Scheduler | None", t_start: float, emit,
            skipped: int, dispatch_seconds: float = 0.0) -> dict:
    # markers, plan coverage and recorded sizes only: listing every object is `harvest verify
    # --objects` (tens of thousands of LIST pages at corpus scale), never an end-of-run step
    verify = store.verify(objects=False)
    if not verify["ok"] or verify["missing_units"]:
        raise HarvestError(
            f"store {redact_url(store.url)} failed verification: {verify['errors'][:5]}"
            f"{' missing units ' + str(verify['missing_units'][:10]) if verify['missing_units'] else ''}")
    figures = sched.figures if sched is not None else {}
    tokens_run = sum(f.tokens for f in figures.values())
    stats = sched.data_stats() if sched is not None else _plan_stats(store)
    stored = verify.get("stored_bytes") or 0
    logical = verify["committed_rows"] * len(store.points) * store.row_bytes
    summary = {
        "name": cfg.name,
        "store": redact_url(store.url),
        "status": "complete",
        "model": (store.attrs or {}).get("model", {}),
        "points": len(store.points),
        "width": store.width,
        "context_size": cfg.packing.context_size,
        "tokens": verify["committed_rows"],
        "tokens_this_run": tokens_run,
        "units": verify["planned_units"],
        "units_run": sched.units_run if sched is not None else 0,
        "units_skipped": skipped,
        "bytes_logical": logical,
        "bytes_stored": stored,
        "compression_ratio": round(logical / stored, 4) if stored else None,
        "dispatch_seconds": round(dispatch_seconds, 3),
        "wall_seconds": round(time.perf_counter() - t_start, 3),
        "tokens_per_second": round(tokens_run / dispatch_seconds, 1) if dispatch_seconds else None,
        "per_actor": [f.as_dict() for f in figures.values()],
        **_fault_figures(sched, figures),
        "blocks": len(prep.sources["blocks"]),
        "tokenised_jobs": len(sched.pool.blocks_tokenised) if sched is not None else 0,
        "data": {"source": prep.sources["description"], **{k: stats.get(k, 0) for k in DATA_KEYS}},
        "packing": {k: v for k, v in stats.items() if k not in DATA_KEYS},
        "verified": {k: verify[k] for k in ("ok", "planned_units", "committed_units", "committed_rows")},
        "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    store.finalize(summary)
    emit({"event": "done", "summary": summary})
    return summary


def _fault_figures(sched: "Scheduler | None", figures: dict) -> dict:
    """Retries and deaths counted from what happened, Ray's own included: a unit Ray re-ran in
    a restarted actor (max_task_retries) reaches the loop as a success, seen only as a new pid
    (45 actor kills once read `unit_retries 0, actor deaths 0`)."""
    if sched is None:
        return {"unit_retries": 0, "ray_task_retries": 0, "unit_deadlines": 0,
                "actor_restarts": 0, "actors_lost": 0, "actor_deaths_seen": 0,
                "units_found_committed": 0}
    restarts = sum(f.restarts for f in figures.values())
    return {
        "unit_retries": sched.retries + sched.ray_retries,
        "ray_task_retries": sched.ray_retries,
        "unit_deadlines": sched.deadline_kills,
        "actor_restarts": restarts,
        "actors_lost": sched.deaths,
        # an actor killed at the deadline and not seen since (back or lost) died all the same
        "actor_deaths_seen": restarts + sched.deaths + len(sched.killed_unseen),
        # units_skipped + units_run + units_found_committed == units; per_actor units plus
        # already_committed sum to units_run + units_found_committed
        "units_found_committed": sched.found_committed,
    }


def _plan_stats(store) -> dict:
    chunks: dict = {}
    for p in store.plans.read(payloads=True)["payloads"]:
        chunks.update(p.get("chunks") or {})
    return sum_stats(chunks.values())


def _progress(cfg: HarvestConfig, total: int | None):
    return progress_bar(cfg.progress, total, cfg.name)


# Kept importable from here (the CLI and older callers): the read-only views and preparation.
from .views import inspect, status  # noqa: E402,F401
