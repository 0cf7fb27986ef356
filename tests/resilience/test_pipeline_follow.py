"""Follow mode against a live 2-actor pipeline run with an actor killed mid-run (issue 39).

One run serves every assertion. At the driver's `plan` event (the store exists, nothing is
dispatched yet: the driver's loop waits for the hook) two followers start and the hook returns
only once both have looked at the store, so they start before the first commit on any machine.
At the first `unit_done` the hook SIGKILLs an actor with units in flight (Ray restarts it, its
units run again). Follower A reads to the end; follower B stops after a few batches, saves its
state, and a follower built from that state reads on. Both must end by themselves at finalize,
and their rows are recounted against a plain read of the finished store: every row once, the
same (doc_id, position) multiset, identical bytes.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import torch

from harvest.pipeline.driver.run import run
from harvest.store.read.dataset import ActivationDataset
from tests.support.pipeline import make_cfg
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.beside_engines,  # eager Ray runs, no vLLM engine
              pytest.mark.filterwarnings("ignore:shuffle_buffer_rows=")]

OPTS = dict(batch_size=64, shuffle_buffer_rows=512, follow=True, follow_poll=0.05, return_meta=True)
HEAD = 7   # batches follower B yields before it saves its state


def _take(b) -> dict:
    return {"row": b["row"].numpy().copy(), "doc_id": b["doc_id"].numpy().copy(),
            "position": b["position"].numpy().copy(), "acts": b["acts"].view(torch.int16).numpy().copy()}


class Followers:
    """The run's on_event hook: starts the followers at `plan`, kills an actor at the first
    `unit_done`; the followers' batches and errors are kept for the assertions."""

    def __init__(self, url: str):
        self.url = url
        self.pids: dict[int, int] = {}
        self.killed: int | None = None
        self.first_poll_committed: list[int] = []
        self.a: list[dict] = []
        self.b_head: list[dict] = []
        self.b_rest: list[dict] = []
        self.state: dict | None = None
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def __call__(self, e: dict) -> None:
        if e["event"] == "actors_ready":
            self.pids = {a["index"]: a["pid"] for a in e["actors"]}
        elif e["event"] == "plan":
            dss = [ActivationDataset(self.url, **OPTS) for _ in range(2)]
            self.threads = [threading.Thread(target=self._guard, args=(f, ds), daemon=True)
                            for f, ds in zip((self._follow_a, self._follow_b), dss)]
            for t in self.threads:
                t.start()
            for ds in dss:   # both looked at the store before any unit is dispatched
                wait_until(lambda ds=ds: ds.follow_line is not None and ds.follow_line.polls > 0
                           or self.errors, 120, "the follower's first look at the store")
                self.first_poll_committed.append(ds.follow_line.state.committed)
        elif e["event"] == "unit_done" and self.killed is None:
            busy = [a for a, n in sorted(e["in_flight"].items()) if n > 0]
            self.killed = busy[0] if busy else 1 - e["actor"]
            os.kill(self.pids[self.killed], signal.SIGKILL)

    def _guard(self, f, ds) -> None:
        try:
            f(ds)
        except BaseException as err:  # noqa: BLE001 -- asserted by the test
            self.errors.append(err)

    def _follow_a(self, ds) -> None:
        self.a = [_take(b) for b in ds]

    def _follow_b(self, ds) -> None:
        it = iter(ds)
        self.b_head = [_take(next(it)) for _ in range(HEAD)]
        self.state = ds.state_dict()
        it.close()
        resumed = ActivationDataset(self.url, **OPTS)
        resumed.load_state_dict(self.state)
        self.b_rest = [_take(b) for b in resumed]


def _cat(batches: list[dict]) -> dict:
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@pytest.fixture(scope="module")
def followed(ray_cluster, tiny_llama, corpus, tmp_path_factory):
    url = str(tmp_path_factory.mktemp("follow") / "store")
    cfg = make_cfg(tiny_llama, url, corpus)
    f = Followers(url)
    summary = run(cfg, on_event=f)
    for t in f.threads:   # they end by themselves once they see the finalize
        t.join(timeout=300)
    assert not any(t.is_alive() for t in f.threads), "a follower did not end at finalize"
    ref = ActivationDataset(url, batch_size=512, shuffle=False, return_meta=True)
    return f, summary, _cat([_take(b) for b in ref])


def test_follower_started_before_the_first_commit_yields_the_final_store_once(followed):
    f, summary, ref = followed
    assert not f.errors, f.errors
    assert f.first_poll_committed == [0, 0]
    assert f.killed is not None and summary["actor_restarts"] >= 1, summary
    got = _cat(f.a)
    n = len(ref["row"])
    assert n == summary["units"] * 256 and np.array_equal(np.sort(got["row"]), np.arange(n))
    order = np.argsort(got["row"])
    for k in ("doc_id", "position", "acts"):   # identical bytes, row for row
        assert np.array_equal(got[k][order], ref[k]), k
    pairs = lambda d: sorted(zip(d["doc_id"].tolist(), d["position"].tolist()))  # noqa: E731
    assert pairs(got) == pairs(ref)


def test_resumed_follower_yields_exactly_the_rows_not_yet_yielded(followed):
    f, _, ref = followed
    assert not f.errors, f.errors
    assert f.state is not None and f.state["batches"] == HEAD
    b = _cat(f.b_head + f.b_rest)
    a = _cat(f.a)
    # the order is the plan's, not the commits' timing: the same stream as follower A
    assert np.array_equal(b["row"], a["row"]) and np.array_equal(b["acts"], a["acts"])
    assert len(b["row"]) == len(ref["row"])
