"""One driver per store: the lease (pipeline/driver/lease.py).

The scenario that once corrupted a store for good: driver A creates the store and is paused;
driver B, whose config differs only in store.unit_shards (not part of the run's identity, so B
took the store for its own resume), started planning units of another size. Now B is refused
before it writes anything, naming A, and A, continued, finishes a store that verifies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from harvest.pipeline.cli.main import main
from harvest.engine.models import REPO_ROOT
from harvest.pipeline.errors import HarvestError
from harvest.pipeline.driver.lease import Lease, current, refuse_if_held
from harvest.store import open_store
from harvest.store.storage.locate import locate
from tests.support.pipeline import make_cfg
from tests.support.waiting import wait_until, wait_until_stable

pytestmark = pytest.mark.slow  # driver processes on a Ray cluster: not in `pytest -m 'not slow'`


def _alive(proc, log: Path) -> bool:
    assert proc.poll() is None, log.read_text()[-3000:]
    return True


def _tree(root: Path) -> dict:
    """Every path under root with its mtime; a file that goes between the listing and its stat
    (the actor is still publishing) is left out: the caller waits until two readings agree."""
    out = {}
    for d, dirs, files in os.walk(root):  # os.walk skips a folder that goes while it lists
        for name in dirs + files:
            p = Path(d) / name
            try:
                out[str(p.relative_to(root))] = p.stat().st_mtime_ns
            except FileNotFoundError:
                continue
    return out


def test_lease_is_exclusive_and_a_paused_holder_stops(tmp_path):
    loc = locate(str(tmp_path / "store"))
    a = Lease(loc, 2.0, "store", {"run": 1}, "a").acquire()
    with pytest.raises(HarvestError, match=r"being written by another driver pid \d+ .*lease 0"):
        Lease(loc, 2.0, "store", {"run": 2}, "b").acquire()
    a.assert_held("writing")  # still ours
    # A is "paused": its heartbeats stop (the thread is stopped without releasing)
    a._stop.set()
    a._thread.join()
    time.sleep(2.2)  # the thing under test: the 2 s lease expires without heartbeats
    b = Lease(loc, 2.0, "store", {"run": 2}, "b").acquire()  # expired: free to take
    assert b.gen == 1 and current(loc).gen == 1
    a.last_beat = 0.0  # A wakes up after the pause: its next control write checks first
    with pytest.raises(HarvestError, match=r"lost the lease .* stopped before writing plan"):
        a.assert_held("writing plan segment 3")
    b.release()
    refuse_if_held(loc, 60.0, "store")  # released: free at once
    c = Lease(loc, 60.0, "store", {"run": 3}, "c").acquire()
    assert c.gen == 2
    c.remove_if_alone()  # no store was created: no lease object or directory of ours is left
    assert list((tmp_path / "store").iterdir()) == []  # (A made this directory, not C)


@pytest.fixture
def driver_a(ray_cluster, tiny_llama, corpus, tmp_path):
    """Driver A in its own process (so it can be paused), on the shared test cluster, held at a
    gate after its first unit (tests/support/gated_driver.py) until the test opens it: it cannot
    finish (and release its lease) before the test is done with it, however fast the machine."""
    store = tmp_path / "store"
    cfg = make_cfg(tiny_llama, str(store), corpus, "ray.num_actors=1", "ray.max_in_flight=1")
    conf = cfg.to_dict(redact=False)
    conf["ray"]["address"] = ray_cluster.address
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump(conf))
    log = open(tmp_path / "a.log", "w")
    ready, gate = tmp_path / "a.ready", tmp_path / "a.open"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.gated_driver", str(path),
                             str(ready), "1", str(gate)],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **ray_cluster.env})
    try:
        yield proc, store, conf, ready, gate
    finally:
        if proc.poll() is None:  # by pid: the one process this fixture started
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(30)
        log.close()


def test_second_driver_is_refused_and_the_first_finishes(driver_a, tmp_path, capsys):
    proc, store, conf, ready, gate = driver_a
    wait_until(lambda: _alive(proc, tmp_path / "a.log") and ready.exists(), 180,
               "driver A to commit its first unit and hold at its gate")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        # A's driver is stopped, its actor is not: it finishes (commits) the unit it had
        before = wait_until_stable(lambda: _tree(store), 0.5, 60, "driver A's store to be quiet")
        conf_b = {**conf, "store": {**conf["store"], "unit_shards": 2}}
        conf_b["ray"] = {**conf["ray"], "address": None}
        path_b = tmp_path / "b.yaml"
        path_b.write_text(yaml.safe_dump(conf_b))
        t0 = time.monotonic()
        assert main(["run", "--config", str(path_b)]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert time.monotonic() - t0 < 30
        assert err.startswith("harvest run: error: store.url=") and \
            f"being written by another driver pid {proc.pid}" in err, err
        assert _tree(store) == before  # B wrote nothing
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        gate.touch()
    assert proc.wait(300) == 0, (tmp_path / "a.log").read_text()[-3000:]
    st = open_store(str(store))
    v = st.verify()
    assert v.ok and not v.missing_units, v
    assert st.summary is not None and st.summary["status"] == "complete"
    assert current(st.location).record.released is True


def test_sigterm_releases_the_lease_and_stops_the_ray_it_started(ray_auth_env, tiny_llama,
                                                                 corpus, tmp_path):
    """A driver that started its own Ray, ended by SIGTERM mid-run (a `kill`, a timeout, a pod
    deleted): it exits 143 at once, with its lease released (another host would otherwise wait
    out store.lease_seconds) and every process it started (Ray's included) gone."""
    import psutil

    store = tmp_path / "store"
    cfg = make_cfg(tiny_llama, str(store), corpus, "ray.num_actors=1", "ray.max_in_flight=1",
                   "ray.local_num_cpus=2", "store.lease_seconds=3600")
    conf = cfg.to_dict(redact=False)
    conf["ray"]["address"] = None  # this driver starts its own local Ray
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(conf))
    ray_tmp = tempfile.mkdtemp(prefix="hvterm-", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(ray_auth_env, RAY_TMPDIR=ray_tmp, HARVEST_CACHE=str(tmp_path / "cache"))
    log = open(tmp_path / "driver.log", "w")
    ready = tmp_path / "gate.json"
    # held at a gate after its first unit (tests/support/gated_driver.py): the SIGTERM always
    # comes mid-run, however fast the machine
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.gated_driver", str(path),
                             str(ready), "1"],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    kids: list = []
    try:
        wait_until(lambda: _alive(proc, tmp_path / "driver.log")  # actors up, a unit committed
                   and ready.exists(), 240, "the driver to commit a unit and hold at its gate")
        kids = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(k.cmdline()) for k in kids), "no Ray of its own?"
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:  # by pid: the driver this test started, then its children
            proc.kill()
            proc.wait(30)
        for k in kids:
            try:
                k.kill()
            except psutil.Error:
                pass
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = (tmp_path / "driver.log").read_text()
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert "harvest run: stopped by SIGTERM: the store is resumable" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert took < 60, f"the driver took {took:.0f} s to stop"
    left = [k.pid for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes the driver started outlived it: {left}"
    lease = current(locate(str(store)))
    assert lease is not None and lease.record.released is True, lease
    refuse_if_held(locate(str(store)), 3600, "store")  # the next run starts at once
