"""Scheduled runs (`harvest schedule extend|checkpoints`): what one cron tick does.

Two modes, both decided from the store alone (its plan, commit markers and lease) before any
actor or GPU starts, so a tick with nothing to do costs a few small reads:

- **extend**: one store grows by the next `tokens_per_tick` tokens of a pinned corpus each tick,
  until `packing.max_tokens` (the budget) is reached. The store is planned for the whole budget at
  its first tick; each tick is a run of that store that *pauses* once its tokens are placed
  (driver.run(stop_tokens=...)): every unit it planned is committed, nothing is finalized, and the
  next tick resumes from the recorded frontier exactly as a run resumes after a crash. So three
  ticks give the rows of one long run, bit for bit; the tick that reaches the budget finalizes.
- **checkpoints**: one store per model checkpoint found under a directory (each subdirectory with
  a config.json), at `<store.url>/<checkpoint name>`, all from the same data and packing config:
  the same tokens land in the same rows of every store (row-aligned across checkpoints), which the
  tick checks against the first finished store's token ids.

A tick whose store is being written by a live driver alerts: `busy` (exit 3) while that run is
younger than `stuck_after_s`, `stuck` (exit 4) after. A failed run exits 1 and reports the
tokens it left committed. Every outcome is a `Tick` with a one-line status, optionally POSTed to a
webhook. Each run's summary is kept beside the store (`_harvest/schedule/tick-<n>.json`): the
report and `harvest plan` read rates from them. Each tick first records its target
(`start-<n>.json`, schedule_log.py): a tick killed or failed before its end is finished by the
next one, up to that target, and recorded under its own number.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, get_args

from ..config.fields import ConfigError, check_float, check_int
from . import schedule_log
from ..config.run import HarvestConfig, from_dict
from ..config.corpus import DataConfig
from ..config.sections import StoreConfig
from .lease import LeaseSeen
from .tally import RunSummary

log = logging.getLogger("harvest.pipeline")

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_BUSY, EXIT_STUCK = 0, 1, 2, 3, 4
ScheduleMode = Literal["extend", "checkpoints"]
MODES: tuple[str, ...] = get_args(ScheduleMode)


@dataclass
class ScheduleConfig:
    """One schedule. `tokens_per_tick` (extend) is rounded up to whole work units; `checkpoints`
    is a directory of checkpoint directories (a mounted bucket or PVC works the same)."""

    mode: ScheduleMode = "extend"
    tokens_per_tick: int | None = None
    checkpoints: str | None = None
    stuck_after_s: float = 6 * 3600.0
    webhook: str | None = None
    check_only: bool = False

    def validate(self, cfg: HarvestConfig) -> "ScheduleConfig":
        if self.mode not in MODES:
            raise ConfigError(f"schedule mode {self.mode!r}: choose one of {', '.join(MODES)}")
        check_float("schedule.stuck_after_s", self.stuck_after_s, 1.0, 30 * 24 * 3600.0)
        if self.mode == "extend":
            check_int("schedule.tokens_per_tick (--tokens)", self.tokens_per_tick, 1)
            if cfg.packing.max_tokens is None:
                raise ConfigError(
                    "schedule extend needs packing.max_tokens: it is the store's token budget, "
                    "planned at the first tick; set it (e.g. --set packing.max_tokens=1000000000)")
        elif not self.checkpoints:
            raise ConfigError("schedule checkpoints needs --checkpoints DIR: a directory whose "
                              "subdirectories are model checkpoints")
        if _is_hub(cfg.data) and not re.fullmatch(r"[0-9a-f]{40}", cfg.data.revision or ""):
            # a branch or tag moves: the next tick would read another corpus under the same name
            # (resume then refuses it, if the changed rows are in a chunk it re-reads at all)
            raise ConfigError(
                f"data.source={cfg.data.source!r} is a hub dataset and data.revision="
                f"{cfg.data.revision!r} is not a commit sha: a schedule must read the same corpus "
                "at every tick; set data.revision to the 40-hex commit sha (the dataset page's "
                "'History')")
        return self


def _is_hub(data: DataConfig) -> bool:
    """A hub dataset name (not the offline pydoc corpus, not a local path or URL)."""
    s = data.source
    if data.format == "hub":
        return True
    return (s != "pydoc" and "://" not in s and not Path(os.path.expanduser(s)).exists()
            and not any(c in s for c in "*?[") and s.count("/") <= 1)


@dataclass
class Tick:
    """One tick's outcome for one store: what it found or did, and the exit code it means."""

    status: str        # complete | ran | paused | would_run | busy | stuck | failed | invalid
    store: str
    message: str
    tokens: int = 0     # committed tokens after the tick
    budget: int | None = None
    summary: RunSummary | None = None

    @property
    def exit_code(self) -> int:
        return {"busy": EXIT_BUSY, "stuck": EXIT_STUCK, "failed": EXIT_FAILED,
                "invalid": EXIT_INVALID}.get(self.status, EXIT_OK)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "exit_code": self.exit_code}


@dataclass
class StoreState:
    """What the store says, from plan, markers and lease only (no data read, nothing started)."""

    exists: bool
    finished: bool = False     # finalized (summary written)
    committed_tokens: int = 0
    planned_tokens: int = 0
    lease: LeaseSeen | None = None   # the live driver's lease, or None
    shown_url: str = ""
    location: Any = None       # the store's Storage, located once for the whole tick


def store_state(cfg: HarvestConfig) -> StoreState:
    from .lease import current
    from .resume import check_resume, probe_store
    from ...store import redact_url

    shown = redact_url(cfg.store.resolved_url)
    loc = cfg.store.location()
    store = probe_store(cfg.store, loc, create_bucket=cfg.store.create_bucket)
    if store is None:  # a first tick may still be starting: its lease comes before the store
        cur = current(loc)
        live = cur if cur is not None and cur.live(cfg.store.lease_seconds) else None
        return StoreState(False, lease=live, shown_url=shown, location=loc)
    check_resume(store, cfg)  # a schedule pointed at another run's store stops here, named
    plan = store.ledger.plans.read()
    rows = plan.rows()
    done = {n.unit_id for n in store.ledger.marker_names() if rows.get(n.unit_id) == n.rows}
    committed = sum(e - s for uid, (s, e) in rows.items() if uid in done)
    cur = current(loc)
    live = cur if cur is not None and cur.live(cfg.store.lease_seconds) else None
    return StoreState(True, store.summary is not None, committed,
                      sum(e - s for s, e in rows.values()), live, shown, loc)


def _alive(st: StoreState, sc: ScheduleConfig) -> "Tick | None":
    """busy/stuck when a live driver holds the store (the previous tick still running)."""
    if st.lease is None:
        return None
    rec = st.lease.record
    age = time.time() - float(rec.acquired or rec.heartbeat or time.time())
    who = st.lease.who()
    if age > sc.stuck_after_s:
        return Tick("stuck", st.shown_url,
                    f"the previous run has held {st.shown_url} for {age / 3600:.1f} h (more than "
                    f"--stuck-after {sc.stuck_after_s / 3600:g} h) and is still alive: {who}; "
                    "look at it (logs, `harvest status`) and stop it, then the next tick resumes",
                    st.committed_tokens)
    return Tick("busy", st.shown_url,
                f"the previous run is still writing {st.shown_url} ({age / 60:.0f} min so far): "
                f"{who}; this tick does nothing. Ticks overlap: space them further apart",
                st.committed_tokens)


RunFn = Callable[..., RunSummary]


def _default_run(cfg: HarvestConfig, stop_tokens: "int | None" = None) -> RunSummary:
    from .run import run

    return run(cfg, stop_tokens=stop_tokens)


def extend_tick(cfg: HarvestConfig, sc: ScheduleConfig, run_fn: RunFn = _default_run) -> Tick:
    """Capture the next tokens_per_tick tokens into cfg's store, or say why not."""
    sc.validate(cfg)
    budget = cfg.packing.max_tokens
    st = store_state(cfg)
    if st.finished:
        return Tick("complete", st.shown_url,
                    f"{st.shown_url} is complete: {st.committed_tokens:,} tokens committed "
                    f"(budget packing.max_tokens={budget:,}); nothing to do, nothing started",
                    st.committed_tokens, budget)
    alert = _alive(st, sc)
    if alert is not None:
        alert.budget = budget
        return alert
    loc = st.location
    seq, start = schedule_log.open_start(loc)
    if start is not None and st.committed_tokens >= int(start.get("target_tokens", 0)) \
            and st.committed_tokens == st.planned_tokens:
        if not sc.check_only:
            schedule_log.drop_start(loc, seq)  # it died after its last commit: nothing owed
        start = None
    if sc.check_only:
        what = (f"finish tick {seq} (killed or failed; target {start['target_tokens']:,} "
                "tokens)" if start else f"capture the next {sc.tokens_per_tick:,}")
        return Tick("would_run", st.shown_url,
                    f"{st.shown_url}: {st.committed_tokens:,} of {budget:,} tokens committed; a "
                    f"tick would {what}", st.committed_tokens, budget)
    resumed = start is not None
    if start is None:  # kept before anything starts: a killed tick's re-run knows its tokens
        start = schedule_log.record_start(loc, seq, {
            "started": time.time(), "tokens_per_tick": sc.tokens_per_tick,
            "planned_tokens": st.planned_tokens, "committed_tokens": st.committed_tokens,
            "target_tokens": st.planned_tokens + sc.tokens_per_tick}, cfg.store.storage_options)
    stop = max(0, int(start["target_tokens"]) - st.planned_tokens)
    tick = _run_one(cfg, run_fn, stop, budget, loc, seq=seq, start=start)
    if resumed:
        tick.message = (f"tick {seq} was killed or failed before its end; this run finished its "
                        f"tokens (target {int(start['target_tokens']):,}): " + tick.message)
    return tick


def _run_one(cfg: HarvestConfig, run_fn: RunFn, stop_tokens: "int | None",
             budget: "int | None", loc, seq: "int | None" = None,
             start: "dict | None" = None) -> Tick:
    from ...store import redact_url

    shown = redact_url(cfg.store.resolved_url)
    t0 = time.time()
    try:
        summary = run_fn(cfg, stop_tokens=stop_tokens)
    except Exception as e:  # noqa: BLE001 -- the tick reports it (exit 1) instead of a traceback
        from ...store import scrub

        tokens = _committed_after_failure(cfg)
        why = scrub(f"{type(e).__name__}: {e}", cfg.store.storage_options)
        return Tick("failed", shown, f"the run on {shown} failed: {why}; "
                    f"{'?' if tokens is None else f'{tokens:,}'} tokens are committed and the "
                    "store is resumable: the next tick continues it", tokens or 0, budget)
    if summary.get("noop"):
        return Tick("complete", shown, f"{shown} is complete: nothing to do",
                    summary.get("tokens") or 0, budget, summary)
    schedule_log.record_tick(loc, summary, t0, seq, start, cfg.store.storage_options)
    status = "paused" if summary.get("paused") else "ran"
    left = "" if budget is None else f" of {budget:,}"
    return Tick(status, shown,
                f"captured {summary.get('tokens_this_run', 0):,} tokens into {shown}: "
                f"{summary.get('tokens', 0):,}{left} committed"
                + ("; the next tick continues" if status == "paused" else "; the store is complete"),
                summary.get("tokens") or 0, budget, summary)


def _committed_after_failure(cfg: HarvestConfig) -> "int | None":
    """What a failed run left committed (its units stay: the next tick skips them), read from
    the store's plan and markers; None when the store cannot be read either."""
    try:
        return store_state(cfg).committed_tokens
    except Exception as e:  # noqa: BLE001 -- the failure itself is what the tick reports
        log.warning("after the failed run, the store could not be read: %s", e)
        return None


# ---- checkpoints ---------------------------------------------------------------------------------

def find_checkpoints(root: str) -> list[tuple[str, str]]:
    """(name, path) of every checkpoint directory (one holding config.json) under `root`."""
    base = Path(os.path.expanduser(root))
    if not base.is_dir():
        raise ConfigError(f"--checkpoints {root!r} is not a directory: give the directory whose "
                          "subdirectories are checkpoints (mount a bucket prefix first)")
    return sorted((d.name, str(d)) for d in base.iterdir() if (d / "config.json").is_file())


def for_checkpoint(cfg: HarvestConfig, name: str, path: str) -> HarvestConfig:
    d = cfg.to_dict(redact=False)
    d["model"]["path"] = path
    d["store"]["url"] = cfg.store.url.rstrip("/") + "/" + name
    return from_dict(d)


def checkpoint_tick(cfg: HarvestConfig, sc: ScheduleConfig,
                    run_fn: RunFn = _default_run) -> list[Tick]:
    """A store per checkpoint without a finished one; the same rows in each."""
    sc.validate(cfg)
    ticks: list[Tick] = []
    for name, path in find_checkpoints(sc.checkpoints):
        c = for_checkpoint(cfg, name, path)
        st = store_state(c)
        if st.finished:
            ticks.append(Tick("complete", st.shown_url, f"checkpoint {name}: {st.shown_url} is "
                              "complete", st.committed_tokens))
            continue
        alert = _alive(st, sc)
        if alert is not None:
            ticks.append(alert)
            continue
        if sc.check_only:
            ticks.append(Tick("would_run", st.shown_url, f"checkpoint {name}: a tick would "
                              f"capture {st.shown_url}", st.committed_tokens))
            continue
        ticks.append(_run_one(c, run_fn, None, cfg.packing.max_tokens, st.location))
    if not ticks:
        ticks.append(Tick("complete", cfg.store.url, f"no checkpoints under {sc.checkpoints!r} "
                          "(a checkpoint is a directory holding config.json)"))
    bad = aligned(cfg.store, [n for n, _ in find_checkpoints(sc.checkpoints)])
    if bad:
        ticks.append(Tick("failed", cfg.store.url, bad))
    return ticks


def aligned(store: StoreConfig, names: list[str]) -> "str | None":
    """None when every finished checkpoint store holds the same rows as the first: the same row
    count, unit plan and committed units, and in every unit the same token, document and position
    columns, compared by the CRC32C digests of those columns in the units' commit markers (every
    row, for the price of reading the markers; harvest.store.commit.alignment). Else what differs,
    naming the unit and the first differing row (a tokenizer or data change between checkpoints)."""
    from ...store import open_store
    from ...store import StoresNotAligned, check_aligned

    finished = []
    for name in names:
        url = store.url.rstrip("/") + "/" + name
        try:
            s = open_store(url, storage_options=store.fs_options())
        except Exception:  # noqa: BLE001 -- not created yet
            continue
        if s.summary is not None:
            finished.append((name, s))
    for other in finished[1:]:
        try:
            check_aligned([finished[0][1], other[1]], [finished[0][0], other[0]])
        except StoresNotAligned as e:
            return (f"checkpoint {e} (their tokenizers or data differ: capture them with one "
                    "tokenizer and one pinned corpus)")
    return None


# ---- alerts --------------------------------------------------------------------------------------

def notify(url: str, ticks: list[Tick], timeout: float = 10.0) -> "str | None":
    """POST the ticks as JSON to a webhook (Slack-style `text` plus the details); returns an
    error string instead of raising: a dead webhook must not hide the tick's own exit code.
    The error names the webhook by its scheme and host only: a Slack or Teams webhook's path
    is its secret, and this string is printed and logged."""
    from ...store import mask_text, url_origin

    worst = max(ticks, key=lambda t: t.exit_code)
    body = json.dumps({"text": f"harvest schedule: {worst.status}: {worst.message}",
                       "ticks": [t.as_dict() for t in ticks]}, default=str).encode()
    shown = url_origin(url)
    try:
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
        return None
    except Exception as e:  # noqa: BLE001
        # scheme and host only (url_origin): the path of a Slack-style URL is its secret, and
        # an error may quote the URL or its path
        why = f"{type(e).__name__}: {e}"
        rest = url.split("://", 1)[-1]
        path = "/" + rest.split("/", 1)[1] if "/" in rest else ""
        for part in (url, url.split("?", 1)[0], rest, path):
            if len(part) > 1:
                why = why.replace(part, shown)
        return mask_text(f"webhook {shown} failed: {why}")
