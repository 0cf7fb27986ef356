"""The suite on two xdist workers: every engine test (a slow test not marked `beside_engines`:
it starts a vLLM engine, or times something) runs on one worker, one at a time, in collection
order; the unit subset and the `beside_engines` modules run on the other, beside them.

xdist's own `--dist loadgroup` cannot do this under pytest 9: it renames grouped tests by
assigning `item._nodeid`, which pytest 9's nodes no longer read (they keep `_id`), so the groups
silently vanish and engine tests run on both workers at once. Instead each worker writes the ids of
its engine tests to a folder the controller named in the environment (workers inherit it), and
the controller's scheduler (xdist's load-scope scheduler, which sends each scope to one worker
whole and in order) makes those ids one scope. Every worker collects the same tests, so each
writes the same list.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

ENV = "HARVEST_TEST_ENGINE_IDS"
SCOPE = "engines"


def is_engine_test(item) -> bool:
    return bool(item.get_closest_marker("slow")) and not item.get_closest_marker("beside_engines")


def controller_setup(config) -> None:
    """On the controller of an xdist run (it collects nothing): the folder for the workers' lists."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        os.environ[ENV] = tempfile.mkdtemp(prefix="harvest-xdist-")


def controller_teardown(config) -> None:
    if getattr(config, "workerinput", None) is None and os.environ.get(ENV):
        shutil.rmtree(os.environ.pop(ENV), ignore_errors=True)


def worker_write(items) -> None:
    folder = os.environ.get(ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if folder and worker:
        ids = [i.nodeid for i in items if is_engine_test(i)]
        tmp = Path(folder) / f".{worker}.json"
        tmp.write_text(json.dumps(ids))
        os.replace(tmp, Path(folder) / f"{worker}.json")


class EngineScopeScheduling(LoadScopeScheduling):
    """Load-scope scheduling where the scope of an engine test is `SCOPE` and every other test is
    its own scope. The largest scope goes out first (xdist's default reordering), so one worker
    starts on the engine tests at once and the other takes the rest test by test."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self._engine_ids: set[str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._engine_ids is None:  # scheduling starts once every worker has collected
            folder = Path(os.environ[ENV])
            self._engine_ids = set()
            for f in folder.glob("gw*.json"):
                self._engine_ids.update(json.loads(f.read_text()))
        return SCOPE if nodeid in self._engine_ids else nodeid
