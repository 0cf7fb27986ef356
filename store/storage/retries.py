"""Retries with backoff that classify errors: a wrong password fails at once, a dropped
connection is retried, and an endpoint that never answers fails within a known time."""

from __future__ import annotations

import errno
import logging
import random
import re
import time
from typing import Callable, TypeVar, TypedDict

from ..errors import StoreAccessError

log = logging.getLogger(__name__)
T = TypeVar("T")

_PERMANENT = (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
              FileExistsError, ValueError, TypeError, KeyError, NotImplementedError)
# botocore's, by name (botocore is imported only with s3fs): no retry finds credentials
_PERMANENT_NAMES = ("NoCredentialsError", "PartialCredentialsError")


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: dropped connections, timeouts, 5xx/SlowDown. Auth and 404 are not."""
    if isinstance(exc, StoreAccessError):
        return False
    if isinstance(exc, _PERMANENT) or type(exc).__name__ in _PERMANENT_NAMES:
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.EACCES, errno.ENOENT,
                                                  errno.EEXIST, errno.EPERM, errno.ENOSPC,
                                                  errno.EROFS):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return True
    mod = type(exc).__module__
    return mod.startswith(("botocore", "aiohttp", "urllib3", "requests"))


class RetryBudgetExceeded(TimeoutError):
    """An operation's retries ran past its time budget (store.retry_budget_s)."""


# What a server says when it throttles: S3's 503 SlowDown (s3fs raises OSError EBUSY for it, for
# 503 ServiceUnavailable and for 409 OperationAborted) and the error codes other S3-compatible
# servers and botocore use. S3 documents a throttled request as not performed, so retrying it is
# safe, create-once commit markers included (a conditional PUT that was not performed created
# nothing). Matched on errno and error codes, never on free text: a key can hold any word.
THROTTLE_CODES = ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                  "TooManyRequests", "RequestThrottled", "ServiceUnavailable", "503", "429")
_BOTO_CODE = re.compile(r"^An error occurred \(([A-Za-z0-9]+)\) when calling ")
# How long one operation keeps retrying throttled requests (the process backing off together)
# before it fails: a storm that S3 takes minutes to absorb (it splits a hot prefix) must cost
# waiting, not re-captured units.
THROTTLE_BUDGET_S = 900.0


def is_throttle(exc: BaseException) -> bool:
    """The server refused the request for its rate (not performed: safe to retry)."""
    if isinstance(exc, _PERMANENT) or isinstance(exc, StoreAccessError):
        return False
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
        return True
    code = ((getattr(exc, "response", None) or {}).get("Error") or {}).get("Code")
    if code is None:
        m = _BOTO_CODE.match(str(exc))
        code = m.group(1) if m else None
    return code in THROTTLE_CODES or type(exc).__name__ in THROTTLE_CODES


class ThrottleFigures(TypedDict):
    """What throttling cost this process (the run summary's per-actor figures)."""

    throttled_requests: int
    throttle_wait_s: float


class Throttle:
    """One per process: when any request is throttled, every request of the process waits out
    the same backoff before its next try, so the writers of one process slow down together
    instead of each retrying into the storm. The backoff doubles with each throttled answer
    (full jitter, up to `max_delay`) and halves with each success."""

    def __init__(self, base_delay: float = 0.5, max_delay: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        import threading

        self.base_delay, self.max_delay, self.clock = base_delay, max_delay, clock
        self._lock = threading.Lock()
        self._until = 0.0
        self._level = 0
        self.throttled = 0   # throttled answers this process got (the run summary reports them)
        self.waited_s = 0.0  # seconds requests of this process spent waiting for the gate

    def wait(self, sleep: Callable[[float], None]) -> None:
        t = self._until - self.clock()
        if t > 0:
            with self._lock:
                self.waited_s += t
            sleep(t)

    def hit(self) -> float:
        """A throttled answer: the process's gate closes for a while; returns the delay."""
        with self._lock:
            self.throttled += 1
            self._level = min(self._level + 1, 16)
            delay = min(self.max_delay, self.base_delay * (2 ** (self._level - 1)))
            delay *= 0.5 + random.random() / 2
            self._until = max(self._until, self.clock() + delay)
            return delay

    def ok(self) -> None:
        if self._level:
            with self._lock:
                self._level = max(0, self._level - 1)

    def figures(self) -> ThrottleFigures:
        return ThrottleFigures(throttled_requests=self.throttled, throttle_wait_s=round(self.waited_s, 3))


THROTTLE = Throttle()


def with_retries(fn: Callable[[], T], what: str, *, attempts: int = 5, base_delay: float = 0.5,
                 max_delay: float = 8.0, sleep: Callable[[float], None] = time.sleep,
                 budget_s: float | None = None, throttle: "Throttle | None" = None) -> T:
    """Call `fn`, retrying transient errors with full-jitter exponential backoff.

    Permanent errors propagate at once; after `attempts` transient failures the last one does,
    and so does the one after which the next try would start past `budget_s` (as
    RetryBudgetExceeded, naming the budget: an endpoint that never answers must fail in a known
    time, not after attempts x botocore retries x s3fs retries x read timeouts).

    Throttled answers (`is_throttle`) are different: the server is up and did nothing, so they
    do not use up `attempts`; the process's gate (`Throttle`) backs every request off together,
    for up to THROTTLE_BUDGET_S (or `budget_s` if longer) in all.
    """
    gate = THROTTLE if throttle is None else throttle
    t0 = time.monotonic()
    i = 0
    while True:
        gate.wait(sleep)
        try:
            out = fn()
            gate.ok()
            return out
        except BaseException as e:  # noqa: BLE001 -- classified below
            if is_throttle(e):
                spent = time.monotonic() - t0
                limit = max(THROTTLE_BUDGET_S, budget_s or 0.0)
                delay = gate.hit()
                if spent + delay > limit:
                    raise RetryBudgetExceeded(
                        f"{what}: the storage kept throttling for {spent:.0f} s ({type(e).__name__}: "
                        f"{e}); it is over its request rate: run fewer actors per store, or raise "
                        "store.shard_rows for fewer, larger objects (harvest plan)") from e
                if gate.throttled in (1, 10, 100) or gate.throttled % 1000 == 0:
                    log.warning("%s throttled by the storage (%s); this process backs off %.1f s "
                                "(%d throttled requests so far)", what, e, delay, gate.throttled)
                continue
            i += 1
            if not is_transient(e) or i >= attempts:
                raise
            delay = min(max_delay, base_delay * (2 ** (i - 1))) * (0.5 + random.random() / 2)
            spent = time.monotonic() - t0
            if budget_s is not None and spent + delay > budget_s:
                raise RetryBudgetExceeded(
                    f"{what}: no success within the retry budget of {budget_s:g} s ({i} "
                    f"tries over {spent:.1f} s; last error {type(e).__name__}: {e}); raise "
                    "store.retry_budget_s / store.timeout_s if the storage is just slow") from e
            log.warning("%s failed (%s), retry %d/%d in %.1fs", what, type(e).__name__, i,
                        attempts - 1, delay)
            sleep(delay)


__all__ = ["is_transient", "is_throttle", "Throttle", "THROTTLE", "RetryBudgetExceeded",
           "with_retries"]
