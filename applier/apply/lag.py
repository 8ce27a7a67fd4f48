"""Apply lag: from the publisher's commit (or prepare) timestamp in the message to our local commit being confirmed.

Pure: the worker hands in the remote timestamp (wire format, µs since 2000-01-01) and the local wall-clock time at
which the target confirmed the commit; this keeps the recent samples and summarises them for ``applier status``
(last, p50, p99, max over a recent window) and hands the new ones to the Prometheus histogram.

What a sample means, precisely:

* ``commit``: COMMIT (also STREAM COMMIT, and a prepared transaction whose decision arrived with it and was applied
  as one plain transaction). With group commit several remote transactions share one local commit; the sample is
  taken for the group's *last* remote transaction (the ones before it waited at most as long as the group took).
* ``prepare``: PREPARE TRANSACTION on the target (also STREAM PREPARE), against the publisher's prepare time.
* ``commit_prepared`` / ``rollback_prepared``: against the publisher's COMMIT/ROLLBACK PREPARED time.

The two clocks are the publisher's and the target's: a clock difference between the hosts adds to (or, if the
target's clock is behind, hides) lag. A negative difference is counted as 0.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

#: 2000-01-01 00:00:00 UTC (PostgreSQL's epoch) as a Unix timestamp
PG_EPOCH_UNIX = 946_684_800
#: ``applier status`` summarises the samples of this many seconds
WINDOW_S = 60.0
#: at most this many samples are kept for the window (the oldest go first at very high rates)
MAX_SAMPLES = 50_000


def pg_time_to_unix(ts_us: int) -> float:
    return ts_us / 1_000_000 + PG_EPOCH_UNIX


@dataclass(frozen=True)
class LagSummary:
    """What ``applier status`` shows: the last sample and percentiles over the window (seconds)."""

    last_s: float
    last_kind: str
    p50_s: float
    p99_s: float
    max_s: float
    samples: int
    window_s: float


def nearest_rank(ordered: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of sorted values by nearest rank: always one of the values."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class LagWindow:
    """Recent lag samples; :meth:`add` is cheap (it runs once per local commit)."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (local time, lag)
        self._new: list[tuple[str, float]] = []  # not yet handed to the histogram
        self.last: tuple[str, float] | None = None
        self.added = 0  # ever, so that a writer can tell whether anything changed

    def add(self, kind: str, remote_ts_us: int, now: float) -> None:
        """One local commit/prepare confirmed at ``now`` (Unix seconds) for a remote one stamped ``remote_ts_us``."""
        if not remote_ts_us:
            return
        lag = max(0.0, now - pg_time_to_unix(remote_ts_us))
        self._samples.append((now, lag))
        self._new.append((kind, lag))
        self.last = (kind, lag)
        self.added += 1

    def take_new(self) -> list[tuple[str, float]]:
        """The samples added since the last call, for the histogram."""
        new, self._new = self._new, []
        return new

    def summary(self, now: float) -> LagSummary | None:
        """Last, p50, p99 and max of the samples of the last ``window_s`` seconds; None before the first sample.

        When nothing was applied within the window, the percentiles are of the last sample alone: the subscription
        is idle, and its last transaction's lag is the most recent figure there is."""
        if self.last is None:
            return None
        samples = self._samples
        while len(samples) > 1 and samples[0][0] < now - self.window_s:
            samples.popleft()
        ordered = sorted(lag for _, lag in samples)
        kind, last = self.last
        return LagSummary(last, kind, nearest_rank(ordered, 50), nearest_rank(ordered, 99), ordered[-1],
                          len(ordered), self.window_s)  # fmt: skip
