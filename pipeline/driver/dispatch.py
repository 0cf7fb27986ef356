"""The driver's loop: tokenised chunks in, planned units out to the actors, commits back.

It holds small descriptors only (chunk counts and digests, units, per-actor figures) and Ray
references to the tokens, never the tokens: memory O(units + chunks in the window), flat in corpus
size. Units are planned (a plan segment written) before they are dispatched and dispatched in
order as tokenisation places them, so the first commit comes after one chunk is tokenised however
large the corpus is.

Exactly once comes from the store, not from the scheduler: a unit is done when its marker exists,
so the loop may hand a unit out again whenever it is unsure (an actor died, a task errored).
Ray's own machinery does the retrying where it can (`max_restarts`, `max_task_retries`); the loop
re-queues units whose actor is gone for good.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

from .cluster import root_cause
from .tally import DispatchReport, UnitCounts
from ..errors import HarvestError
from .health import ActorHealth, WaitLine
from .holdings import Holdings
from .inflight import InFlight
from ..messages import ActorInfo, UnitResult
from .plan_writer import PlanWriter
from ...store import IndexBuilder, index_batch
from ..messages import ChunkDescriptor

log = logging.getLogger("harvest.pipeline")


class CommitIndex:
    """Markers copied into the store's commit index in batches (store.commits.index_batch)."""

    def __init__(self, store):
        self.store = store
        self.builder = IndexBuilder()
        self.indexed = 0

    def add(self, marker) -> None:
        self.builder.add(marker)
        self.flush()

    def flush(self, force: bool = False) -> None:
        if self.builder.count and (force or self.builder.count >= index_batch(self.indexed)):
            self.store.ledger.write_index(self.builder)
            self.indexed += self.builder.count
            self.builder = IndexBuilder()


class Scheduler:
    """One run's loop; `driver.run` builds it, then `attach`es the actors and `step`s it until
    `finished()`.

    Each concern keeps its own state, in its own module: `units` (chunks held, units waiting and
    ready), `plan` (the plan segments), `health` (the actors: alive, pids, pings, deadlines),
    `inflight` (units handed out), `counts` (what became of them), `index` (the commit index),
    `waits` (no silent waits). The driver reads `frontier`, `has_work()`, `data_stats()` and, for
    the summary, `report()`; it touches none of those objects."""

    def __init__(self, ray_cfg, prep, state, pool, emit, lease=None, deal=None,
                 plan_in_store: bool = True):
        """`deal` (a streamed run, pipeline/stream/deal.py): stamps each unit's task with the
        trainer rank of each of its rows before it is sent, and may hold a unit back until it
        can (`stamp` returns None). `plan_in_store=False`: no store holds the plan (a stream
        without a tee), units are dispatchable as soon as they are placed."""
        self.ray_cfg, self.pool, self.emit = ray_cfg, pool, emit
        self.deal = deal
        self.units = Holdings(state, prep.context_size, prep.layout.unit_rows)
        self.plan = PlanWriter(state, lease, in_store=plan_in_store)
        self.health = ActorHealth(ray_cfg, emit)
        self.inflight = InFlight(ray_cfg.max_in_flight)
        self.counts = UnitCounts()
        self.index: CommitIndex | None = None
        self.waits = WaitLine()

    # ---- what the driver reads -------------------------------------------------------------
    @property
    def frontier(self):
        return self.units.frontier

    def has_work(self) -> bool:
        """Units placed, planned or waiting for their chunks: the store can be created."""
        return bool(self.plan.unplanned or self.units.ready or self.units.waiting)

    def data_stats(self) -> dict:
        return self.plan.data_stats()

    def report(self) -> DispatchReport:
        """The run's dispatch figures for its summary (driver._summary)."""
        h = self.health
        return DispatchReport(
            per_actor=[f.as_dict() for f in h.figures.values()],
            tokens_run=sum(f.tokens for f in h.figures.values()),
            rows_with_activations_run=sum(f.rows_with_activations for f in h.figures.values()),
            actor_restarts=sum(f.restarts for f in h.figures.values()),
            units_run=self.counts.units_run, found_committed=self.counts.found_committed,
            retries=self.counts.retries, ray_retries=self.counts.ray_retries,
            deadline_kills=h.deadline_kills, deaths=h.deaths, killed_unseen=len(h.killed_unseen),
            tokenised_jobs=len(self.pool.blocks_tokenised), data=self.data_stats())

    # ---- chunks ----------------------------------------------------------------------------
    def on_chunk(self, arrays_ref, desc: ChunkDescriptor) -> None:
        b, j = desc.block, desc.chunk
        self.plan.check_chunk(b, j, desc)
        wanted = self.units.wants(b, j)
        self.emit({"event": "chunk", "block": b, "chunk": j, "n_contexts": desc.n_contexts,
                   "kept": wanted, "pid": desc.pid})
        if not wanted:
            return
        self.units.hold(arrays_ref, desc)
        self.plan.add(self.units.place(desc))
        if self.frontier.done:
            self.pool.stop()

    def flush_plan(self, force: bool = False) -> None:
        free = self.inflight.free(self.health.alive) if self.health.actors else 1
        units = self.plan.flush(force, len(self.units.ready), free, self.frontier.done)
        self.units.ready.extend((u, 1) for u in units)

    # ---- actors ------------------------------------------------------------------------------
    def attach(self, store, actors: list, infos: list[ActorInfo]) -> dict:
        """Actors are ready and the store exists: start dispatching. Returns the plan's figures
        (units planned, waiting for chunks, slots per actor)."""
        self.plan.store = store
        self.health.attach(actors, infos)
        unit_rows = self.units.unit_rows
        queue = max(i.queue_tokens for i in infos)
        # enough units in flight per actor that its engine never runs dry between units
        slots = max(self.ray_cfg.max_in_flight, math.ceil(queue / unit_rows) + 1)
        self.inflight.attach(len(actors), min(slots, 60))
        self.units.size_window(len(actors), self.inflight.slots)
        self.index = CommitIndex(store)
        return {"planned": len(self.plan.units), "todo": len(self.units.waiting),
                "slots_per_actor": self.inflight.slots}

    def _dispatch(self) -> None:
        """One unit at a time to the least loaded actor: small runs still spread over actors."""
        usable = self.health.usable()
        load = self.inflight.load
        if self.deal is not None:
            self.deal.count(self.units.ready, self.units.task, self.placed_all())
            self._dispatch_replays(usable)
        while self.units.ready and usable:
            a = min(usable, key=lambda i: load[i])
            if load[a] >= self.inflight.slots:
                return
            unit, attempt = self.units.ready[0]
            task = self.units.task(unit)
            if self.deal is not None:
                task = self.deal.stamp(task, self.placed_all())
                if task is None:   # its trainer ranks are not known yet (deal.py)
                    return
            self.units.ready.popleft()
            if self.deal is not None:
                self.deal.sent_unit(unit, task)
            ref = self.health.actors[a].run_unit.remote(task, attempt)
            self.inflight.add(ref, unit, a, attempt, self.health.pid.get(a))
            self.emit({"event": "unit_sent", "unit": unit.unit_id, "actor": a, "attempt": attempt})

    def _dispatch_replays(self, usable: list) -> None:
        """A streamed run's units captured again for a rank that resumed (deal.py), ahead of
        the others; they touch neither the plan nor the units' bookkeeping."""
        load = self.inflight.load
        while usable:
            a = min(usable, key=lambda i: load[i])
            if load[a] >= self.inflight.slots:
                return
            item = self.deal.next_replay()
            if item is None:
                return
            unit, task, attempt = item
            ref = self.health.actors[a].run_unit.remote(task, attempt)
            self.inflight.add(ref, unit, a, attempt, self.health.pid.get(a), replay=task)
            self.emit({"event": "unit_replay", "unit": unit.unit_id, "actor": a,
                       "ranks": list(task.deal.ranks or ())})

    def _on_replay(self, ref, sent, res) -> None:
        """A replay came back: done, or sent again (the rank still needs its rows)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        self.health.finished_unit(sent.actor)
        self.waits.event()
        try:
            if res is None:
                res = ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            why = root_cause(e)
            if sent.attempt >= self.ray_cfg.unit_attempts:
                raise HarvestError(f"unit {sent.unit.unit_id}'s replay for a resumed rank failed "
                                   f"{sent.attempt} times, last on actor {sent.actor}: {why}") from None
            log.warning("replay of unit %d failed on actor %d (%s); sent again", sent.unit.unit_id,
                        sent.actor, why)
            self.deal.requeue_replay(sent.unit, sent.replay, sent.attempt + 1)
            if isinstance(e, RayActorError):
                self.health.probe_once(sent.actor)
            return
        self.emit({"event": "unit_replayed", **res.event()})

    def _requeue(self, unit, a: int, attempt: int, why: str, fix: str = "") -> None:
        """A unit failed on actor `a` (an error, the actor's death, the deadline): it goes back
        to the front of the queue, or the run stops once it has failed unit_attempts times."""
        self.health.figures[a].failures += 1
        if attempt >= self.ray_cfg.unit_attempts:
            raise HarvestError(
                f"unit {unit.unit_id} rows [{unit.row_start}, {unit.row_end}) failed {attempt} "
                f"times, last on actor {a}: {why}. The store is resumable: fix the cause and "
                f"re-run the same config{fix}") from None
        self.counts.retries += 1
        self.emit({"event": "unit_retry", "unit": unit.unit_id, "actor": a, "attempt": attempt,
                   "error": why})
        self.units.ready.appendleft((unit, attempt + 1))

    def _on_results(self, refs: list, bar) -> None:
        """Finished units; one batched get (a get per ref was most of the loop's time)."""
        import ray

        try:
            values = ray.get(refs)
        except Exception:  # noqa: BLE001 -- one of them failed: take them one by one
            values = [None] * len(refs)
        for ref, v in zip(refs, values):
            self._on_result(ref, bar, v)

    def _on_result(self, ref, bar, res: "UnitResult | None" = None) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        sent = self.inflight.pop(ref)
        if sent.replay is not None:
            self._on_replay(ref, sent, res)
            return
        unit, a, attempt = sent.unit, sent.actor, sent.attempt
        self.health.finished_unit(a)
        self.waits.event()
        try:
            if res is None:
                res = ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            died = isinstance(e, RayActorError)
            why = root_cause(e)
            self._requeue(unit, a, attempt, why)
            log.warning("unit %d failed on actor %d (attempt %d, %s): %s; re-queued", unit.unit_id,
                        a, attempt, "actor died" if died else "task error", why)
            if died:
                self.health.probe_once(a)
            return
        f = self.health.figures[a]
        if res.pid not in f.pids:
            f.pids.append(res.pid)
        if sent.pid is not None and res.pid != sent.pid:
            # the actor died with this unit in flight and Ray ran it again in the new process
            # (max_task_retries): a retry and a restart, though no error reached this loop
            self.counts.ray_retries += 1
        self.health.saw_pid(a, res.pid)
        if res.status == "already_committed":
            f.already_committed += 1
            self.counts.found_committed += 1
        if res.status in ("committed", "streamed"):
            self.health.unit_took(res.seconds)
            f.units += 1
            f.tokens += res.tokens
            f.rows_with_activations += res.tokens if res.rows_with_activations is None \
                else res.rows_with_activations
            f.unit_seconds += res.seconds
            f.engine_seconds += res.capture_seconds or res.seconds
            self.counts.units_run += 1
            if res.marker is not None:
                self.index.add(res.marker)
        self.units.committed(unit)
        if self.deal is not None:
            self.deal.delivered(unit.unit_id)
        bar.update(unit.n_rows)
        log.debug("unit %d rows [%d, %d) %s by actor %d pid %d in %.2f s (attempt %d)", unit.unit_id,
                  unit.row_start, unit.row_end, res.status, a, res.pid, res.seconds, attempt)
        self.emit({"event": "unit_done", **res.event(),
                   "in_flight": dict(enumerate(self.inflight.load))})

    def _check_deadlines(self) -> None:
        """Hung actors lose their units to the others and are killed (health.py says why)."""
        import ray

        limit = self.health.unit_deadline()
        for a, refs, stalled in self.health.hung(self.inflight.by_actor()):
            log.warning("actor %d (pid %s) finished no unit in %.0f s (unit deadline %.0f s): "
                        "killing it; its %d units in flight go to other actors", a,
                        self.health.pid.get(a), stalled, limit, len(refs))
            for ref in refs:
                sent = self.inflight.pop(ref)
                try:  # so Ray does not run it again in the restarted process as well
                    ray.cancel(ref)
                except Exception:  # noqa: BLE001
                    pass
                if sent.replay is not None:   # a resumed rank's replay: sent again as one
                    self.deal.requeue_replay(sent.unit, sent.replay, sent.attempt + 1)
                    continue
                self._requeue(sent.unit, a, sent.attempt,
                              f"no result within the unit deadline of {limit:.0f} s",
                              " (ray.unit_timeout_s sets the deadline)")
            self.health.kill_hung(a, stalled)
        self.health.check_probes()

    def placed_all(self) -> "int | None":
        """Units of the run once every one is placed and planned (the frontier is done), else
        None."""
        if not self.frontier.done or self.plan.unplanned:
            return None
        return len(self.plan.units)

    # ---- the loop ----------------------------------------------------------------------------
    def finished(self) -> bool:
        return self.frontier.done and not self.plan.unplanned and not self.units.ready \
            and not self.units.waiting and not self.inflight \
            and not (self.deal is not None and self.deal.replays_pending())

    def step(self, bar, extra: Sequence = (), timeout: float = 5.0) -> list:
        """One round: start tokenising, dispatch, wait for something. Returns the `extra` refs
        that became ready (the caller's own, e.g. actors starting)."""
        import ray

        u = self.units
        self.pool.fill(u.held_tokens, u.window)
        self.flush_plan()
        if self.health.actors:
            self._check_deadlines()
            self._dispatch()
            if self.health.gone() and (u.ready or self.inflight):
                raise HarvestError(
                    f"every actor is gone ({self.health.deaths} deaths) with {len(u.ready)} units "
                    "left: the store is resumable; check the actor logs and re-run the same config")
        gens = self.pool.waitables(u.held_tokens, u.window)
        waits = list(self.inflight) + list(self.health.probing) + gens + list(extra)
        if not waits:
            return []
        if self.health.actors:
            timeout = min(timeout, max(0.5, self.health.unit_deadline() / 4))
        ready, rest = ray.wait(waits, num_returns=1, timeout=timeout)
        if not ready and self.health.actors:
            self._wait_line()
        elif ready:
            self.waits.event()
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        got = []
        done = [r for r in ready if r in self.inflight]
        if done:
            self._on_results(done, bar)
        for r in ready:
            if r in done:
                continue
            if r in self.health.probing:
                self.health.on_probe(r)
                self.waits.event()
            elif any(r is g for g in gens):
                job = self.pool.job_of(r)
                item = self.pool.take(job) if job is not None else None
                if item is not None:
                    self.on_chunk(*item)
            else:
                got.append(r)
        return got

    def _wait_line(self) -> None:
        """No silent waits: say what the loop waits for while nothing finishes."""
        silent = self.waits.silent_for()
        if silent is None:
            return
        per = {a: n for a, n in enumerate(self.inflight.load) if n}
        log.info("nothing finished for %.0f s: %d units in flight %s, %d ready, %d waiting for "
                 "tokens, %d actors restarting; unit deadline %.0f s", silent,
                 len(self.inflight), per or "", len(self.units.ready), len(self.units.waiting),
                 self.health.restarting(), self.health.unit_deadline())

    def collect_figures(self) -> None:
        self.health.collect_figures()

    def close(self) -> None:
        if self.index is not None:
            try:
                self.index.flush(force=True)
            except Exception as e:  # noqa: BLE001 -- the index is a cache
                log.warning("could not write the commit index: %s", e)
