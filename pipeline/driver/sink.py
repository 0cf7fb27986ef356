"""The run's write to its store, in the shape of Ray Data's `Datasink`: start, write, complete,
failed. The driver (run.py) reads as that sequence; this module owns what each step does to
the store and the lease, so no step can be skipped on some path out of the driver.

- `on_write_start`: probe the store URL (credentials, endpoint), refuse a store the actors'
  processes cannot share (memory://) or another driver holds, check a resume against the
  store's recorded run, take this driver's lease. The lease is the first write, before the
  data is read or Ray starts: a read-only place fails here.
- `create` / `reopen`: the store itself, once the actors know the model (its width and dtype
  come from the loaded engine), or the existing one on resume.
- the writes: each unit is written and committed by an actor (pipeline/actor/capture.py, store/write/writer.py); the
  driver's scheduler (dispatch.py) only hands them out. Nothing here.
- `on_resume`: a resumed store's committed units without a publish record are published, or
  uncommitted when their data is gone (re-captured by this run); a store shrunk by an early
  finalize gets its capacity back.
- `on_write_complete`: publish what writers left unpublished, verify (markers, plan coverage,
  publish records: no object listing), then finalize with the run's summary, under the lease.
- `on_write_failed`: publish what is committed (SIGTERM included); a run that failed before its
  store existed removes its lease again (bad input leaves nothing behind); otherwise the lease
  is released so a rerun resumes at once.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..data.chat import chat_attrs
from ..config.run import HarvestConfig
from ..errors import HarvestError
from ..messages import ActorInfo
from ..actor.generation import store_attrs
from .lease import Lease, refuse_if_held
from .prepare import Prepared
from .tally import RunSummary
from .resume import RUN_ATTR, check_resume, probe_store
from ...store import redact_url, SettleReport, Store, VerifyReport

log = logging.getLogger("harvest.pipeline")


class StoreSink:
    """One run's store and lease. `existing` is the store found at start (a resume), `store`
    the one being written (existing or created), `lease` this driver's lease."""

    writes_store = True   # (a stream without a store writes none: NullSink, pipeline/stream/hooks.py)

    def __init__(self, cfg: HarvestConfig):
        self.cfg = cfg
        self.location = cfg.store.location()   # located once: the probe, lease and store share it
        self.shown_url = redact_url(cfg.store.resolved_url)
        self.existing: Store | None = None   # the store a resume continues
        self.store: Store | None = None      # the run's store, once created or reopened
        self.lease: Lease | None = None

    @property
    def created(self) -> bool:
        """Whether a store exists that this run's lease belongs beside."""
        return self.existing is not None or self.store is not None

    # -- start -------------------------------------------------------------------------------
    def on_write_start(self) -> None:
        cfg = self.cfg
        # a missing bucket is created here when store.create_bucket (the lease is the first write)
        self.existing = probe_store(cfg.store, self.location, create_bucket=cfg.store.create_bucket)
        loc = self.location
        loc.require("shared", "a run's capture actors write the store from their own processes")
        refuse_if_held(loc, cfg.store.lease_seconds, self.shown_url)
        if self.existing is not None:
            check_resume(self.existing, cfg)
        self.lease = Lease(loc, cfg.store.lease_seconds, self.shown_url, cfg.content_key(),
                           cfg.name).acquire()

    def create(self, prep: Prepared, info0: ActorInfo, chunk_contexts: int):
        """The new store: layout from the plan, attributes from the run and actor 0's engine."""
        from ...store import create_store

        from ..data.provenance import run_provenance

        cfg = self.cfg
        self.lease.assert_held("creating the store")
        attrs = {
            RUN_ATTR: prep.run_key(),
            "config": cfg.to_dict(redact=True),
            "model": info0.describe,
            "model_path": prep.model_path,
            "model_check": info0.check,
            "points": prep.points,
            "data": {"source": prep.sources["description"], "blocks": len(prep.sources["blocks"])},
            "tokenizer": {"bos": cfg.packing.bos, "bos_token_id": prep.bos_token_id,
                          "special_token_ids": prep.special_token_ids, "path": prep.model_path},
            **chat_attrs(cfg.data, cfg.capture.roles),
            # model, tokenizer, data, settings hashed; the engine (and vLLM runner) that captured
            "provenance": run_provenance(cfg, prep, info0.describe),
        }
        if cfg.capture.generate is not None:
            # the reader skips rows without activations in a store that has this (FORMAT.md)
            attrs["generation"] = store_attrs(cfg.capture.generate, cfg.data.format == "chat",
                                              cfg.packing.context_size, prep.model_path)
        L = prep.layout
        store = create_store(
            self.location, points=prep.points, width=prep.width, widths=prep.widths,
            values=prep.values,
            n_rows=L.capacity_rows,
            shard_rows=L.shard_rows, chunk_rows=L.chunk_rows, dtype=cfg.store_dtype(),
            compression=cfg.store.compression, attrs=attrs,
            create_bucket=cfg.store.create_bucket, context_size=cfg.packing.context_size,
            special_token_ids=prep.special_token_ids,
            bos_token_id=prep.bos_token_id, tokenizer=cfg.model.path,
            stats_skip_positions=prep.stats_skip_positions, roles=cfg.data.format == "chat",
            generated=cfg.capture.generate is not None,
            logprob="logprob" in prep.scores, entropy="entropy" in prep.scores,
            samples=cfg.capture.generate is not None and cfg.capture.generate.n > 1,
            meta_chunk_rows=L.unit_rows)
        self.store = store
        store.ledger.plans.write_sources({**prep.sources, "unit_rows": L.unit_rows,
                                          "chunk_contexts": chunk_contexts})
        store.location.budget_s = cfg.store.retry_budget_s  # re-opened by create_store
        log.info("created store %s: shards of %d rows, chunks of %d, units of %d rows, %d blocks",
                 store.url, store.shard_rows, store.chunk_rows, L.unit_rows,
                 len(prep.sources["blocks"]))
        return store

    def reopen(self, prep: Prepared, chunk_contexts: int):
        """The existing store, its sources recorded if its creator died before doing so."""
        store = self.store = self.existing
        if store.ledger.plans.read_sources() is None:
            self.lease.assert_held("recording the store's sources")
            store.ledger.plans.write_sources({**prep.sources, "unit_rows": prep.layout.unit_rows,
                                              "chunk_contexts": chunk_contexts})
        return store

    def on_resume(self, store, capacity_rows: int) -> None:
        """Before a resume decides what is left: a store an old `Store.finalize` shrank while
        its plan was not fully committed gets its capacity back, and committed units without a
        publish record are published, or uncommitted (loudly) when their data is gone, so the
        resume re-captures them (store/commit/published.py)."""
        from ...store import plan_gap, unfinalize

        self.lease.assert_held("checking the committed units")
        gap = plan_gap(store)
        if gap is not None and unfinalize(store, capacity_rows):
            log.warning("store %s was finalized while %s: its arrays are back to %d rows and the "
                        "resume goes on", self.shown_url, gap, store.n_rows)
        self.settle(store, repair=True)

    def settle(self, store, repair: bool) -> SettleReport:
        return settle(store, self.shown_url, repair)

    # -- complete / failed -------------------------------------------------------------------
    def on_write_complete(self, store, summarize: Callable[[VerifyReport], RunSummary]) -> RunSummary:
        """Publish what a writer left unpublished (a unit whose data is gone is uncommitted and
        the run fails, naming it: a re-run re-captures it), verify (markers, plan coverage,
        publish records), then finalize with `summarize(verify)`; returns the summary."""
        self.lease.assert_held("finalizing")
        settle_or_fail(store, self.shown_url)
        # markers, plan coverage and recorded sizes only: listing every object is `harvest
        # verify --objects` (tens of thousands of LIST pages at corpus scale), never run here
        verify = store.verify(objects=False)
        if not verify.complete:
            missing = verify.missing_units
            raise HarvestError(
                f"store {redact_url(store.url)} failed verification: {verify.errors[:5]}"
                f"{' missing units ' + str(missing[:10]) if missing else ''}")
        summary = summarize(verify)
        store.finalize(summary)
        return summary

    def on_write_failed(self) -> None:
        """Publish what is committed (a SIGTERM or a failure must not leave committed units
        readable by harvest alone until a re-run), then release the lease."""
        if self.store is not None and self.lease is not None:
            try:
                self.lease.assert_held("publishing committed units")
                self.settle(self.store, repair=False)
            except Exception as e:  # noqa: BLE001 -- best effort: finalize/resume settle again
                log.warning("publishing committed units on the way out failed (%s: %s); "
                            "`harvest finalize %s` or the next run does it", type(e).__name__, e,
                            self.shown_url)
        self._let_go()

    def on_write_done(self) -> None:
        """After complete (or a run with nothing to do): the lease is released."""
        self._let_go()

    def _let_go(self) -> None:
        if self.lease is None:
            return
        if self.created:
            self.lease.release()
        else:  # nothing was created: leave nothing behind
            self.lease.remove_if_alone()


def settle(store, shown_url: str, repair: bool) -> SettleReport:
    """store.ledger.settle, its findings logged (store/commit/published.py)."""
    from ...store import settle_text

    report = store.ledger.settle(repair=repair)
    if report.published:
        log.info("published %d committed units their writers had not: %s",
                 len(report.published), report.published[:20])
    text = settle_text(report, shown_url)
    if text is not None:
        log.warning("%s", text)
    return report


def settle_or_fail(store, shown_url: str) -> None:
    """Before a run certifies its store (finalize, or a paused tick's verify): every committed
    unit published, or those whose data is gone uncommitted and the run failed, naming them (a
    re-run re-captures them)."""
    from ...store import settle_text

    report = settle(store, shown_url, repair=True)
    if report.uncommitted:
        raise HarvestError(f"store {shown_url}: {settle_text(report, shown_url)}")
