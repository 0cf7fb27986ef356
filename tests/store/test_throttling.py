"""A throttled request costs a retry, not a unit (store/storage/retries.py).

S3 answers 503 SlowDown when one prefix takes more requests than it can; it documents those as
not performed, so a retry is safe, create-once commit markers included. Before, a storm of them
used up a write's five attempts and the unit was captured again, which at many actors feeds the
storm. Here: throttled answers never use up attempts, every request of a process waits out the
same backoff (`Throttle`), the process counts them, and a commit marker whose first PUT was lost
(not throttled) but performed is recognised as its own on the retry.
"""

from __future__ import annotations

import errno
import threading

import pytest

from harvest.store.storage.retries import (RetryBudgetExceeded, Throttle, is_throttle,
                                           with_retries)


def slowdown() -> OSError:
    return OSError(errno.EBUSY, "Please reduce your request rate.")   # what s3fs raises for 503


class Clock:
    """A fake monotonic clock that `sleep` advances: backoffs are checked, never waited."""

    def __init__(self):
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def flaky(n: int, exc):
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] <= n:
            raise exc()
        return "done"
    return fn, calls


def test_what_counts_as_throttled():
    assert is_throttle(slowdown())
    assert is_throttle(RuntimeError("An error occurred (SlowDown) when calling the PutObject "
                                    "operation: Please reduce your request rate."))
    assert is_throttle(type("ThrottlingException", (Exception,), {})("Rate exceeded"))
    assert not is_throttle(ConnectionError("connection reset"))
    assert not is_throttle(PermissionError("AccessDenied"))
    # words in a key are not the server's answer (a test named "...-503-slowdown-..." once
    # made a missing object look throttled for 15 minutes)
    assert not is_throttle(FileNotFoundError("bucket/a-storm-of-503-slowdown-throttling/zarr.json"))
    assert not is_throttle(OSError(errno.EIO, "reading bucket/slowdown/too-many-requests"))


def test_a_storm_longer_than_the_attempts_is_waited_out_not_failed():
    clock = Clock()
    gate = Throttle(clock=clock)
    fn, calls = flaky(40, slowdown)   # 8x the attempts
    assert with_retries(fn, "commit", attempts=5, sleep=clock.sleep, throttle=gate) == "done"
    assert calls["n"] == 41 and gate.throttled == 40
    assert gate.figures()["throttled_requests"] == 40
    assert max(clock.slept) <= gate.max_delay and sum(clock.slept) > 0
    # transient errors of another kind still use up the attempts
    fn, calls = flaky(10, lambda: ConnectionError("reset"))
    with pytest.raises(ConnectionError):
        with_retries(fn, "commit", attempts=5, sleep=clock.sleep, throttle=Throttle(clock=clock))
    assert calls["n"] == 5


def test_the_writers_of_one_process_back_off_together():
    """Thread A is throttled; thread B, which was never throttled, waits out A's backoff before
    its next request instead of adding to the storm."""
    clock = Clock()
    gate = Throttle(clock=clock, base_delay=4.0)
    fn, _ = flaky(1, slowdown)
    with_retries(fn, "a", sleep=clock.sleep, throttle=gate)   # one throttled answer
    assert gate.throttled == 1 and clock.slept
    waited_before = list(clock.slept)
    gate.hit()                     # A throttled again: the gate closes for a while
    reopens = gate._until
    assert reopens > clock.t
    b_started = []
    t = threading.Thread(target=lambda: with_retries(
        lambda: b_started.append(clock.t), "b", sleep=clock.sleep, throttle=gate))
    t.start()
    t.join(10)
    assert b_started and b_started[0] >= reopens - 1e-9     # B waited for A's backoff
    assert len(clock.slept) == len(waited_before) + 1


def test_throttling_past_its_budget_fails_with_the_fix(monkeypatch):
    from harvest.store.storage import retries

    clock = Clock()
    monkeypatch.setattr(retries.time, "monotonic", clock)
    monkeypatch.setattr(retries, "THROTTLE_BUDGET_S", 60.0)
    fn, _ = flaky(10 ** 6, slowdown)
    with pytest.raises(RetryBudgetExceeded, match="kept throttling.*fewer actors"):
        with_retries(fn, "commit", sleep=clock.sleep, throttle=Throttle(clock=clock))
    assert clock.t <= 60.0


class _FakeFS:
    """An s3fs stand-in for S3Storage.create_once: the first PUT is performed but its answer
    lost (a timeout), or throttled (not performed)."""

    def __init__(self, first: str):
        self.objects: dict = {}
        self.first, self.puts = first, 0

    def pipe_file(self, path, data, mode=None):
        self.puts += 1
        if self.puts == 1 and self.first == "throttled":
            raise slowdown()
        if path in self.objects:
            raise FileExistsError(path)
        self.objects[path] = bytes(data)
        if self.puts == 1 and self.first == "lost":
            raise TimeoutError("read timeout")

    def cat_file(self, path):
        return self.objects[path]

    def invalidate_cache(self, path=None):
        pass

    def exists(self, path):
        return path in self.objects


@pytest.mark.parametrize("first", ["lost", "throttled"])
def test_a_commit_marker_retried_after_a_lost_or_throttled_answer_is_ours(first, monkeypatch):
    from harvest.store.storage.s3 import S3Storage

    st = S3Storage.__new__(S3Storage)
    st.url, st.protocol, st.root, st.storage_options = "s3://b/s", "s3", "b/s", {}
    st.budget_s = None
    st.fs = _FakeFS(first)
    monkeypatch.setattr(S3Storage, "honours_if_none_match", lambda self: True)
    assert st.create_once("_harvest/commits/unit-00000000.0-8.json", b'{"attempt":"a1"}') is True
    assert st.fs.puts == 2
    # another writer's marker already there: not ours, whatever the retries
    assert st.create_once("_harvest/commits/unit-00000000.0-8.json", b'{"attempt":"b2"}') is False
