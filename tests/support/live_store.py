"""A store "being written by a run", made with the store API alone: for the follow-mode tests.

`LiveStore` creates a small store, takes a driver-style lease (the JSON object the pipeline's
driver writes, FORMAT.md "The driver's lease"), plans its units in segments and commits them one
at a time, from a thread paced by the follower's polls (`follower_polled`): each commit waits
until the follower has looked at the store since the previous one, so the follower sees the
store grow unit by unit on any machine, without a sleep that has to be long enough.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import numpy as np

from harvest.store import create_store, lease_key
from harvest.store.commit.plan import Unit
from harvest.testing import synthetic
from tests.support.reader_stores import packed_meta
from tests.support.waiting import wait_until


def lease_record(heartbeat: float | None = None, released: bool = False, pid: int | None = None,
                 host: str = "elsewhere", boot: str | None = None, start: str | None = None) -> dict:
    return {"owner": "test", "host": host, "pid": os.getpid() if pid is None else pid, "boot": boot,
            "start": start, "name": "test-run", "identity": {}, "acquired": time.time(),
            "lease_seconds": 120.0, "heartbeat": time.time() if heartbeat is None else heartbeat,
            "released": released}


class LiveStore:
    """n_units units of `shard_rows` rows (one shard each), width `width`, one point."""

    def __init__(self, path, n_units: int = 12, shard_rows: int = 64, width: int = 8, seed: int = 0,
                 context: int = 32, lease: bool = True):
        self.n = n_units * shard_rows
        self.shard_rows = shard_rows
        self.st = create_store(str(path), points=["resid_post.0"], width=width, n_rows=self.n,
                               shard_rows=shard_rows, chunk_rows=shard_rows,
                               attrs={"config": {"packing": {"context_size": context}}})
        self.url = str(path)
        self.data = synthetic.activations((1, self.n, width), seed=seed)
        self.tok, self.doc, self.pos = packed_meta(self.n, context, 40, seed)
        self.units = [Unit(i, i * shard_rows, (i + 1) * shard_rows) for i in range(n_units)]
        self.seq = 0
        self.committed = 0
        self.error: BaseException | None = None
        self.unpaced = threading.Event()   # set: commit the rest without waiting for polls
        if lease:
            self.write_lease(lease_record())

    def write_lease(self, record: dict, gen: int = 0) -> None:
        self.st.location.write_bytes(lease_key(gen), json.dumps(record).encode())

    def plan(self, ids, final: bool = False) -> None:
        assert self.st.ledger.plans.write_segment(self.seq, [self.units[i] for i in ids], final=final)
        self.seq += 1

    def commit(self, uid: int) -> None:
        u = self.units[uid]
        synthetic.fill(self.st, self.data, units=[u.as_dict()], token_id=self.tok, doc_id=self.doc,
                       position=self.pos)

    def finish(self) -> None:
        """Finalize, then release the lease: what the driver does at the end of a run."""
        self.st.finalize({"test": True})
        self.write_lease(lease_record(released=True))

    def run_paced(self, ds, order, finish: bool = True, plan_every: int | None = None) -> threading.Thread:
        """Commit the units in `order` from a thread, each once the follower `ds` polled since
        the last; plan them first (all at once, final), or `plan_every` units a segment just
        before the first of them commits; then finish."""
        def polls() -> int:
            line = ds.follow_line
            return -1 if line is None else line.polls

        def go():
            try:
                paced()
            except BaseException as e:   # the test reads it after join()
                self.error = e

        def paced():
            if plan_every is None:
                self.plan(range(len(self.units)), final=True)
            planned = 0
            for k, uid in enumerate(order):
                seen = polls()
                if plan_every is not None:
                    while planned <= uid:
                        ids = range(planned, min(planned + plan_every, len(self.units)))
                        self.plan(ids, final=ids[-1] == len(self.units) - 1)
                        planned = ids[-1] + 1
                self.commit(uid)
                self.committed = k + 1
                if k + 1 < len(order):
                    wait_until(lambda seen=seen: polls() > seen or self.unpaced.is_set(), 60,
                               "the follower to look at the store", interval=0.005)
            if finish:
                self.finish()

        t = threading.Thread(target=go, daemon=True)
        t.start()
        return t

    def rows_of(self, uids) -> np.ndarray:
        return np.concatenate([np.arange(self.units[u].row_start, self.units[u].row_end) for u in uids])


def host_boot() -> tuple[str, str]:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return socket.gethostname(), f.read().strip()
