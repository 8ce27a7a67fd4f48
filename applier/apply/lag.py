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

**Cost.** :meth:`LagWindow.add` runs once per local commit, on the apply loop, and the summary and the histogram
figures are taken from it about once a second, also on the loop. Keeping every sample and sorting the window (up to
50,000 at high rates) for each summary, and observing the histogram once per sample, stalled the loop for several
milliseconds every second or two under a steady load: exactly the tail a live-lag figure exists to show. So the
window counts samples in fine buckets (each ``BUCKET_RATIO`` wider than the one before: a percentile is within
1.1 % of the sample it stands for; the max is exact) per second of confirmation, and the histogram's buckets are
counted as samples come and handed over as counts (:class:`HistogramDelta`).

The two clocks are the publisher's and the target's: a clock difference between the hosts adds to (or, if the
target's clock is behind, hides) lag. A negative difference is counted as 0.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

#: 2000-01-01 00:00:00 UTC (PostgreSQL's epoch) as a Unix timestamp
PG_EPOCH_UNIX = 946_684_800
#: ``applier status`` summarises the samples of this many seconds (counted in whole seconds of confirmation)
WINDOW_S = 60.0
#: the window's buckets: each this much wider than the one before (a percentile reads within 1.1 % of a sample)
BUCKET_RATIO = 2 ** (1 / 32)
#: lags below this share the window's first bucket (read as 0)
MIN_LAG_S = 1e-5
_LOG_RATIO = math.log(BUCKET_RATIO)


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


def bucket_of(lag: float) -> int:
    """The window's bucket of ``lag`` seconds: 0 below ``MIN_LAG_S``, then one per ``BUCKET_RATIO``."""
    return 0 if lag < MIN_LAG_S else int(math.log(lag / MIN_LAG_S) / _LOG_RATIO) + 1


def bucket_value(index: int) -> float:
    """What a bucket reads as: the geometric middle of its bounds (0 for the first)."""
    return 0.0 if index == 0 else MIN_LAG_S * BUCKET_RATIO ** (index - 0.5)


@dataclass(slots=True)
class HistogramDelta:
    """Samples of one kind since the last hand-over, counted in the Prometheus histogram's buckets: ``counts[i]``
    samples fell at or below ``bounds[i]`` and above ``bounds[i - 1]`` (the last: above every bound)."""

    counts: list[int]
    total: float = 0.0

    @property
    def samples(self) -> int:
        return sum(self.counts)


@dataclass(slots=True)
class _Second:
    """The samples confirmed within one second: counts per window bucket, and the exact max."""

    at: int
    counts: dict[int, int] = field(default_factory=dict)
    max: float = 0.0


class LagWindow:
    """Recent lag samples, counted (see the module docstring); :meth:`add` is cheap (it runs once per local
    commit), and so are :meth:`summary` and :meth:`take_new` (they cost the number of distinct buckets)."""

    def __init__(self, window_s: float = WINDOW_S, histogram_bounds: Sequence[float] = ()) -> None:
        self.window_s = window_s
        self.bounds = tuple(histogram_bounds)
        self._seconds: deque[_Second] = deque()
        self._counts: dict[int, int] = {}  # the window's buckets over every second kept
        self._new: dict[str, HistogramDelta] = {}  # not yet handed to the histogram
        self.last: tuple[str, float] | None = None
        self.added = 0  # ever, so that a writer can tell whether anything changed

    def add(self, kind: str, remote_ts_us: int, now: float) -> None:
        """One local commit/prepare confirmed at ``now`` (Unix seconds) for a remote one stamped ``remote_ts_us``."""
        if not remote_ts_us:
            return
        lag = max(0.0, now - pg_time_to_unix(remote_ts_us))
        second = int(now)
        seconds = self._seconds
        if not seconds or seconds[-1].at != second:
            seconds.append(_Second(second))
        current = seconds[-1]
        index = bucket_of(lag)
        current.counts[index] = current.counts.get(index, 0) + 1
        self._counts[index] = self._counts.get(index, 0) + 1
        if lag > current.max:
            current.max = lag
        delta = self._new.get(kind)
        if delta is None:
            delta = self._new[kind] = HistogramDelta([0] * (len(self.bounds) + 1))
        delta.counts[bisect.bisect_left(self.bounds, lag)] += 1  # as Histogram.observe: lag <= bound
        delta.total += lag
        self.last = (kind, lag)
        self.added += 1

    def take_new(self) -> dict[str, HistogramDelta]:
        """The samples added since the last call, by kind, for the histogram."""
        new, self._new = self._new, {}
        return new

    def summary(self, now: float) -> LagSummary | None:
        """Last, p50, p99 and max of the samples confirmed within the last ``window_s`` seconds (whole seconds);
        None before the first sample.

        When nothing was applied within the window, the percentiles are of the last sample alone: the subscription
        is idle, and its last transaction's lag is the most recent figure there is."""
        if self.last is None:
            return None
        self._expire(now)
        kind, last = self.last
        if not self._seconds:
            return LagSummary(last, kind, last, last, last, 1, self.window_s)
        top = max(s.max for s in self._seconds)
        ordered = sorted(self._counts.items())
        n = sum(count for _, count in ordered)
        p50, p99 = (min(top, _rank(ordered, n, q)) for q in (50, 99))
        return LagSummary(last, kind, p50, p99, top, n, self.window_s)

    def _expire(self, now: float) -> None:
        seconds, counts = self._seconds, self._counts
        while seconds and seconds[0].at < now - self.window_s:
            for index, count in seconds.popleft().counts.items():
                left = counts[index] - count
                if left:
                    counts[index] = left
                else:
                    del counts[index]


def _rank(ordered: list[tuple[int, int]], n: int, q: float) -> float:
    """Nearest rank over (bucket, count) pairs in bucket order: what the bucket holding that sample reads as."""
    rank = max(1, math.ceil(q / 100 * n))
    seen = 0
    for index, count in ordered:
        seen += count
        if seen >= rank:
            return bucket_value(index)
    return bucket_value(ordered[-1][0])
