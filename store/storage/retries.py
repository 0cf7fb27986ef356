"""Retries with backoff that classify errors: a wrong password fails at once, a dropped
connection is retried, and an endpoint that never answers fails within a known time."""

from __future__ import annotations

import errno
import logging
import random
import time
from typing import Callable, TypeVar

from harvest.store.errors import StoreAccessError

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


def with_retries(fn: Callable[[], T], what: str, *, attempts: int = 5, base_delay: float = 0.5,
                 max_delay: float = 8.0, sleep: Callable[[float], None] = time.sleep,
                 budget_s: float | None = None) -> T:
    """Call `fn`, retrying transient errors with full-jitter exponential backoff.

    Permanent errors propagate at once; after `attempts` transient failures the last one does,
    and so does the one after which the next try would start past `budget_s` (as
    RetryBudgetExceeded, naming the budget: an endpoint that never answers must fail in a known
    time, not after attempts x botocore retries x s3fs retries x read timeouts).
    """
    t0 = time.monotonic()
    for i in range(attempts):
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 -- classified below
            if not is_transient(e) or i == attempts - 1:
                raise
            delay = min(max_delay, base_delay * (2 ** i)) * (0.5 + random.random() / 2)
            spent = time.monotonic() - t0
            if budget_s is not None and spent + delay > budget_s:
                raise RetryBudgetExceeded(
                    f"{what}: no success within the retry budget of {budget_s:g} s ({i + 1} "
                    f"tries over {spent:.1f} s; last error {type(e).__name__}: {e}); raise "
                    "store.retry_budget_s / store.timeout_s if the storage is just slow") from e
            log.warning("%s failed (%s), retry %d/%d in %.1fs", what, type(e).__name__, i + 1,
                        attempts - 1, delay)
            sleep(delay)
    raise AssertionError("unreachable")


__all__ = ["is_transient", "RetryBudgetExceeded", "with_retries"]
