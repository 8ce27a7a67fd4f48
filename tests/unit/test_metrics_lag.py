"""The apply-lag window counts its samples in buckets instead of keeping and sorting them (applier.apply.lag), and
hands the histogram counts instead of samples (applier.metrics.observe_counts): both checked here against the
exact computation they replace, on arbitrary samples."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from applier.apply.lag import (
    BUCKET_RATIO,
    MIN_LAG_S,
    PG_EPOCH_UNIX,
    HistogramDelta,
    LagWindow,
    nearest_rank,
)
from applier.metrics import APPLY_LAG_BOUNDS, observe_counts

#: a window percentile reads within half a bucket of the sample it stands for (plus float rounding at a bound)
_REL = math.sqrt(BUCKET_RATIO) - 1 + 1e-9

lags = st.one_of(
    st.floats(min_value=0.0, max_value=1e-4),
    st.floats(min_value=1e-4, max_value=5.0),
    st.floats(min_value=5.0, max_value=4000.0),
)
samples = st.lists(st.tuples(st.sampled_from(["commit", "prepare"]), lags, st.floats(0.0, 30.0)), min_size=1,
                   max_size=300)  # fmt: skip


def _pg_us(unix: float) -> int:
    return round((unix - PG_EPOCH_UNIX) * 1_000_000)


def _close(got: float, exact: float) -> bool:
    return abs(got - exact) <= max(exact * _REL, MIN_LAG_S)


@settings(max_examples=200, deadline=None)
@given(samples)
def test_the_summary_reads_as_exact_percentiles_within_half_a_bucket(
    drawn: list[tuple[str, float, float]],
) -> None:
    """Confirmed at 1000 + offset (offsets within the window): the counted summary against nearest rank over the
    exact lags the window computed from the same timestamps."""
    w = LagWindow(window_s=60.0, histogram_bounds=APPLY_LAG_BOUNDS)
    exact = []
    for kind, lag, offset in sorted(drawn, key=lambda d: d[2]):
        now = 1000.0 + offset
        w.add(kind, _pg_us(now - lag), now)
        exact.append(w.last[1])  # type: ignore[index] - the lag as the window computed it (µs stamps)
    s = w.summary(1030.0)
    assert s is not None
    ordered = sorted(exact)
    assert s.samples == len(ordered)
    assert s.max_s == ordered[-1]
    assert _close(s.p50_s, nearest_rank(ordered, 50)), (s.p50_s, nearest_rank(ordered, 50))
    assert _close(s.p99_s, nearest_rank(ordered, 99)), (s.p99_s, nearest_rank(ordered, 99))
    assert s.p50_s <= s.p99_s <= s.max_s


def test_seconds_older_than_the_window_leave_it() -> None:
    w = LagWindow(window_s=10.0)
    for i in range(30):  # one sample a second, lag i ms
        w.add("commit", _pg_us(1000.0 + i - i / 1000), 1000.0 + i)
    s = w.summary(1029.0)
    assert s is not None and s.samples == 11  # confirmed at 1019 .. 1029
    assert s.max_s == pytest.approx(0.029, abs=1e-6)  # stamps in µs
    assert _close(s.p50_s, 0.024)
    w.add("commit", _pg_us(1040.0), 1040.0)
    later = w.summary(1045.0)
    assert later is not None and later.samples == 1 and later.p99_s == 0.0


@settings(max_examples=100, deadline=None)
@given(samples)
def test_counts_reach_the_histogram_as_observe_would_put_them(drawn: list[tuple[str, float, float]]) -> None:
    registry_counts, registry_each = CollectorRegistry(), CollectorRegistry()
    counted = Histogram("lag_counted", "", ["kind"], buckets=APPLY_LAG_BOUNDS, registry=registry_counts)
    each = Histogram("lag_each", "", ["kind"], buckets=APPLY_LAG_BOUNDS, registry=registry_each)
    w = LagWindow(histogram_bounds=APPLY_LAG_BOUNDS)
    for kind, lag, offset in drawn:
        now = 1000.0 + offset
        w.add(kind, _pg_us(now - lag), now)
        each.labels(kind).observe(w.last[1])  # type: ignore[index]
    new = w.take_new()
    assert w.take_new() == {}
    for kind, delta in new.items():
        observe_counts(counted.labels(kind), delta)
    for kind in ("commit", "prepare"):
        for bound in [*APPLY_LAG_BOUNDS, math.inf]:
            le = {"kind": kind, "le": "+Inf" if bound == math.inf else str(float(bound))}
            got_count = registry_counts.get_sample_value("lag_counted_bucket", le)
            assert got_count == registry_each.get_sample_value("lag_each_bucket", le)
        got, want = (r.get_sample_value(f"{n}_sum", {"kind": kind}) for r, n in
                     ((registry_counts, "lag_counted"), (registry_each, "lag_each")))  # fmt: skip
        assert (got is None) == (want is None)
        if got is not None:
            assert got == pytest.approx(want)


def test_counts_for_another_set_of_buckets_are_refused() -> None:
    h = Histogram("lag_other", "", buckets=(0.1, 1.0), registry=CollectorRegistry())
    with pytest.raises(ValueError, match="buckets"):
        observe_counts(h, HistogramDelta([1] * (len(APPLY_LAG_BOUNDS) + 1)))
