"""Actor health for the dispatch loop: per-actor figures, deadlines, restarts, deaths.

No wait is silent or endless: an actor with units in flight that finishes none within the unit
deadline (a hung engine, a SIGSTOPped process, storage that never answers) loses its units to
the other actors and is killed (Ray restarts it); a restarted actor that does not answer a ping
in time is given up. Retries and deaths are counted from what happened: Ray re-running a unit in
a restarted actor reaches the loop as a success, seen only as a new process id.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ..messages import ActorFigures, ActorInfo

log = logging.getLogger("harvest.pipeline")

WAIT_LINE_SECONDS = 30.0     # a log line at least this often while nothing finishes
DEADLINE_MEDIAN_FACTOR = 10  # the derived unit deadline: this many times the median unit time


@dataclass
class ActorTally:
    """Per-actor figures the driver keeps. Units in flight overlap (one captures while the other commits), so a
    rate over summed unit times would understate the actor: the rate is over capture time."""

    index: int
    pids: list = field(default_factory=list)
    units: int = 0
    tokens: int = 0
    rows_with_activations: int = 0   # of `tokens`, rows holding activations (UnitResult)
    engine_seconds: float = 0.0
    unit_seconds: float = 0.0
    failures: int = 0
    already_committed: int = 0   # units this actor found committed (an earlier attempt's)
    restarts: int = 0            # new processes seen for this actor (Ray restarts, ours)
    step: ActorFigures | None = None
    """The actor's own figures (HarvestActor.figures), collected at the end of the run."""

    def as_dict(self) -> dict:
        s = self.step
        return {
            "index": self.index, "pids": self.pids, "units": self.units, "tokens": self.tokens,
            "rows_with_activations": self.rows_with_activations,
            "engine_seconds": round(self.engine_seconds, 3),
            "unit_seconds": round(self.unit_seconds, 3),
            "tokens_per_second": (round(self.tokens / self.engine_seconds, 1)
                                  if self.engine_seconds else None),
            "failures": self.failures, "already_committed": self.already_committed,
            "restarts": self.restarts, "step_fill": s.step_fill if s else None,
            "steps": s.steps if s else None, "streams": s.streams if s else None,
            "rows_in_place": s.rows_in_place if s else None,
            "rows_placed": s.rows_placed if s else None,
            "throttled_requests": s.throttled_requests if s else None,
            "throttle_wait_s": s.throttle_wait_s if s else None,
        }


class ActorHealth:
    """The capture actors as the dispatch loop sees them: handles, which are alive, their
    process ids, pings to actors coming back, deadlines and deaths. Held by `dispatch.Scheduler`
    (not mixed into it): every field used here is defined here. What happens to the units of a
    hung actor (re-queued, or the run fails) is the scheduler's; `hung` only names the actors."""

    def __init__(self, ray_cfg, emit):
        self.ray_cfg, self.emit = ray_cfg, emit
        self.actors: list = []
        self.alive: set = set()
        self.figures: dict[int, ActorTally] = {}
        self.pid: dict[int, int] = {}           # actor -> its current process id
        self.seen_pids: dict[int, set] = {}     # actor -> every process id it ran in
        self.progress: dict[int, float] = {}    # actor -> when it last finished something
        self.probing: dict = {}                 # ping ref -> actor
        self.probe_sent: dict = {}              # ping ref -> when it was sent
        self.unit_seconds: deque = deque(maxlen=256)
        self.load_seconds = 0.0
        self.deaths = 0
        self.deadline_kills = 0     # actors killed for missing the unit deadline
        self.killed_unseen: set = set()  # of those, actors neither back (new pid) nor lost yet

    def attach(self, actors: list, infos: list[ActorInfo]) -> None:
        self.actors = actors
        self.figures = {i: ActorTally(i) for i in range(len(actors))}
        self.alive = set(range(len(actors)))
        now = time.monotonic()
        for i, inf in enumerate(infos):
            self.pid[i] = inf.pid
            self.seen_pids[i] = {inf.pid}
            self.progress[i] = now
        self.load_seconds = max(float(i.load_seconds or 0.0) for i in infos)

    def usable(self) -> list[int]:
        """Actors that may get units now: alive and not being pinged back."""
        return sorted(self.alive - set(self.probing.values()))

    def gone(self) -> bool:
        """No actor left and none coming back."""
        return not self.alive and not self.probing

    def finished_unit(self, a: int) -> None:
        """Actor `a` returned something (a result or an error): its deadline starts again."""
        self.progress[a] = time.monotonic()

    def unit_took(self, seconds: float) -> None:
        """A committed unit's time: the derived unit deadline is a multiple of their median."""
        self.unit_seconds.append(float(seconds))

    def saw_pid(self, a: int, pid: int) -> None:
        seen = self.seen_pids.setdefault(a, set())
        if pid not in seen:
            self.killed_unseen.discard(a)
            if seen:
                self.figures[a].restarts += 1
                log.info("actor %d runs in a new process (pid %d, was %s)", a, pid, self.pid.get(a))
            seen.add(pid)
        self.pid[a] = pid

    def _ray_actors(self) -> dict:
        """Ray's own view of each actor: {index: (state, num_restarts)}, from the GCS's actor
        table (no dashboard needed). Empty where Ray cannot say: a report, never a failure."""
        from ray._private import state

        out = {}
        for a, handle in enumerate(self.actors or []):
            try:
                info = state.actors(actor_id=handle._actor_id.hex()) or {}
            except Exception:  # noqa: BLE001
                continue
            if info:
                out[a] = (info.get("State"), int(info.get("NumRestarts") or 0))
        return out

    def restarting(self) -> int:
        """Actors coming back now: pinged after a deadline kill, or restarted by Ray on its own
        (a process killed or crashed). Counting only the former once read "0 actors
        restarting" while Ray restarted both actors."""
        back = set(self.probing.values())
        back |= {a for a, (st, _) in self._ray_actors().items() if st == "RESTARTING"}
        return len(back)

    def collect_figures(self) -> None:
        """At the end of the run: each live actor's own figures (step fill), and restarts."""
        import ray

        for a in sorted(self.alive):
            try:
                step = ray.get(self.actors[a].figures.remote(), timeout=30)
                self.figures[a].step = step
                self.saw_pid(a, step.pid)  # a restart seen only now
            except Exception:  # noqa: BLE001 -- figures are a report, never a failure
                pass
        self.sync_restarts()

    def sync_restarts(self) -> None:
        """At the end of the run: take Ray's restart count where it saw more than the loop did
        (a restarted process that ran no unit afterwards shows no new pid here)."""
        for a, (_, n) in self._ray_actors().items():
            if n > self.figures[a].restarts:
                log.info("actor %d: Ray restarted it %d times, %d seen here", a, n,
                         self.figures[a].restarts)
                self.figures[a].restarts = n
                self.killed_unseen.discard(a)  # back, in Ray's words: not a death unseen

    def on_probe(self, ref) -> None:
        import ray

        a = self.probing.pop(ref)
        self.probe_sent.pop(ref, None)
        self.progress[a] = time.monotonic()
        try:
            pid = ray.get(ref)
            self.saw_pid(a, int(pid))
            log.info("actor %d answers again after a failure (pid %d)", a, pid)
        except Exception:  # noqa: BLE001
            self._lose(a)

    def probe_once(self, a: int) -> None:
        """Ping actor `a` after it died under a unit, unless it is gone or pinged already."""
        if a in self.alive and a not in self.probing.values():
            self.probe(a)

    def _lose(self, a: int) -> None:
        self.killed_unseen.discard(a)
        self.alive.discard(a)
        self.deaths += 1
        log.warning("actor %d is gone for good; %d actors left", a, len(self.alive))
        self.emit({"event": "actor_lost", "actor": a})

    # ---- deadlines ---------------------------------------------------------------------------
    def unit_deadline(self) -> float:
        """Seconds an actor with units in flight may go without finishing one."""
        r = self.ray_cfg
        if r.unit_timeout_s is not None:
            return float(r.unit_timeout_s)
        times = sorted(self.unit_seconds)
        median = times[len(times) // 2] if times else 0.0
        return max(r.unit_timeout_min_s, DEADLINE_MEDIAN_FACTOR * median)

    def probe_deadline(self) -> float:
        """A restarted actor loads its engine again before it answers."""
        return max(self.unit_deadline(), 3 * self.load_seconds)

    def hung(self, sent_by_actor: dict[int, list]) -> list[tuple[int, list, float]]:
        """The actors with units in flight (`{actor: [(ref, sent), ...]}`) that finished nothing
        within the unit deadline, as (actor, refs, seconds stalled)."""
        now = time.monotonic()
        limit = self.unit_deadline()
        out = []
        for a, refs in sent_by_actor.items():
            since = max(self.progress.get(a, 0.0), min(t for _, t in refs))
            if now - since > limit:
                out.append((a, [r for r, _ in refs], now - since))
        return out

    def check_probes(self) -> None:
        """An actor that does not answer its ping in time is given up."""
        now = time.monotonic()
        for ref, sent in list(self.probe_sent.items()):
            if now - sent > self.probe_deadline():
                a = self.probing.pop(ref)
                del self.probe_sent[ref]
                log.warning("actor %d did not answer a ping in %.0f s", a, now - sent)
                self._kill(a, restart=False)
                self._lose(a)

    def _kill(self, a: int, restart: bool) -> None:
        import ray

        try:
            ray.kill(self.actors[a], no_restart=not restart)
        except Exception as e:  # noqa: BLE001 -- already gone
            log.debug("ray.kill of actor %d: %s", a, e)

    def kill_hung(self, a: int, stalled: float) -> None:
        """Actor `a` finished nothing within the deadline (a hung engine, a SIGSTOPped process,
        storage that never answers) and its units went to other actors: it is killed; Ray
        restarts it (max_restarts) and a ping tells when it is back."""
        self.deadline_kills += 1
        self.killed_unseen.add(a)
        self.emit({"event": "actor_deadline", "actor": a, "pid": self.pid.get(a),
                   "stalled_seconds": round(stalled, 1)})
        self._kill(a, restart=True)
        self.probe(a)
        self.progress[a] = time.monotonic()

    def probe(self, a: int) -> None:
        """Ping actor `a` to learn when it is back. The ping is retried by Ray through the
        actor's restart whatever ray.max_task_retries says: sent right after a kill it reaches
        the dying process first, and without a retry it failed there, so with
        max_task_retries=0 every actor killed at the deadline was declared lost although Ray
        restarted it. An actor with no restarts left still fails the ping at once."""
        ping = self.actors[a].ping.options(max_task_retries=-1).remote()
        self.probing[ping] = a
        self.probe_sent[ping] = time.monotonic()


class WaitLine:
    """No silent waits: while nothing finishes, a line at least every WAIT_LINE_SECONDS."""

    def __init__(self):
        self.last_event = self.last_line = time.monotonic()

    def event(self) -> None:
        """Something finished (a unit, a ping, a chunk): the silence starts again."""
        self.last_event = time.monotonic()

    def silent_for(self) -> "float | None":
        """Seconds since the last event when a line is due now, else None."""
        now = time.monotonic()
        if now - max(self.last_event, self.last_line) < WAIT_LINE_SECONDS:
            return None
        self.last_line = now
        return now - self.last_event
