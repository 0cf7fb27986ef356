"""One stream's coordinator: a detached Ray actor that runs the capture and that trainers join.

Every trainer rank calls `harvest.stream(config, ...)`; the first one to arrive creates the
coordinator (a named, detached Ray actor, so it outlives the process that created it: a rank
that dies takes no capture with it), the others find it by name. It runs the driver's run
(`driver.run` with hooks.StreamHooks) on a thread: tokenising workers and capture actors are its
own, and go with it. Trainers ask it four things: to join (the capture actors' handles and the
stream's facts, once the actors exist; a restarted rank with its saved position, which queues
again for it alone the units it had not finished: deal.Deal.replay), where the stream stands,
the normalisation constants (built once from every rank's first window: all ranks normalise
alike), and to leave.

It stops the run when not every rank joined within `stream.join_timeout_s`, and goes away once
every rank that joined has left after the run ended, or `stream.linger_s` after that at the
latest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from ..config.run import HarvestConfig
from ..driver.run import run
from ..errors import HarvestError
from ..messages import StreamInfo, StreamStatus

from .hooks import StreamHooks
from .progress import from_ranges

if TYPE_CHECKING:
    from ...store.read.normalize import NormConstants

log = logging.getLogger("harvest.pipeline")

NAMESPACE = "harvest"   # trainers in other jobs find the coordinator here by its name


def coordinator_name(cfg: HarvestConfig) -> str:
    return f"stream:{cfg.stream.name or cfg.name}"


class StreamCoordinator:
    """The Ray actor behind one stream (module doc). `key` identifies what the trainers asked
    for (the config and their reader options, pipeline/stream/api.py): a joiner with another
    key is refused, so two jobs that pick the same stream name never share rows by mistake."""

    def __init__(self, cfg: HarvestConfig, reader, world_size: int, key: str,
                 engine_factory: "str | None" = None):
        self.cfg, self.reader, self.G, self.key = cfg, reader, int(world_size), key
        self.engine_factory = engine_factory   # benchmarks: a stub engine (driver.run's)
        self.t0 = time.monotonic()
        self.joined: dict[int, int] = {}    # rank -> its process id
        self.left: set[int] = set()
        self.heard: dict[int, float] = {}   # rank -> when it last reported (heartbeat)
        self.resumed: dict[int, int] = {}   # rank -> the process whose resume was replayed
        self.moments: dict[int, list] = {}  # rank -> its first window's Moments per point
        self.constants: "NormConstants | None" = None
        self.error: str | None = None
        self.summary: dict | None = None
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self.hooks = StreamHooks(cfg, reader, self.G, guard=self._guard)
        threading.Thread(target=self._run, name="harvest-stream-run", daemon=True).start()

    # ---- the run -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.summary = dict(run(self.cfg, engine_factory=self.engine_factory,
                                    stream=self.hooks))
        except BaseException as e:  # noqa: BLE001 -- reported to every trainer (status)
            self.error = f"{type(e).__name__}: {e}"
            log.error("stream %s: the capture stopped: %s", self.cfg.stream.name or self.cfg.name,
                      self.error)
        finally:
            self.finished.set()
            self.hooks.ready.set()   # a joiner waiting for the actors learns the run ended
            threading.Thread(target=self._linger, name="harvest-stream-linger",
                             daemon=True).start()

    def _guard(self) -> None:
        """Stops the run (raised in the driver's loop) when it cannot go on."""
        now = time.monotonic()
        limit = self.cfg.stream.rank_timeout_s
        with self._lock:
            joined = len(self.joined)
            silent = {r: now - t for r, t in self.heard.items()
                      if r not in self.left and now - t > limit}
        if silent:
            r, s = min(silent.items())
            raise HarvestError(
                f"trainer rank {r} has not been heard from for {s:.0f} s (stream.rank_timeout_s="
                f"{limit:g}): its process died or hangs. The stream stops: the rows it took and "
                "had not trained on exist nowhere else (no store: write one with stream.tee to "
                "resume from it), and the other ranks cannot go on without it")
        if joined < self.G and time.monotonic() - self.t0 > self.cfg.stream.join_timeout_s:
            raise HarvestError(
                f"only {joined} of {self.G} trainer ranks joined the stream within "
                f"stream.join_timeout_s={self.cfg.stream.join_timeout_s:g} s: the capture "
                "pauses for the missing ranks' rows, so it stops; start every rank, or raise "
                "stream.join_timeout_s")

    def _linger(self) -> None:
        """After the run: wait for the ranks that joined to leave (or linger_s), then go."""
        deadline = time.monotonic() + self.cfg.stream.linger_s
        while time.monotonic() < deadline:
            with self._lock:
                if set(self.joined) <= self.left:
                    break
            time.sleep(0.2)
        time.sleep(0.5)   # the last leave's reply
        import ray

        # detached: nothing else ends it (the run's actors went with the run)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ---- what the trainers call ------------------------------------------------------------
    def join(self, rank: int, world_size: int, key: str, pid: int, wait_s: float = 5.0,
             resume: "list | None" = None) -> "StreamInfo | str | None":
        """The stream's facts for rank `rank` once its actors exist (None: not yet, ask again),
        or why it may not join (a str). `resume` (a restarted rank's saved position: the
        contexts it had yielded whole, as ranges) queues again, for it alone, every unit it had
        not finished (deal.Deal.replay)."""
        if key != self.key:
            return (f"a stream named {self.cfg.stream.name or self.cfg.name!r} is running with "
                    "another config or other reader options; give this one its own "
                    "stream.name, or the same options")
        if world_size != self.G or not 0 <= rank < self.G:
            return (f"this stream has {self.G} ranks (0..{self.G - 1}); rank {rank} of "
                    f"{world_size} cannot join it")
        with self._lock:
            if rank in self.joined and rank not in self.left and self.joined[rank] != pid \
                    and resume is None:
                return (f"rank {rank} is already in this stream (process {self.joined[rank]}); "
                        "a rank that restarts must come back with its saved state "
                        "(StreamDataset.load_state_dict)")
            if self.finished.is_set() and (rank not in self.joined or resume is not None):
                return (f"the stream ended ({self.error or 'every row was delivered'}) before "
                        f"rank {rank} joined; the rows after a saved position exist nowhere else "
                        "(write a tee to read them back from its store)")
            self.joined[rank] = pid
            self.heard[rank] = time.monotonic()
            self.left.discard(rank)
            replay = resume is not None and self.resumed.get(rank) != pid
        self.hooks.ready.wait(wait_s)
        if self.error is not None:
            return f"the capture stopped: {self.error}"
        if replay:
            if self.hooks.deal is None:
                return None   # the run is still preparing: ask again
            why = self.hooks.deal.replay(rank, from_ranges(resume))
            if why is not None:
                return why
            self._release(rank)
            with self._lock:
                self.resumed[rank] = pid
            log.info("stream %s: rank %d resumed (process %d); %d units captured again for it",
                     self.cfg.stream.name or self.cfg.name, rank, pid,
                     len(self.hooks.deal.replays))
        return self.hooks.info

    def heartbeat(self, rank: int) -> None:
        with self._lock:
            if rank in self.joined:
                self.heard[int(rank)] = time.monotonic()

    def _release(self, rank: int) -> None:
        """The dead process's unacknowledged takes count as delivered at every actor: the
        units waiting on them finish (their rows for this rank come again by the replay)."""
        import ray

        refs = [a.release_rank.options(max_task_retries=-1).remote(rank)
                for a in self.hooks.info.actors]
        try:
            ray.get(refs, timeout=60)
        except Exception as e:  # noqa: BLE001 -- an actor restarting has nothing unacknowledged
            log.warning("stream: releasing rank %d's takes: %s", rank, e)

    def status(self) -> StreamStatus:
        d = self.hooks.deal.figures() if self.hooks.deal is not None else {}
        done = self.finished.is_set() and self.error is None
        return StreamStatus(units_planned=int(d.get("units") or d.get("counted") or 0),
                            units_done=int(d.get("units_done") or 0), done=done,
                            kept_rows=d.get("kept_rows"), error=self.error, summary=self.summary)

    def share_moments(self, rank: int, moments: list) -> None:
        """Rank `rank`'s first-window statistics, per point (store/stats/moments.Moments)."""
        with self._lock:
            self.moments[int(rank)] = list(moments)

    def norm(self, mode: str, points: list, eps: float) -> "NormConstants | None":
        """The normalisation constants of every rank's first window merged (None until each
        rank shared its own): one set for all ranks, recorded here and in each rank's state."""
        from ...store.read.normalize import constants

        with self._lock:
            if self.constants is None and len(self.moments) == self.G:
                merged = None
                for r in sorted(self.moments):
                    m = self.moments[r]
                    merged = m if merged is None else [a.merge(b) for a, b in zip(merged, m)]
                self.constants = constants(mode, points, merged, 0, "stream:first-window", eps)
            return self.constants

    def leave(self, rank: int) -> None:
        with self._lock:
            self.left.add(int(rank))

    def ping(self) -> int:
        return os.getpid()


__all__ = ["NAMESPACE", "StreamCoordinator", "coordinator_name"]
