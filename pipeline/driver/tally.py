"""What became of a run's units, as the scheduler counted it, and the figures the driver puts
in the run's summary (driver._summary): one typed record instead of the driver reading a dozen of
the scheduler's attributes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NotRequired, TypedDict


class FaultFigures(TypedDict):
    """Retries and deaths of a run, as DispatchReport.fault_figures counts them."""

    unit_retries: int
    ray_task_retries: int
    unit_deadlines: int
    actor_restarts: int
    actors_lost: int
    actor_deaths_seen: int
    units_found_committed: int


class RunSummary(FaultFigures):
    """A run's summary (driver.run's return, the store's `summary` attribute, the `done`
    event): a dict because it is JSON in the store and in events; typed so that what builds it
    and what reads it agree on the keys."""

    name: str
    store: str
    status: Literal["complete", "paused"]
    model: dict
    points: int
    width: int
    context_size: int
    tokens: int
    tokens_this_run: int
    rows_with_activations_this_run: int
    """Of tokens_this_run, the rows holding activations (the rest are padding, roles outside
    capture.roles or generated rows, stored as zeros): what a reader yields by default."""
    units: int
    units_run: int
    units_skipped: int
    bytes_logical: int
    bytes_stored: int
    compression_ratio: float | None
    dispatch_seconds: float
    wall_seconds: float
    tokens_per_second: float | None
    per_actor: list
    throttled_requests: int
    blocks: int
    tokenised_jobs: int
    data: dict
    packing: dict
    verified: dict
    finished_at: str
    paused: NotRequired[bool]
    """A scheduled tick stopped at its token budget: committed and verified, not finalized."""
    planned_tokens: NotRequired[int]
    noop: NotRequired[bool]
    """The store was complete already: this is its recorded summary, nothing ran."""


@dataclass
class UnitCounts:
    """The scheduler's own counts (the actors' deaths and restarts are health.ActorHealth's)."""

    retries: int = 0          # units re-queued by this loop (errors, deaths, deadlines)
    ray_retries: int = 0      # units Ray re-ran itself on a restarted actor (pid changed)
    found_committed: int = 0  # units whose run found them committed already
    units_run: int = 0        # units committed by this run


@dataclass(frozen=True)
class DispatchReport:
    """A run's dispatch figures. The defaults are a run that dispatched nothing (a store whose
    units were all committed and only needed finalizing)."""

    per_actor: list = field(default_factory=list)   # health.ActorTally.as_dict() per actor
    tokens_run: int = 0
    rows_with_activations_run: int = 0   # of tokens_run: rows holding activations
    units_run: int = 0
    found_committed: int = 0
    retries: int = 0
    ray_retries: int = 0
    deadline_kills: int = 0
    actor_restarts: int = 0
    deaths: int = 0
    killed_unseen: int = 0
    tokenised_jobs: int = 0
    data: "dict | None" = None   # source and packing figures (None: read them from the plan)

    def fault_figures(self) -> FaultFigures:
        """Retries and deaths counted from what happened, Ray's own included: a unit Ray re-ran
        in a restarted actor (max_task_retries) reaches the loop as a success, seen only as a new
        pid (45 actor kills once read `unit_retries 0, actor deaths 0`)."""
        return {
            "unit_retries": self.retries + self.ray_retries,
            "ray_task_retries": self.ray_retries,
            "unit_deadlines": self.deadline_kills,
            "actor_restarts": self.actor_restarts,
            "actors_lost": self.deaths,
            # an actor killed at the deadline and not seen since (back or lost) died all the same
            "actor_deaths_seen": self.actor_restarts + self.deaths + self.killed_unseen,
            # units_skipped + units_run + units_found_committed == units; per_actor units plus
            # already_committed sum to units_run + units_found_committed
            "units_found_committed": self.found_committed,
        }
