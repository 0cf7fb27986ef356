"""Waiting for a state instead of sleeping for it: a test that sleeps N seconds and hopes the state
arrived fails under load (or wastes N seconds when idle); polling the real condition with a
deadline does neither, and its failure says what never happened."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout`
    seconds with `what` (the state waited for) and the predicate's last value. An exception in
    the predicate (e.g. an assert that the process being watched is still alive) propagates."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} "
                                 f"(last: {value!r})")
        time.sleep(interval)


def wait_until_stable(read: Callable[[], T], quiet: float, timeout: float, what: str,
                      interval: float = 0.1) -> T:
    """Poll `read` until its value has not changed for `quiet` seconds (e.g. a directory nobody
    writes to any more); returns that value, or fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while True:
        time.sleep(interval)
        now = read()
        t = time.monotonic()
        if now != last:
            last, since = now, t
        elif t - since >= quiet:
            return now
        if t >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} "
                                 f"(still changing)")
