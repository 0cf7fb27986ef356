"""A trainer rank's side of the stream: a thread that takes the rank's rows from every capture
actor and puts them into its shuffle windows (windows.py).

One take is outstanding per actor at a time (`HarvestActor.take`: up to `take_rows` rows, or
whatever is queued within half a second); the rows come back through Ray's object store, and
are copied once into the current window. Each take acknowledges the one before it from the same
actor (its token): only then are those rows delivered in the actor's eyes, so rows lost on the
way (the actor died while replying) are captured again, not dropped. Parts already received are dropped: a unit re-captured
after its actor died sends its parts again (outbox.py), and the first copy of each (unit,
context) is the one kept, so every row reaches the trainer exactly once. An actor that fails a
take (killed, restarting) is asked again after a pause; Ray brings it back or the run moves its
units elsewhere.

The end: the coordinator says the run is done once every unit's rows were taken by every rank,
so when it says so, every row is in a take this thread issued; those are collected, the last
partial window goes out, and the receiver ends.
"""

from __future__ import annotations

import logging
import threading
import time

from ..errors import HarvestError
from ..messages import StreamInfo, StreamRows

from .progress import Progress
from .windows import Windows

log = logging.getLogger("harvest.pipeline")

TAKE_WAIT_S = 0.5      # an actor answers a take within this when it has nothing for the rank
HEARTBEAT_S = 1.0      # the coordinator hears from this rank at least this often
RETRY_S = 0.5          # a failed take (the actor died or restarts) is asked again after this
STATUS_EVERY_S = 0.5   # the coordinator is asked where the run stands at most this often


class Receiver:
    """Takes rank `rank`'s rows from the capture actors into `windows` on its own thread."""

    def __init__(self, info: StreamInfo, rank: int, windows: Windows, take_rows: int, handle,
                 progress: "Progress | None" = None):
        self.info, self.rank, self.windows, self.take_rows = info, rank, windows, take_rows
        self.handle = handle            # the coordinator's
        self.progress = progress or Progress(info.context_size)
        self.resumed_parts = 0          # parts a resumed rank had yielded before (dropped)
        self.acks: dict[int, list] = {}   # actor -> tokens of takes received, to acknowledge
        self.stopping = threading.Event()
        self.seen: dict[int, set] = {}  # unit -> contexts received, until all are
        self.complete: set[int] = set()
        self.duplicates = 0             # parts dropped: received before (a re-captured unit)
        self.rows = 0
        self.bytes = 0
        self.takes = 0
        self.take_errors = 0
        self.last_status = None
        self.thread = threading.Thread(target=self._guarded, name=f"harvest-stream-rank{rank}",
                                       daemon=True)
        self.beat = threading.Thread(target=self._heartbeat, name=f"harvest-stream-beat{rank}",
                                     daemon=True)

    def start(self) -> "Receiver":
        self.thread.start()
        self.beat.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.windows.stop()

    def status(self):
        import ray

        return ray.get(self.handle.status.remote())

    def _heartbeat(self) -> None:
        """Tells the coordinator this rank lives, paused or not (coordinator.rank_timeout_s),
        until the trainer stops reading."""
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                self.handle.heartbeat.remote(self.rank)
            except Exception:  # noqa: BLE001 -- the coordinator went with the stream's end
                return

    def _guarded(self) -> None:
        try:
            self._loop()
            self.windows.end()
        except BaseException as e:  # noqa: BLE001 -- raised in the trainer's iteration
            self.windows.fail(e)

    def _loop(self) -> None:
        import ray

        actors = self.info.actors
        out: dict = {}                    # take ref -> actor index
        retry: dict[int, float] = {}      # actor -> when to ask again after a failure
        t_status = 0.0
        while not self.windows.stopped.is_set():
            now = time.monotonic()
            busy = set(out.values())
            for a, h in enumerate(actors):
                if a not in busy and retry.get(a, 0.0) <= now:
                    # no retry by Ray: a failed take is asked again here, of the restarted actor
                    out[h.take.options(max_task_retries=0).remote(
                        self.rank, self.take_rows, TAKE_WAIT_S, self.acks.pop(a, []))] = a
            ready, _ = ray.wait(list(out), num_returns=1, timeout=1.0)
            got_rows = 0
            for ref in ready:
                a = out.pop(ref)
                rows = self._get(ref, a, retry)
                if rows is not None:
                    got_rows += rows.rows.shape[0]
                    self.add(rows)
            if got_rows == 0 and time.monotonic() - t_status >= STATUS_EVERY_S:
                t_status = time.monotonic()
                st = self.last_status = self.status()
                if st.error is not None:
                    raise HarvestError(f"stream {self.info.name}: the capture stopped: {st.error}")
                if st.done:
                    break
        for ref, a in list(out.items()):   # every row is in one of these (module doc)
            rows = self._get(ref, a, retry)
            if rows is not None:
                self.add(rows)

    def _get(self, ref, a: int, retry: dict) -> "StreamRows | None":
        import ray
        from ray.exceptions import RayError

        try:
            got = ray.get(ref)
        except RayError as e:   # the actor died or restarts: its units are captured again
            self.acks.pop(a, None)   # a new process: these tokens mean nothing to it
            self.take_errors += 1
            retry[a] = time.monotonic() + RETRY_S
            log.debug("rank %d: take from actor %d failed (%s); asking again", self.rank, a,
                      type(e).__name__)
            return None
        self.takes += 1
        if got.token:
            self.acks.setdefault(a, []).append(got.token)
        return got

    def add(self, got: StreamRows) -> None:
        """Keep the parts not received before; drop the others (exactly once)."""
        off = 0
        for (unit, ctx, n_ctx, m, g), acts in zip(got.parts.tolist(), got.acts):
            lo, off = off, off + m
            if unit in self.complete or ctx in self.seen.get(unit, ()):
                self.duplicates += 1
                continue
            have = self.seen.setdefault(unit, set())
            have.add(ctx)
            if len(have) == n_ctx:
                self.complete.add(unit)
                del self.seen[unit]
            rows = got.rows[lo:off]
            meta = (got.token_id[lo:off], got.doc_id[lo:off], got.position[lo:off])
            keep = self.progress.keep(g, rows)
            if keep is None:   # yielded whole before this rank resumed
                self.resumed_parts += 1
                continue
            if not keep.all():
                rows, acts, meta = rows[keep], acts[keep], tuple(c[keep] for c in meta)
            self.progress.received(g, rows.shape[0])
            if rows.shape[0]:
                self.windows.add(rows, meta, acts)
                self.rows += rows.shape[0]
                self.bytes += acts.nbytes

    def figures(self) -> dict:
        return {"rows": self.rows, "bytes": self.bytes, "takes": self.takes,
                "take_errors": self.take_errors, "duplicate_parts": self.duplicates,
                "resumed_parts": self.resumed_parts,
                "units_complete": len(self.complete)}


__all__ = ["Receiver"]
