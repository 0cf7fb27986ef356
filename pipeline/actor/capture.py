"""The Ray actor: one engine fed by one long-lived capture stream, and its units' writers.

Activations never travel through Ray's object store (hundreds of KB per token would make it the
bottleneck): the actor fetches its unit's token ids (the tokenising workers' chunks, by
reference), writes the unit's row metadata and activations itself and returns the small commit
marker. A unit is done only when its region is committed, so a retry after a crash (Ray's
`max_task_retries`) rewrites the same shards and the create-once marker makes the second commit
harmless: at-least-once execution, exactly-once result.

One engine stream across units: `run_unit` (on Ray's method threads, `max_concurrency` of them)
prepares a unit and queues it; the engine thread feeds the contexts of every queued unit into one
`capture()` call, so the engine's steps stay full across unit boundaries (a capture call per unit
drained the engine at the end of each unit, and a unit of one context filled one step in eight).
The stream ends when the queue runs dry and starts again with the next unit; the driver keeps
enough units queued per actor to fill the engine. Commits (last uploads + marker) run on the
unit's method thread, so the engine never waits for them.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .engine import check_engine, close_engine, gpu_ids, load_engine
from .outbox import Outbox, StreamClosed, UnitParts, rss_bytes
from ..logs import mark_phase, redirect_actor
from ...store import THROTTLE, torch_dtype, torch_view
from ..messages import (ActorFigures, ActorInfo, ActorSpec, StreamFigures, StreamRows, UnitResult,
                                       UnitStatus, UnitTask)

log = logging.getLogger("harvest.actor")

ENGINE_LOST_EXIT = 75  # EX_TEMPFAIL: the actor exits because its engine died; a restart fixes it
ENGINE_LOST_GRACE_S = 1.0
CLOSE_TIMEOUT_S = 30.0  # an engine's close (TP: the ranks' shutdown) waited for at most this

STREAM_START_WAIT = 0.05  # seconds a new stream waits for units to fill its first engine step
STREAM_GAP_WAIT = 0.01    # seconds a running stream waits for the next unit before draining


class _Job:
    """A unit queued for the engine stream."""

    __slots__ = ("unit_id", "row_start", "contexts", "writer", "received", "error", "done", "meta",
                 "parts")

    def __init__(self, unit_id: int, row_start: int, contexts: np.ndarray, writer, meta=None,
                 parts=None):
        self.unit_id, self.row_start, self.contexts, self.writer = unit_id, row_start, contexts, writer
        self.meta = meta  # generation: (doc_id, position, role) per context, per slot
        self.parts = parts  # a streamed run: the unit's rows per trainer rank (outbox.UnitParts)
        self.received = 0
        self.error: BaseException | None = None
        self.done = threading.Event()

    def fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        self.done.set()


class HarvestActor:
    """Hosts one engine. Created by the driver with `ray.remote(HarvestActor).options(...)`."""

    def __init__(self, spec: ActorSpec):
        self.spec = spec
        self.index = spec.index
        for k, v in spec.env.items():
            os.environ[k] = v
        redirect_actor(self.index)  # quiet runs: vLLM's and torch's output to actor-<i>.log
        mark_phase("engine")
        # Every engine call runs on this one thread. Ray runs a threaded actor's methods on pool
        # threads, and vLLM CPU's attention checks that the OpenMP thread count of the thread that
        # built its metadata is the one that runs it ("thread_num == thread_num (2 vs. 1)").
        # Named at the OS level before the engine loads, so its OpenMP team (spawned from this
        # thread) carries the name too: per-thread CPU in /proc then splits engine from writer.
        from ...store import name_native_thread

        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="harvest-engine",
                                                 initializer=name_native_thread)
        t0 = time.perf_counter()
        self.engine, self.profile = self._engine_thread.submit(load_engine, spec).result()
        self.load_seconds = time.perf_counter() - t0
        self.check = None
        if spec.check_model:
            mark_phase("model check")
            t1 = time.perf_counter()
            self.check = self._engine_thread.submit(check_engine, self.engine).result()
            self.check["seconds"] = round(time.perf_counter() - t1, 1)
        from ...engine import Address
        from ...engine.points import LOGIT_POINTS

        # Addresses, parsed once (prepare.resolve_points); a spec built by hand may name them
        self.addresses = tuple(Address.parse(p) for p in spec.points)

        # logprob.0 / entropy.0 (last, prepare.split_scores): the store's row columns
        self.scores = tuple(a for a in self.addresses if a.name in LOGIT_POINTS)
        self.points = [str(a) for a in self.addresses if a.name not in LOGIT_POINTS]   # the store's
        self.context_size = spec.context_size
        self.slots = None
        if spec.generate is not None:
            from .generation import Slots

            self.slots = Slots(spec.generate, spec.context_size)
        self._store = None
        self._store_lock = threading.Lock()
        # a streamed run: each trainer rank's rows wait here until it takes them (outbox.py)
        self.outbox = None if spec.stream is None else Outbox(spec.stream, self.index)
        self._queue: "queue.Queue[_Job | None]" = queue.Queue()
        self._steps0 = self.engine.step_stats()
        self._step_tokens = int(self.engine.max_num_batched_tokens)
        self.units_done = 0
        self.tokens_done = 0
        self.streams = 0
        self.rows_in_place = 0  # rows the engine wrote straight into shard buffers
        self._closed = False
        # a graceful end of this process (Ray's actor exit, SIGTERM at a cluster's shutdown)
        # closes the engine too: its executor's shared-memory queues and our arena and ring are
        # /dev/shm files that outlive a process that never closed them
        atexit.register(self._close_engine, CLOSE_TIMEOUT_S)
        self._engine_thread.submit(self._engine_loop)
        mark_phase("ready")

    # -- introspection ----------------------------------------------------------------------
    def info(self) -> ActorInfo:
        e = self.engine
        return ActorInfo(
            index=self.index, pid=os.getpid(), host=socket.gethostname(),
            gpus=gpu_ids(), n_layers=int(e.n_layers), width=int(e.width),
            max_model_len=int(e.max_model_len), dtype=str(e.dtype).replace("torch.", ""),
            describe=e.describe(), load_seconds=round(self.load_seconds, 3),
            threads=self.spec.threads, platform=self.profile,
            check=self.check,
            # rows the driver keeps queued here so the engine never runs dry between units
            queue_tokens=4 * self._step_tokens,
        )

    def ping(self) -> int:
        return os.getpid()

    def figures(self) -> ActorFigures:
        """Units, tokens and step fill (scheduled tokens / (steps x max_num_batched_tokens))."""
        now, base = self.engine.step_stats(), self._steps0
        steps = now["steps"] - base["steps"]
        sched = now["scheduled_tokens"] - base["scheduled_tokens"]
        return ActorFigures(
            index=self.index, pid=os.getpid(), units=self.units_done, tokens=self.tokens_done,
            streams=self.streams, rows_in_place=self.rows_in_place, steps=steps,
            scheduled_tokens=sched, max_num_batched_tokens=now["max_num_batched_tokens"],
            step_fill=round(sched / (steps * now["max_num_batched_tokens"]), 4) if steps else None,
            # tensor parallel: rows the rank wrote into the shared arena
            rows_placed=(now["rows_placed"] - base.get("rows_placed", 0)
                         if "rows_placed" in now else None),
            **THROTTLE.figures())

    # -- work -------------------------------------------------------------------------------
    def _open_store(self):
        with self._store_lock:
            if self._store is None:
                from ...store import open_store

                self._store = open_store(self.spec.store_url,
                                         storage_options=self.spec.storage_options)
                self._store.location.lower_io_priority()
            return self._store

    def open_store(self) -> int:
        """Open the store and its arrays before the first unit, so unit timings are steady state."""
        store = self._open_store()
        for p in store.points:
            store.array(p)
        return os.getpid()

    def run_unit(self, unit: UnitTask, attempt: int = 1) -> UnitResult:
        from ..data.unit_rows import unit_rows

        uid, rs, re_ = unit.unit_id, unit.row_start, unit.row_end

        def result(status: UnitStatus, tokens: int = 0, seconds: float = 0.0, **kw) -> UnitResult:
            return UnitResult(unit_id=uid, row_start=rs, row_end=re_, actor=self.index,
                              pid=os.getpid(), attempt=attempt, status=status, tokens=tokens,
                              seconds=seconds, **kw)

        if unit.deal is not None and (self.spec.store_url is None or unit.deal.replay):
            return self._stream_unit(unit, result)
        store = self._open_store()
        t0 = time.perf_counter()
        writer = store.region_writer(uid, rs, re_)
        if writer.already_committed:
            writer.abort()
            return result("already_committed")
        try:
            tok, doc, pos, role = unit_rows(unit, self.context_size)
            C, meta = self.context_size, None
            if self.slots is None:
                writer.write_meta(rs, tok, doc, pos, role)
            else:  # a slot's metadata is known once it is generated: written on delivery
                meta = (doc.reshape(-1, C), pos.reshape(-1, C),
                        None if role is None else role.reshape(-1, C))
            parts = self._deal(unit, tok, doc, pos, role)
            job = _Job(uid, rs, tok.reshape(-1, C), writer, meta, parts)
            self._queue.put(job)
            job.done.wait()
            if job.error is not None:
                raise job.error
            t_cap = time.perf_counter() - t0
            if parts is not None:   # a tee: the trainers took every row before the commit, so
                self._wait_taken(parts)   # a committed unit is one the stream delivered too
            held = writer.rows_with_activations()
            # the commit runs here, while the engine thread goes on with the next units
            marker = writer.commit(extra={"actor": self.index, "pid": os.getpid(),
                                          "attempt": attempt, "host": socket.gethostname()})
        except BaseException as e:
            try:
                writer.abort()
            except Exception:
                pass
            if _is_conflict(e) and store.ledger.is_committed(uid, rs, re_):
                # another attempt of this unit committed first: its rows are the same rows
                return result("already_committed")
            raise
        n = re_ - rs
        self.units_done += 1
        self.tokens_done += n
        return result("committed", n, round(time.perf_counter() - t0, 4),
                      capture_seconds=round(t_cap, 4), marker=marker.to_json(),
                      rows_with_activations=held)

    # -- a streamed run ----------------------------------------------------------------------
    def _deal(self, unit: UnitTask, tok, doc, pos, role) -> "UnitParts | None":
        """The unit's rows per trainer rank (outbox.py), None when the run streams nothing."""
        if unit.deal is None or self.outbox is None:
            return None
        return UnitParts(unit.unit_id, unit.row_start, unit.n_rows, self.context_size, unit.deal,
                         self.outbox.spec, tok, doc, pos, role)

    def _stream_unit(self, unit: UnitTask, result) -> UnitResult:
        """A unit whose rows go to the trainers only (no store, or a rank's replay): captured,
        dealt to the ranks' queues, done once every rank took its rows."""
        from ..data.unit_rows import unit_rows

        if self.outbox is None:
            raise RuntimeError(f"unit {unit.unit_id} carries a deal, but actor {self.index} was "
                               "started without a stream section")
        t0 = time.perf_counter()
        tok, doc, pos, role = unit_rows(unit, self.context_size)
        parts = self._deal(unit, tok, doc, pos, role)
        job = _Job(unit.unit_id, unit.row_start, tok.reshape(-1, self.context_size), None, None,
                   parts)
        self._queue.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        t_cap = time.perf_counter() - t0
        self._wait_taken(parts)
        self.units_done += 1
        self.tokens_done += unit.n_rows
        return result("streamed", unit.n_rows, round(time.perf_counter() - t0, 4),
                      capture_seconds=round(t_cap, 4), rows_with_activations=parts.rows)

    def _wait_taken(self, parts: UnitParts) -> None:
        while not parts.done.wait(1.0):
            if self.outbox is None or self.outbox.closed:
                raise StreamClosed(f"actor {self.index} closed before the trainers took unit "
                                   f"{parts.unit_id}'s rows")

    def take(self, rank: int, max_rows: int, wait_s: float = 0.5, ack=()) -> StreamRows:
        """Trainer rank `rank`'s rows queued here, up to `max_rows`; `ack`: the tokens of the
        takes it received since (outbox.Outbox.take)."""
        if self.outbox is None:
            raise RuntimeError(f"actor {self.index} streams nothing (no stream section)")
        return self.outbox.take(rank, max_rows, wait_s, os.getpid(), ack)

    def release_rank(self, rank: int) -> int:
        """A trainer rank restarted from its saved state: what its old process took and never
        acknowledged counts as delivered (outbox.Outbox.release)."""
        return 0 if self.outbox is None else self.outbox.release(rank)

    def stream_figures(self) -> StreamFigures | None:
        """The stream's memory and flow here (None: this run does not stream)."""
        if self.outbox is None:
            return None
        held, held_bytes = self.outbox.held()
        return StreamFigures(actor=self.index, pid=os.getpid(), held_rows=tuple(held),
                             held_bytes=held_bytes, peak_held_bytes=self.outbox.peak_held_bytes,
                             rows_sent=self.outbox.rows_sent, bytes_sent=self.outbox.bytes_sent,
                             put_wait_s=round(self.outbox.put_wait_s, 3), rss_bytes=rss_bytes())

    # -- the engine stream ------------------------------------------------------------------
    def _engine_loop(self) -> None:
        while self._stream():
            pass

    def _stream(self) -> bool:
        """One capture() over the contexts of every unit queued while it runs; False once
        close() asked the loop to stop.

        A stream may last the actor's whole life and a job holds its writer (shard buffers,
        statistics, token ids), so nothing here keeps a unit past its last delivered context:
        `routes` (request index -> (job, context index)) loses each entry on delivery, and
        `live` holds the units taken into the stream only until they are done or failed."""
        first = self._queue.get()
        if first is None:
            return False
        routes: dict[int, tuple[_Job, int]] = {}
        live: set[_Job] = {first}
        feed = self._feed(first, routes, live)
        del first  # the feed and `live` hold it now, and only while it is in flight
        self.streams += 1
        reserved: dict = {}  # request index -> its rows in the shard buffer (written in place)
        kw = {}
        if self._in_place():
            def destination(index: int, n: int):
                job, i = routes[index]
                if job.error is not None or job.writer is None:
                    return None
                view = job.writer.reserve(job.row_start + i * self.context_size, n)
                if view is None:
                    return None
                reserved[index] = view
                return self._as_tensor(view)
            kw["destinations"] = destination
            if self._open_store().quantized:   # fp8 rows leave the engine packed (quantize.py)
                kw["quantize"] = self._open_store().dtype
        stream = self.engine.capture(feed, self.addresses, **kw) if self.slots is None else \
            self.slots.stream(self.engine, feed, self.addresses, routes, **kw)
        try:
            for req in stream:
                job, i = routes.pop(req.index)
                if job.error is None:
                    try:
                        self._deliver(job, i, req, reserved.get(req.index))
                    except BaseException as e:  # noqa: BLE001 -- the unit fails, the stream goes on
                        job.fail(e)
                if job.done.is_set():
                    live.discard(job)
                reserved.pop(req.index, None)
                del job  # the unit commits on its own thread now: hold it no longer
        except BaseException as e:  # noqa: BLE001 -- the engine failed: every unit in it fails
            for job in list(live):
                job.fail(e)
            if self.engine.lost:
                self._exit_engine_lost(e)
            return True
        finally:
            routes.clear()
        for job in list(live):
            if not job.done.is_set():
                job.fail(RuntimeError(f"unit {job.unit_id}: the engine returned {job.received} of "
                                      f"{len(job.contexts)} contexts"))
        return True

    def _exit_engine_lost(self, e: BaseException) -> None:
        """The engine is gone for good (a tensor-parallel worker process died: vLLM shut its
        executor down). Every later unit here would fail the same way until its attempts ran
        out, so the actor process exits instead: Ray restarts it with a fresh engine
        (ray.max_restarts) or the driver declares it lost, and the units of the failed stream,
        which failed just above, are retried on any actor. The pause lets their failures reach
        the driver as task errors (naming the cause) rather than as the actor's death; either
        way they are retried."""
        log.error("actor %d: engine lost (%s); exiting so Ray restarts this actor", self.index, e)
        time.sleep(ENGINE_LOST_GRACE_S)
        self._close_engine(CLOSE_TIMEOUT_S, here=True)  # os._exit runs no atexit handler
        logging.shutdown()
        os._exit(ENGINE_LOST_EXIT)

    def _feed(self, job: _Job, routes: dict, live: set):
        """The stream's requests: the contexts of `job`, then of every unit queued meanwhile."""
        fed = 0
        while True:
            for i in range(len(job.contexts)):
                if job.error is not None:
                    break
                routes[fed] = (job, i)  # the engine numbers requests in submission order
                fed += 1
                yield [job.contexts[i].tolist()]
            job = None  # all fed: `routes` and `live` hold it while it is in flight
            # The next unit is usually queued already; if not, it is on its way from the
            # driver: waiting a moment (longer while the stream has not filled one engine
            # step yet) costs less than a drained engine and a partly empty step.
            filling = fed * self.context_size < self._step_tokens
            wait = STREAM_START_WAIT if filling else STREAM_GAP_WAIT
            try:
                job = self._queue.get(timeout=wait)
            except queue.Empty:
                return
            if job is None:  # close(): let the current stream finish, then stop the loop
                self._queue.put(None)
                return
            live.add(job)

    def _deliver(self, job: _Job, i: int, req, view) -> None:
        """The capture -> writer hand-off, and the only place it happens. In place (`view`, the
        rows in the shard buffer): the engine already wrote the rows into the writer's shard
        buffer (one host copy), this marks them final; otherwise they are copied from the
        request's own tensor. A generation slot's metadata and rows come from the one request
        delivered here: what a unit commits is one attempt's samples, never a mix."""
        in_place = view is not None
        if self.slots is not None:
            self.rows_in_place += self.slots.deliver(job, i, req, view)
        elif not np.array_equal(np.asarray(req.token_ids), job.contexts[i]):
            raise RuntimeError(
                f"unit {job.unit_id}: engine returned context {i} with other tokens than "
                "submitted; refusing to write rows that do not match their metadata")
        else:
            row = job.row_start + i * self.context_size
            acts = req.acts[:len(self.points)] if self.scores else req.acts
            if job.writer is None:
                pass   # a streamed run without a store: the rows go to the trainers only
            elif in_place:
                job.writer.fill_reserved(row, len(req))
                self.rows_in_place += len(req)
            else:
                if self.scores:   # before the rows: a shard's metadata may go up with it
                    job.writer.write_scores(row, **{a.name: req.point(a).numpy()
                                                    for a in self.scores})
                job.writer.write(row, acts)
            if job.parts is not None and self.outbox is not None:
                # waits while a trainer rank's queue is full: the capture pauses here
                self.outbox.deliver(job.parts, i, self.outbox.context_rows(acts, view))
        job.received += 1
        if job.received == len(job.contexts):
            job.done.set()

    # -- one host copy ----------------------------------------------------------------------
    def _in_place(self) -> bool:
        """Whether the engine can write rows straight into the writers' shard buffers: it takes
        a destination provider (`accepts_destinations`: vLLM; the eager reference does not),
        captures exactly the store's points in the store's order and dtype, and, on CUDA, the
        buffers are page-locked (tensor parallel: in the engine's shared arena instead). An fp8
        store's rows are quantised by the engine (before its device-to-host copy) where it can
        (`quantizes`: not tensor parallel) for prompt captures; otherwise the writer quantises
        the engine's rows on the host, bit for bit the same."""
        ok = getattr(self, "_in_place_ok", None)
        if ok is None and self.spec.store_url is None:
            ok = self._in_place_ok = False   # no store: no shard buffers to write into
        if ok is None:
            import torch

            store = self._open_store()
            e = self.engine
            if store.quantized:
                # the engine quantises a whole buffer row; points of several widths need each
                # point's scale over its own columns, which the writer computes (writer.py)
                same = e.quantizes and self.slots is None and not store.mixed_widths
            else:
                same = e.dtype == torch_dtype(store.np_dtype)
            # scores (self.scores) go to row columns from the request's own tensor: not in place
            ok = (bool(e.accepts_destinations) and list(store.points) == list(self.points)
                  and same and not self.scores)
            shared = e.shared_allocator() if ok else None
            if shared is not None:
                # tensor parallel: block buffers in the engine's shared arena, so the rank
                # that computes the rows writes them in place (engine/capture/shmdest.py)
                from ...store import use_allocator

                use_allocator(store, shared)
            elif ok and torch.cuda.is_available():
                from ...store import use_allocator

                use_allocator(store, _pinned_empty)
            self._in_place_ok = ok
        return ok

    def _as_tensor(self, view: np.ndarray):
        """A writer view (raw integer bits of the store dtype) as an engine-dtype tensor over the
        same memory: the engine's copies land in the shard buffer itself (an fp8 store's packed
        uint8 rows as uint8: the engine quantises into them)."""
        return torch_view(view, self._open_store().np_dtype)

    def close(self) -> None:
        """Stop the stream and close the engine (vLLM's executor and ranks, the shared arena and
        step ring in /dev/shm). The driver calls it before killing the actor (cluster.kill_all):
        a killed process closes nothing."""
        self._queue.put(None)
        if self.outbox is not None:
            self.outbox.close()
        self._close_engine(CLOSE_TIMEOUT_S)

    def _close_engine(self, timeout: float, here: bool = False) -> None:
        if not self._closed:
            self._closed = True
            close_engine(self.engine, None if here else self._engine_thread, timeout, self.index)



def _pinned_empty(shape, dtype) -> np.ndarray:
    """Page-locked host memory as a numpy array: CUDA copies into it run asynchronously (into
    pageable memory torch stages through a bounce buffer and synchronises)."""
    import torch

    t = torch.empty(int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=torch.uint8, pin_memory=True)
    return t.numpy().view(dtype).reshape(shape)


def _is_conflict(e: BaseException) -> bool:
    try:
        from ...store import RegionConflict

        return isinstance(e, RegionConflict)
    except Exception:
        return False
