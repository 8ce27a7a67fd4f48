"""How long a worker waits before it tries again after a failure (apply session or initial copy).

The native worker is restarted by the launcher every ``wal_retrieve_retry_interval`` (5 s) while it keeps failing. We
start sooner (an error someone fixes at once, a server restart, is retried in half a second) and double the wait
while the *same* thing keeps failing, up to a cap: 5 s by default, like the native restart interval; ``applier run
--max-retry-interval SECONDS`` or ``APPLIER_MAX_RETRY_INTERVAL`` sets it (a larger cap spares a publisher that a
stuck subscription would otherwise re-read every few seconds). Pure code.
"""

from __future__ import annotations

import os
import random

from applier.errors import ApplierError

#: The first wait after a failure, in seconds.
RETRY_INITIAL = 0.5
#: The default cap, in seconds: wal_retrieve_retry_interval's default.
DEFAULT_MAX_RETRY_INTERVAL = 5.0
#: The environment variable that sets the cap (``applier run --max-retry-interval`` sets it for its workers).
MAX_RETRY_ENV = "APPLIER_MAX_RETRY_INTERVAL"


class RetrySettingError(ApplierError):
    """A cap that is not a positive number of seconds."""


def parse_max_retry_interval(value: str | None) -> float:
    """The cap from ``--max-retry-interval`` / ``APPLIER_MAX_RETRY_INTERVAL``; the default when unset."""
    if value is None or not value.strip():
        return DEFAULT_MAX_RETRY_INTERVAL
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise RetrySettingError(
            f"invalid maximum retry interval {value!r}: give a positive number of seconds, e.g. 5 or 300"
        )
    return seconds


def max_retry_interval_default() -> float:
    """The cap the environment sets (``APPLIER_MAX_RETRY_INTERVAL``), else 5 s."""
    return parse_max_retry_interval(os.environ.get(MAX_RETRY_ENV))


def retry_delay(
    failures: int,
    *,
    initial: float = RETRY_INITIAL,
    cap: float = DEFAULT_MAX_RETRY_INTERVAL,
    jitter: bool = True,
) -> float:
    """The wait after the ``failures``-th failure in a row: ``initial`` doubled each time, plus up to ``initial``
    of jitter (so that several workers failing together do not retry in step), never more than ``cap``."""
    n = max(failures, 1)
    base = initial * 2.0 ** min(n - 1, 60)
    extra = random.uniform(0, initial) if jitter else 0.0  # noqa: S311 - spreading retries, not security
    return min(base + extra, cap)
