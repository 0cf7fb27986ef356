"""Units handed to the capture actors and not back yet, and how many each actor holds.

The scheduler sends an actor up to `slots` units at once (enough that its engine never runs dry
between units, dispatch.Scheduler.attach); a unit's entry remembers when it was sent (the unit
deadline, health.py) and the actor's process id then (a result from another process means Ray
re-ran the unit in a restarted actor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...store import Unit


@dataclass(frozen=True)
class Sent:
    unit: Unit
    actor: int
    attempt: int
    at: float                # time.monotonic() when it was sent
    pid: "int | None"        # the actor's process id when it was sent
    replay: object = None    # a streamed run's replay for one rank: the task to send again


class InFlight:
    """ref -> `Sent`, and each actor's count of units in flight."""

    def __init__(self, slots: int):
        self.slots = slots              # units one actor may hold at once
        self.sent: dict = {}
        self.load: list[int] = []

    def attach(self, n_actors: int, slots: int) -> None:
        self.load = [0] * n_actors
        self.slots = slots

    def add(self, ref, unit: Unit, actor: int, attempt: int, pid: "int | None",
            replay=None) -> None:
        self.sent[ref] = Sent(unit, actor, attempt, time.monotonic(), pid, replay)
        self.load[actor] += 1

    def pop(self, ref) -> Sent:
        s = self.sent.pop(ref)
        self.load[s.actor] -= 1
        return s

    def free(self, actors) -> int:
        """Slots free over `actors`."""
        return sum(max(0, self.slots - self.load[a]) for a in actors)

    def by_actor(self) -> dict[int, list]:
        """{actor: [(ref, sent at), ...]} for the unit deadline."""
        out: dict[int, list] = {}
        for ref, s in self.sent.items():
            out.setdefault(s.actor, []).append((ref, s.at))
        return out

    def __contains__(self, ref) -> bool:
        return ref in self.sent

    def __iter__(self):
        return iter(self.sent)

    def __len__(self) -> int:
        return len(self.sent)
