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
import time
from collections import deque
from dataclasses import dataclass

from .errors import HarvestError, ResumeMismatch
from .health import ActorFigures, ActorHealth
from .messages import UnitResult, UnitTask
from .context_rows import Emitted, chunk_key, sum_stats
from .store.commits import IndexBuilder, index_batch

log = logging.getLogger("harvest.pipeline")

PLAN_FLUSH_SECONDS = 10.0  # at most this long between plan segments while units are waiting


@dataclass
class _Held:
    ref: object
    desc: dict
    tokens: int
    users: int = 0


class Scheduler(ActorHealth):
    """One run's loop; `driver.run` builds it, `run()` returns when every unit is committed."""

    def __init__(self, cfg, prep, state, pool, emit, lease=None):
        self.cfg, self.prep, self.state, self.pool, self.emit = cfg, prep, state, pool, emit
        self.lease = lease
        self.C = cfg.packing.context_size
        self.frontier = state.frontier
        self.held: dict[str, _Held] = {}
        self.held_tokens = 0
        self.users: dict[str, int] = {}           # chunk -> units not yet committed that use it
        self.waiting: dict[int, object] = {}      # planned units whose chunks are not all here
        self.missing: dict[int, set] = {}         # their missing chunks
        self.by_chunk: dict[str, list] = {}       # chunk -> waiting units that need it
        self.ready: deque = deque()               # (unit, attempt), planned, chunks held
        self.unplanned: list[Emitted] = []
        self.plan_chunks: dict = dict(state.chunks)
        self.plan_units: list = list(state.units)
        self.plan_state = None
        self.seq, self.compacted_upto, self.last_flush = state.next_seq, state.next_seq - 1, 0.0
        self.store = None
        self.actors: list = []
        self.figures: dict[int, ActorFigures] = {}
        self.inflight: dict = {}
        self.load: list[int] = []
        self.alive: set = set()
        self.probing: dict = {}
        self.slots = cfg.ray.max_in_flight
        self.retries = self.deaths = 0
        self.ray_retries = 0        # units Ray re-ran itself on a restarted actor (pid changed)
        self.deadline_kills = 0     # actors killed for missing the unit deadline
        self.killed_unseen: set = set()  # of those, actors neither back (new pid) nor lost yet
        self.found_committed = 0    # units whose run found them committed already
        self.units_run = 0
        self.pid: dict[int, int] = {}           # actor -> its current process id
        self.seen_pids: dict[int, set] = {}     # actor -> every process id it ran in
        self.progress: dict[int, float] = {}    # actor -> when it last finished something
        self.unit_seconds: deque = deque(maxlen=256)
        self.probe_sent: dict = {}
        self.load_seconds = 0.0
        self.last_event = self.last_line = time.monotonic()
        self.index = None
        self.indexed = 0
        self.window = 0
        for u in state.todo:
            self._track(u, +1)
            self.waiting[u.unit_id] = u
            keys = {chunk_key(b, j) for b, j, *_ in u.pieces}
            self.missing[u.unit_id] = keys
            for k in keys:
                self.by_chunk.setdefault(k, []).append(u.unit_id)

    # ---- chunks ----------------------------------------------------------------------------
    def _track(self, unit, d: int) -> None:
        for b, j, *_ in unit.pieces:
            k = chunk_key(b, j)
            self.users[k] = self.users.get(k, 0) + d

    def _pinned(self) -> set:
        return {chunk_key(p[0], p[1]) for p in self.frontier._pieces}

    def _release(self, keys) -> None:
        pinned = self._pinned()
        for k in keys:
            h = self.held.get(k)
            if h is None or self.users.get(k, 0) > 0 or k in pinned:
                continue
            b, j = (int(x) for x in k.split(":"))
            if self.frontier.expects(b, j):
                continue
            del self.held[k]
            self.held_tokens -= h.tokens
            self.users.pop(k, None)

    def on_chunk(self, arrays_ref, desc: dict) -> None:
        b, j = int(desc["block"]), int(desc["chunk"])
        k = chunk_key(b, j)
        planned = self.plan_chunks.get(k)
        if planned is not None and (list(planned["digest"]) != list(desc["digest"])
                                    or planned["n_contexts"] != desc["n_contexts"]):
            raise ResumeMismatch(
                f"block {b} chunk {j} now tokenises to other rows than when the store was planned "
                f"({desc['n_contexts']} contexts, digest {desc['digest']} vs {planned['n_contexts']}, "
                f"{planned['digest']}): the data or tokenizer changed under the same config; use "
                "the original data, or a new store.url")
        wanted = (self.users.get(k, 0) > 0 or self.frontier.expects(b, j)) and k not in self.held
        self.emit({"event": "chunk", "block": b, "chunk": j, "n_contexts": desc["n_contexts"],
                   "kept": wanted, "pid": desc.get("pid")})
        if not wanted:
            return
        self.held[k] = _Held(arrays_ref, desc, desc["n_contexts"] * self.C)
        self.held_tokens += self.held[k].tokens
        for uid in self.by_chunk.pop(k, ()):
            m = self.missing.get(uid)
            if m is not None:
                m.discard(k)
                if not m:
                    del self.missing[uid]
                    self.ready.append((self.waiting.pop(uid), 1))
        for e in self.frontier.add(desc):
            if e.unit.n_rows:
                self._track(e.unit, +1)
            self.unplanned.append(e)
            self._release(list(e.chunks))
        if self.frontier.done:
            self.pool.stop()

    def _unit_message(self, unit) -> UnitTask:
        refs, digests = [], []
        for b, j, *_ in unit.pieces:
            h = self.held[chunk_key(b, j)]
            refs.append(h.ref)
            digests.append(tuple(h.desc["digest"]))
        return UnitTask(unit.unit_id, unit.row_start, unit.row_end,
                        pieces=tuple(tuple(p) for p in unit.pieces), refs=tuple(refs),
                        digests=tuple(digests))

    # ---- the plan ----------------------------------------------------------------------------
    def flush_plan(self, force: bool = False) -> None:
        if not self.unplanned or self.store is None:
            return
        free = sum(max(0, self.slots - self.load[a]) for a in self.alive) if self.actors else 1
        due = (force or len(self.ready) < max(1, free) or len(self.unplanned) >= 256
               or self.frontier.done or time.monotonic() - self.last_flush > PLAN_FLUSH_SECONDS)
        if not due:
            return
        batch, self.unplanned = self.unplanned, []
        units = [e.unit for e in batch if e.unit.n_rows]
        chunks = {}
        for e in batch:
            chunks.update(e.chunks)
        payload = {"chunks": chunks, "state": batch[-1].state}
        final = any(e.final for e in batch)
        if self.lease is not None:
            self.lease.assert_held(f"writing plan segment {self.seq}")
        if not self.store.plans.write_segment(self.seq, units, payload, final=final):
            raise HarvestError(
                f"plan segment {self.seq} of {self.store.url} already exists: another driver is "
                "writing this store; stop one of them (the store stays consistent)")
        self.seq += 1
        self.last_flush = time.monotonic()
        self.plan_units += units
        self.plan_chunks.update(chunks)
        self.plan_state = payload["state"]
        self.ready.extend((u, 1) for u in units)
        if self.seq - 1 - self.compacted_upto >= max(32, len(self.plan_units) // 10) or final:
            self.store.plans.compact(self.plan_units, [{"chunks": self.plan_chunks,
                                                        "state": self.plan_state}],
                                     self.seq - 1, final or self.state.final)
            self.compacted_upto = self.seq - 1

    # ---- actors ------------------------------------------------------------------------------
    def attach(self, store, actors: list, infos: list[dict]) -> None:
        """Actors are ready and the store exists: start dispatching."""
        self.store, self.actors = store, actors
        self.figures = {i: ActorFigures(i) for i in range(len(actors))}
        self.load = [0] * len(actors)
        self.alive = set(range(len(actors)))
        now = time.monotonic()
        for i, inf in enumerate(infos):
            self.pid[i] = inf["pid"]
            self.seen_pids[i] = {inf["pid"]}
            self.progress[i] = now
        self.load_seconds = max(float(i.get("load_seconds") or 0.0) for i in infos)
        unit_rows = self.prep.layout.unit_rows
        queue = max(i.get("queue_tokens", 0) for i in infos)
        # enough units in flight per actor that its engine never runs dry between units
        self.slots = max(self.cfg.ray.max_in_flight, math.ceil(queue / unit_rows) + 1)
        self.slots = min(self.slots, 60)
        self.window = max(4 * unit_rows, 2 * len(actors) * self.slots * unit_rows)
        self.index = IndexBuilder()

    def _dispatch(self) -> None:
        """One unit at a time to the least loaded actor: small runs still spread over actors."""
        usable = sorted(self.alive - set(self.probing.values()))
        while self.ready and usable:
            a = min(usable, key=lambda i: self.load[i])
            if self.load[a] >= self.slots:
                return
            unit, attempt = self.ready.popleft()
            ref = self.actors[a].run_unit.remote(self._unit_message(unit), attempt)
            self.inflight[ref] = (unit, a, attempt, time.monotonic(), self.pid.get(a))
            self.load[a] += 1

    def _on_results(self, refs: list, bar) -> None:
        """Finished units; one batched get (a get per ref was most of the loop's time)."""
        import ray

        try:
            values = ray.get(refs)
        except Exception:  # noqa: BLE001 -- one of them failed: take them one by one
            values = [None] * len(refs)
        for ref, v in zip(refs, values):
            self._on_result(ref, bar, v)

    def _on_result(self, ref, bar, res: UnitResult | None = None) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from .cluster import root_cause

        unit, a, attempt, _, pid0 = self.inflight.pop(ref)
        self.load[a] -= 1
        self.progress[a] = self.last_event = time.monotonic()
        try:
            if res is None:
                res = ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            self.figures[a].failures += 1
            died = isinstance(e, RayActorError)
            why = root_cause(e)
            if attempt >= self.cfg.ray.unit_attempts:
                raise HarvestError(
                    f"unit {unit.unit_id} rows [{unit.row_start}, {unit.row_end}) failed {attempt} "
                    f"times, last on actor {a}: {why}. The store is resumable: fix the cause and "
                    "re-run the same config") from None
            self.retries += 1
            log.warning("unit %d failed on actor %d (attempt %d, %s): %s; re-queued", unit.unit_id,
                        a, attempt, "actor died" if died else "task error", why)
            self.emit({"event": "unit_retry", "unit": unit.unit_id, "actor": a, "attempt": attempt,
                       "error": why})
            self.ready.appendleft((unit, attempt + 1))
            if died and a in self.alive and a not in self.probing.values():
                self._probe(a)
            return
        f = self.figures[a]
        if res.pid not in f.pids:
            f.pids.append(res.pid)
        if pid0 is not None and res.pid != pid0:
            # the actor died with this unit in flight and Ray ran it again in the new process
            # (max_task_retries): a retry and a restart, though no error reached this loop
            self.ray_retries += 1
        self._saw_pid(a, res.pid)
        if res.status == "already_committed":
            f.already_committed += 1
            self.found_committed += 1
        if res.status == "committed":
            self.unit_seconds.append(float(res.seconds))
            f.units += 1
            f.tokens += res.tokens
            f.unit_seconds += res.seconds
            f.engine_seconds += res.capture_seconds or res.seconds
            self.units_run += 1
            if res.marker is not None:
                self.index.add(res.marker)
                self._maybe_index()
        self._track(unit, -1)
        self._release([chunk_key(b, j) for b, j, *_ in unit.pieces])
        bar.update(unit.n_rows)
        log.debug("unit %d rows [%d, %d) %s by actor %d pid %d in %.2f s (attempt %d)", unit.unit_id,
                 unit.row_start, unit.row_end, res.status, a, res.pid, res.seconds, attempt)
        self.emit({"event": "unit_done", **res.event(), "in_flight": dict(enumerate(self.load))})

    def _maybe_index(self, force: bool = False) -> None:
        """Copy markers into the commit index in batches (store.commits.index_batch)."""
        if self.index.count and (force or self.index.count >= index_batch(self.indexed)):
            self.store.write_index(self.index)
            self.indexed += self.index.count
            self.index = IndexBuilder()

    # ---- the loop ----------------------------------------------------------------------------
    def finished(self) -> bool:
        return self.frontier.done and not self.unplanned and not self.ready and not self.waiting \
            and not self.inflight

    def step(self, bar, extra: list = (), timeout: float = 5.0) -> list:
        """One round: start tokenising, dispatch, wait for something. Returns the `extra` refs
        that became ready (the caller's own, e.g. actors starting)."""
        import ray

        self.pool.fill(self.held_tokens, self.window or 8 * self.prep.layout.unit_rows)
        self.flush_plan()
        if self.actors:
            self._check_deadlines()
            self._dispatch()
            if not self.alive and not self.probing and (self.ready or self.inflight):
                raise HarvestError(
                    f"every actor is gone ({self.deaths} deaths) with {len(self.ready)} units left: "
                    "the store is resumable; check the actor logs and re-run the same config")
        gens = self.pool.waitables(self.held_tokens, self.window or 8 * self.prep.layout.unit_rows)
        waits = list(self.inflight) + list(self.probing) + gens + list(extra)
        if not waits:
            return []
        if self.actors:
            timeout = min(timeout, max(0.5, self.unit_deadline() / 4))
        ready, rest = ray.wait(waits, num_returns=1, timeout=timeout)
        if not ready and self.actors:
            self._wait_line()
        elif ready:
            self.last_event = time.monotonic()
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
            if r in self.probing:
                self._on_probe(r)
            elif any(r is g for g in gens):
                job = self.pool.job_of(r)
                item = self.pool.take(job) if job is not None else None
                if item is not None:
                    self.on_chunk(*item)
            else:
                got.append(r)
        return got

    def collect_figures(self) -> None:
        import ray

        for a in sorted(self.alive):
            try:
                self.figures[a].step = ray.get(self.actors[a].figures.remote(), timeout=30)
                self._saw_pid(a, int(self.figures[a].step["pid"]))  # a restart seen only now
            except Exception:  # noqa: BLE001 -- figures are a report, never a failure
                pass
        self.sync_restarts()

    def data_stats(self) -> dict:
        """Source rows and packing figures summed over every chunk placed (this run and the
        runs before it: the plan keeps each chunk's figures)."""
        chunks = dict(self.plan_chunks)
        for e in self.unplanned:
            chunks.update(e.chunks)
        return sum_stats(chunks.values())

    def close(self) -> None:
        if self.store is not None and self.index is not None:
            try:
                self._maybe_index(force=True)
            except Exception as e:  # noqa: BLE001 -- the index is a cache
                log.warning("could not write the commit index: %s", e)
