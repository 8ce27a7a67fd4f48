"""``applier demo`` and ``applier demo migrate`` end to end, as a newcomer runs them: a subprocess that starts its own
servers, copies, runs a live workload with prepared transactions and checks that the target equals the publisher
(source)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _demo(*args: str, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "applier.cli", "demo", "--orders", "3000", "--rate", "30", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.spark
@pytest.mark.slow
def test_demo_plain_lines_mode_ends_with_target_equal_to_publisher(tmp_path):
    res = _demo("--duration", "20", "--plain", "--capture", str(tmp_path))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "target equals publisher" in out
    assert "two-phase went p → e" in out
    lines = [line for line in res.stdout.splitlines() if line.startswith("[")]
    assert lines and "two_phase=" in lines[-1], out[-2000:]
    for table in ("orders", "order_lines", "events"):
        assert f"public.{table}: publisher" in out and "DIFFERENT" not in out
    frame = (tmp_path / "demo-live.txt").read_text()
    assert "prepared transactions" in frame and "two-phase" in frame


@pytest.mark.slow
def test_demo_migrate_cuts_over_with_target_equal_to_source():
    res = subprocess.run(
        [sys.executable, "-m", "applier.cli", "demo", "migrate", "--orders", "3000", "--rate", "30"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "target equals source: 6 tables, row by row" in out, out[-4000:]
    assert "DIFFERENT" not in out and "BEHIND" not in out
    assert "$ applier migrate start demo --source" in out and "cutover done: write downtime" in out
    assert "write downtime reported by the cutover:" in out
    assert "migration demo PASSED" in out
