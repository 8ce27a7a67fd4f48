"""bench/live_bench.py's pure lag bookkeeping (pairing start and end times by id, the summaries, a saved run of
JSON version 1 still rendering, labelled as polled) and how it stops a run whose `applier run` ignores SIGTERM."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import live_bench as lb  # noqa: E402

from applier.testing import wait_until  # noqa: E402


def test_paired_lags_follow_the_start_ids_in_order_and_skip_unmatched() -> None:
    start = {3: 10.3, 1: 10.1, 2: 10.2}
    end = {1: 10.15, 3: 10.31, 9: 11.0}
    pairs = lb.paired_lags(start, end)
    assert [s for s, _ in pairs] == [10.1, 10.3]
    assert [lag for _, lag in pairs] == pytest.approx([0.05, 0.01])


def test_summary() -> None:
    s = lb.summary([0.001, 0.002, 0.003, 0.010])
    assert s["p50"] == pytest.approx(0.0025)
    assert s["max"] == 0.010
    assert 0.003 < s["p99"] < 0.010
    assert all(math.isnan(v) for v in lb.summary([]).values())


def test_a_version_1_run_renders_as_polled() -> None:
    old = {"workload": "2pc", "rate": 400, "side": "ours", "ok": True, "pgbench": {"tps": 399.0},
           "lag": {"p50": 0.007, "p99": 0.016, "max": 0.03}, "prepare_lag": {"p50": 0.007, "p99": 0.016},
           "prepares_published": 10, "prepares_seen": 10, "bounded": True}  # fmt: skip
    run = lb.SideRun(**old)
    assert run.lag_method == run.prepare_method == "poll 10 ms"
    out = lb.render([run])
    assert "7.0 / 16.0 / 30.0" in out
    assert "Commit lag: poll 10 ms." in out and "Prepare lag seen by: poll 10 ms." in out
    assert "Prepare poll cost" not in out


def test_an_applier_run_that_ignores_sigterm_is_killed_whole(tmp_path: Path) -> None:
    """A wrapper (py-spy, strace) whose ``applier run`` below it does not stop: every process of the tree goes,
    not only the wrapper (killing py-spy alone once left the worker running into the next run)."""
    pids = tmp_path / "pids"
    child = "import time; time.sleep(600)"
    cli = (  # stands in for `python -m applier.cli ... run`: ignores SIGTERM, has a worker below it
        "import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        f"w = subprocess.Popen([sys.executable, '-c', {child!r}]);"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{w.pid}}'); time.sleep(600)"
    )
    # the wrapper's own command line must not name applier.cli (py-spy's does not: _is_cli leaves it out)
    wrapper = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys; subprocess.run([sys.executable, '-c', os.environ['CLI'], "
         "'applier' + '.cli'])"], env={**os.environ, "CLI": cli},
    )  # fmt: skip
    wait_until(
        lambda: pids.exists() and len(pids.read_text().split()) == 2, timeout=30, what="the tree to start"
    )
    below = [int(p) for p in pids.read_text().split()]
    lb._stop_ours(wrapper, timeout=0.5)  # noqa: SLF001
    assert wrapper.poll() is not None
    wait_until(lambda: not any(_running(p) for p in below), timeout=10, what=f"{below} to be gone")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
