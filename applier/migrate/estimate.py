"""How long a cutover started now would take (``applier migrate status``'s ``cutover_estimate_seconds``).

Pure: :func:`cutover_seconds` adds up the cutover's steps from what ``status`` measured. It is an estimate of the
write downtime (fence to done) under the default ``--verify counts``:

- **fence**: ending the source's sessions, a fixed :data:`FENCE_SECONDS`;
- **catch-up**: the lag in bytes at the measured apply rate (the target's replication origin sampled over a
  moment; when nothing moved, :data:`APPLY_BYTES_PER_SECOND`), and at least the lag in seconds the source reports;
- **sequences**: :data:`SEQUENCE_SECONDS` per sequence (three small queries on two servers);
- **verify**: ``count(*)`` of every table on both servers, one after the other: table bytes at
  :data:`SCAN_BYTES_PER_SECOND`;
- **large objects**: both servers read them all once for their ``md5``: bytes at :data:`SCAN_BYTES_PER_SECOND`;
- **materialized views**: their refresh runs their queries: not estimated (their sizes count as a scan).

The rates are rough single-core figures on the 2-core machines of bench/RESULTS.md; treat the result as an order
of magnitude, like ``plan``'s estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "APPLY_BYTES_PER_SECOND",
    "FENCE_SECONDS",
    "SCAN_BYTES_PER_SECOND",
    "SEQUENCE_SECONDS",
    "Inputs",
    "cutover_seconds",
]

FENCE_SECONDS = 0.2
APPLY_BYTES_PER_SECOND = 10e6
SEQUENCE_SECONDS = 0.005
SCAN_BYTES_PER_SECOND = 300e6


@dataclass(frozen=True)
class Inputs:
    lag_bytes: int | None
    lag_seconds: float | None
    apply_bytes_per_second: float | None  # measured; None or 0 when nothing was applied while sampling
    sequences: int
    table_bytes: int
    large_object_bytes: int
    matview_bytes: int


def cutover_seconds(i: Inputs) -> dict[str, float] | None:
    """Each step's seconds and their ``total``; None when the lag cannot be told (the source is unreachable)."""
    if i.lag_bytes is None:
        return None
    rate = i.apply_bytes_per_second or APPLY_BYTES_PER_SECOND
    parts = {
        "fence": FENCE_SECONDS,
        "catch_up": max(i.lag_bytes / rate, i.lag_seconds or 0.0) if i.lag_bytes else 0.0,
        "sequences": i.sequences * SEQUENCE_SECONDS,
        "verify": 2 * i.table_bytes / SCAN_BYTES_PER_SECOND,
        "large_objects": 2 * i.large_object_bytes / SCAN_BYTES_PER_SECOND,
        "materialized_views": i.matview_bytes / SCAN_BYTES_PER_SECOND,
    }
    parts["total"] = sum(parts.values())
    return {k: round(v, 3) for k, v in parts.items()}
