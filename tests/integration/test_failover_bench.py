"""bench/failover_bench.py at its smallest: one round (primary, standby, target; a crash and a promotion) ends with
the marker seen on both targets, and the report names what each side did after the crash (our backoff's waits, the
native worker's failed start and its restart).

Marked ``bench`` and so left out of a plain ``pytest`` run (pyproject's ``addopts``): it needs PostgreSQL 18 and
takes ~30 s. Run it with ``pytest -m bench tests/integration/test_failover_bench.py``. No timings are asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from applier.testing.cluster import ClusterError, find_binaries

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "failover_bench.py"

pytestmark = pytest.mark.bench


def _bench() -> ModuleType:
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("failover_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_one_round_reaches_the_marker_on_both_sides(tmp_path: Path) -> None:
    try:
        if find_binaries("18").major < 18:
            pytest.skip("needs PostgreSQL 18")
    except ClusterError:
        pytest.skip("needs PostgreSQL 18")
    out = tmp_path / "report.md"
    assert _bench().main(["--rounds", "1", "--warm", "0.5", "--out", str(out)]) == 0
    report = out.read_text()
    assert "| 1 | " in report and "**median**" in report, report
    assert "ours" in report and "retry in" in report, report
    assert "native" in report and "worker started" in report, report
