"""No process a driver's local cluster started outlives the driver, even a SIGKILLed one
(pipeline/driver/reaper.py; issue 37 item 5). Plain processes stand in for Ray's: a "driver" starts a
"cluster" (a process with a child of its own, like the raylet and its agents) and the watcher,
then is SIGKILLed; the watcher stops both by pid, and leaves a bystander alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from harvest.engine.models import REPO_ROOT
from tests.support.waiting import wait_until

_DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from harvest.pipeline.driver import reaper
    # the "cluster": a process whose child survives it (as Ray's agents survived the raylet)
    root = subprocess.Popen([sys.executable, "-c",
        "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"])
    while len(__import__("psutil").Process(root.pid).children()) < 1:
        time.sleep(0.05)
    w = reaper.start({root.pid})
    print(root.pid, w.pid, flush=True)
    time.sleep(600)  # SIGKILLed here by the test
""")


def test_a_sigkilled_driver_leaves_no_process_of_its_cluster():
    bystander = subprocess.Popen(["sleep", "600"])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    drv = subprocess.Popen([sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True,
                           env=env, cwd=REPO_ROOT)
    try:
        root, watcher = (int(x) for x in drv.stdout.readline().split())
        cluster = [psutil.Process(root)] + psutil.Process(root).children(recursive=True)
        assert len(cluster) == 2
        os.kill(drv.pid, signal.SIGKILL)
        drv.wait(30)

        def gone() -> bool:
            return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in cluster)

        wait_until(gone, 60, "the cluster's processes to be stopped after the driver's SIGKILL")
        wait_until(lambda: not psutil.pid_exists(watcher) or
                   psutil.Process(watcher).status() == psutil.STATUS_ZOMBIE, 30,
                   "the watcher to exit")
        assert bystander.poll() is None          # nothing else was touched
    finally:
        for p in (drv, bystander):
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_shutdown_ray_returns_only_when_the_local_clusters_processes_are_gone(monkeypatch):
    """`ray.shutdown()` signals a local cluster and returns before its processes exit (a
    SIGTERMed driver once exited while one of its cluster's processes still ran). Stand-in: a
    "cluster" root whose child lingers 3 s after the root ends (as the raylet's agents and
    workers do), and a ray.shutdown that only ends the root. `shutdown_ray` must return with the
    child gone, and leave a bystander alone: the verdict depends on no timing (the child would
    outlive the root by 3 s in every run without the wait)."""
    import ray

    from harvest.pipeline.driver import exits

    bystander = subprocess.Popen(["sleep", "600"])
    root = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c",
            "import os, time\\nppid = os.getppid()\\n"
            "while os.getppid() == ppid: time.sleep(0.05)\\ntime.sleep(3)"])
        time.sleep(600)""")])
    try:
        wait_until(lambda: len(psutil.Process(root.pid).children()) == 1, 60, "the root's child")
        child = psutil.Process(root.pid).children()[0]
        monkeypatch.setitem(exits._cluster, "roots", {root.pid})
        monkeypatch.setitem(exits._reaper, "proc", None)
        monkeypatch.setattr(ray, "shutdown", lambda: root.terminate())
        exits.shutdown_ray(grace=30)
        assert root.poll() is not None or root.wait(5) is not None
        assert not (child.is_running() and child.status() != psutil.STATUS_ZOMBIE), \
            "shutdown_ray returned while a process of the cluster still ran"
        assert bystander.poll() is None
        assert "roots" not in exits._cluster
    finally:
        for p in (root, bystander):
            if p.poll() is None:
                p.kill()
                p.wait(10)
