"""Failures mid-run: an actor process killed by pid, a driver killed and started again.

The store must end complete, verified, with no duplicate and no missing row, and equal to the
single-process reference; a restarted driver must skip the units committed before the kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harvest.engine.models import REPO_ROOT
from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.support.pipeline import check_store, make_cfg
from tests.support.ray_actors import wait_actors_gone
from tests.support.waiting import wait_until

# Ray pipeline runs with killed processes: not in `pytest -m 'not slow'`
pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]  # eager Ray runs, no vLLM engine



class Killer:
    """on_event hook: SIGKILL one actor process that has units in flight, once; with `last_of`
    (the number of units) also the other actor at the last unit, waiting until Ray restarted it:
    a restart the loop never sees as a new pid (no unit runs after it). With `last_of` the first
    victim's restart is awaited too (the driver's loop waits in this hook, so no unit is handed
    out meanwhile): its new process is up before the survivor can take every unit left, which a
    loaded machine's slow restart would otherwise let it do."""

    def __init__(self, last_of: int | None = None):
        self.pids: dict[int, int] = {}
        self.killed: tuple[int, int] | None = None
        self.had_units = False
        self.events: list[dict] = []
        self.last_of = last_of
        self.done = 0
        self.new_pid: int | None = None     # the first victim's restarted process (with last_of)

    def __call__(self, e: dict) -> None:
        self.events.append(e)
        if e["event"] == "unit_done":
            self.pids[e["actor"]] = e["pid"]
            self.done += 1
        if e["event"] == "actors_ready":
            self.pids = {a["index"]: a["pid"] for a in e["actors"]}
        elif e["event"] == "unit_done" and self.done == self.last_of:
            kill_and_wait_for_ray_restart(self.pids[1 - self.killed[0]])
        elif e["event"] == "unit_done" and self.killed is None:
            busy = [a for a, n in sorted(e["in_flight"].items()) if n > 0]
            victim = busy[0] if busy else 1 - e["actor"]
            self.killed = (victim, self.pids[victim])
            self.had_units = victim in busy
            if self.last_of is None:
                os.kill(self.pids[victim], signal.SIGKILL)
            else:
                self.new_pid = kill_and_wait_for_ray_restart(self.pids[victim], alive=True)


def kill_and_wait_for_ray_restart(pid: int, timeout: float = 300, alive: bool = False) -> int:
    """SIGKILL the actor process `pid`; return once Ray's actor table counts its restart (and,
    with `alive`, once the restarted actor is ALIVE in a new process: its constructor ran).
    Returns the pid Ray's table gives the actor then."""
    from ray._private import state

    (actor_id,) = [i for i, a in state.actors().items() if a["Pid"] == pid
                   and a["State"] == "ALIVE"]
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        a = state.actors(actor_id=actor_id)
        return a["NumRestarts"] >= 1 and (not alive or (a["State"] == "ALIVE" and a["Pid"] != pid))

    wait_until(restarted, timeout, f"Ray to restart the actor of pid {pid}", interval=0.1)
    return int(state.actors(actor_id=actor_id)["Pid"])


def test_killed_actor_is_restarted_by_ray_and_store_is_exact(ray_cluster, tiny_llama, corpus,
                                                             reference, tmp_path):
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus)
    k = Killer(last_of=reference[0].n_units)
    summary = run(cfg, on_event=k)
    victim, dead_pid = k.killed
    store = open_store(cfg.store.resolved_url)
    check_store(store, reference)  # complete, each shard committed once, rows = reference
    # Ray restarted the actor in a new process, and every unit the actor ran was run by the
    # killed process or that one. Whether the new process runs any unit at all is the
    # dispatcher's choice under the box's timing (a loaded machine's slow restart can leave the
    # survivor every unit left), so that is not asserted.
    assert k.new_pid not in (None, dead_pid), (k.new_pid, dead_pid)
    assert set(summary["per_actor"][victim]["pids"]) <= {dead_pid, k.new_pid}, summary["per_actor"]
    assert all(m.pid != dead_pid or m.extra["actor"] == victim
               for m in store.ledger.committed_units().values())
    done = [e["unit_id"] for e in k.events if e["event"] == "unit_done"]
    assert sorted(done) == reference[0].unit_ids  # each unit reported once
    # the summary says what happened, Ray's own retries included: the victim had units in
    # flight, each re-run (by Ray in the new process, or re-queued here) counts as a retry
    # ...and the other actor, killed at the last unit, restarted by Ray and never given a unit
    # again, counts too: both restarts, each once (Ray's count where no new pid was seen)
    assert summary["actor_restarts"] == 2 and summary["actor_deaths_seen"] == 2, summary
    assert [a["restarts"] for a in summary["per_actor"]] == [1, 1], summary["per_actor"]
    assert summary["unit_retries"] >= int(k.had_units)
    assert sum(a["units"] + a["already_committed"] for a in summary["per_actor"]) == \
        summary["units_run"] + summary["units_found_committed"] == summary["units"]


def test_actor_lost_for_good_its_units_go_to_the_other(ray_cluster, tiny_llama, corpus,
                                                       reference, tmp_path):
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus,
                   "ray.max_restarts=0", "ray.max_task_retries=0")
    k = Killer()
    summary = run(cfg, on_event=k)
    victim, dead_pid = k.killed
    check_store(open_store(cfg.store.resolved_url), reference)
    assert any(e["event"] == "actor_lost" and e["actor"] == victim for e in k.events)
    assert summary["actor_deaths_seen"] == 1
    assert summary["per_actor"][victim]["pids"] in ([], [dead_pid])
    survivor = summary["per_actor"][1 - victim]
    done = [e for e in k.events if e["event"] == "unit_done"]
    assert sorted(e["unit_id"] for e in done) == reference[0].unit_ids
    # a unit the victim committed just before it died is found committed by its retry
    already = sum(e["status"] == "already_committed" for e in done)
    assert survivor["units"] + summary["per_actor"][victim]["units"] + already == len(done)
    # Units the victim had in flight were committed by the survivor, except one the victim
    # committed just before it died (its retry finds it already committed).
    found = {e["unit_id"] for e in done if e["status"] == "already_committed"}
    retried = {e["unit"] for e in k.events if e["event"] == "unit_retry"} - found
    if retried:
        by = {uid: m.extra["actor"] for uid, m in open_store(cfg.store.resolved_url)
              .ledger.committed_units().items()}
        assert all(by[u] == 1 - victim for u in retried)


def _commits(store_dir: Path) -> int:
    d = store_dir / "_harvest" / "commits"
    return len(list(d.glob("unit-*[0-9].json"))) if d.is_dir() else 0


def test_killed_driver_on_a_streaming_dataset_resumes_without_retokenising(
        ray_cluster, tiny_llama, corpus, reference, tmp_path):
    """A streamed jsonl is one block read in order; a chunk is one unit here. After the driver is
    SIGKILLed, the resumed run tokenises from the first uncommitted unit's chunk on (its cursor
    skips the rows before it without tokenising them) and the store ends bit-exact."""
    store_dir = tmp_path / "store"
    overrides = ["ray.num_actors=1", "ray.max_in_flight=1", "data.streaming=true",
                 "packing.chunk_tokens=256"]
    cfg = make_cfg(tiny_llama, str(store_dir), corpus, *overrides)
    conf = cfg.to_dict(redact=False)
    conf["ray"]["address"] = ray_cluster.address
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(conf))
    log = open(tmp_path / "driver.log", "w")
    ready = tmp_path / "gate.json"
    # the driver holds at a gate once it has handed 4 units to the actor (unit 0 first): it
    # dispatches nothing after, so at most 4 units can ever commit before the kill; the test
    # waits for those 4 commits in the store, then kills it. Never a race with the clock.
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.gated_driver", str(path),
                             str(ready), "sent:4"],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **ray_cluster.env})
    total = reference[0].n_units
    try:
        def at_gate() -> bool:
            assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            return ready.exists() and _commits(store_dir) >= 4

        wait_until(at_gate, 180, "the driver to reach its gate and its 4 units to commit")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    at_kill = _commits(store_dir)
    assert at_kill == 4 < total, (at_kill, total)
    # the dead driver's actor is killed by Ray (it owned it); until its process is gone it may
    # still commit a unit, and anything it committed counts
    wait_actors_gone(60, "the killed driver's actor")
    first = open_store(str(store_dir))
    before = set(first.ledger.committed_units())
    assert first.summary is None  # not finished
    assert first.ledger.plans.read_sources()["blocks"] == [[{"kind": "dataset", "shard": 0, "n_shards": 1}]]

    events: list[dict] = []
    summary = run(make_cfg(tiny_llama, str(store_dir), corpus, *overrides), on_event=events.append)
    ran = {e["unit_id"] for e in events if e["event"] == "unit_done"}
    assert summary["units_skipped"] == len(before) >= at_kill
    assert summary["units_run"] == total - len(before) == len(ran)
    assert not (ran & before)  # committed units were not run again
    todo = sorted(set(range(total)) - before)
    chunks = sorted((e["chunk"], e["n_contexts"]) for e in events if e["event"] == "chunk")
    tokenised = [c for c, _ in chunks]
    # Chunk k is unit k. The resumed run tokenises one job for the block: from the first
    # uncommitted unit's chunk (its recorded cursor) to the last planned unit's chunk, or, when
    # the plan was not final at the kill, on to the end of the run. So: nothing before that start,
    # each chunk once, no gap, and no chunk past the run's last unit. That is exact, whatever
    # the timing: chunks in flight at the kill were the dead driver's, not this run's. (It once
    # saw 24 chunk events from chunk 7 of 24: the continuation job counted packing.max_tokens
    # from its own cursor, i.e. 7 chunks past the end; resume.py now gives it what is left.)
    # The continuation job restarts at the frontier's last consumed chunk when that is before
    # the first uncommitted unit's (a stream restarts only at a chunk's recorded cursor; the
    # next chunk's is not known until it is read): at most that one committed chunk is re-read.
    start = tokenised[0]
    assert todo[0] - 1 <= start <= todo[0], (start, todo[0])
    assert tokenised == list(range(start, tokenised[-1] + 1)) and todo[0] > 0, tokenised
    assert set(todo) <= set(tokenised)
    # (an empty final chunk would be the corpus ending at a chunk boundary: not this corpus)
    assert all(c < total for c, n in chunks if n), chunks
    check_store(open_store(str(store_dir)), reference)
