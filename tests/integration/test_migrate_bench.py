"""bench/migrate_bench.py at a tiny scale: every installed competitor produces a verified result (ours also under
pgbench writes, with the write downtime measured), our column says why it is missing when ``applier migrate start
--cutover`` is not usable, and the verification catches a copy that lost a row, an index or a sequence value.

Marked ``bench`` and so left out of a plain ``pytest`` run (pyproject's ``addopts``): it starts PostgreSQL 15
servers, runs every tool once (~1 minute) and measures nothing that CI needs. Run it with
``pytest -m bench tests/integration/test_migrate_bench.py``. No timings are asserted."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from applier.testing.cluster import DEBIAN_PG15_BINDIR, PostgresCluster, find_binaries

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "migrate_bench.py"

pytestmark = [
    pytest.mark.bench,
    pytest.mark.skipif(
        not (DEBIAN_PG15_BINDIR / "pgbench").exists(), reason="needs Debian's PostgreSQL 15 (postgresql-15)"
    ),
]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The bench script as a module (it is not in a package), with its helper ``_common`` importable."""
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("migrate_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def pg15() -> Iterator[PostgresCluster]:
    cluster = PostgresCluster(find_binaries("15"), name="mbench-test").start()
    try:
        yield cluster
    finally:
        cluster.destroy()


def test_bench_runs_every_installed_tool_and_verifies_it(tmp_path: Path) -> None:
    tools = ["dump_restore", "dump_restore_z0", "native", "ours", "ours_load"]
    if shutil.which("pgcopydb"):
        tools.insert(0, "pgcopydb")
    out = tmp_path / "r.json"
    res = subprocess.run(
        [sys.executable, str(BENCH), "--scale", "0.005", "--small-tables", "3", "--repeat", "1",
         "--tools", ",".join(tools), "--json", str(out), "--markdown", str(tmp_path / "r.md")],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert out.exists(), res.stdout + res.stderr
    data = json.loads(out.read_text())
    by_tool = {s["tool"]: s for s in data["summaries"]}
    assert set(by_tool) == set(tools)
    for tool in tools:
        s = by_tool[tool]
        if tool.startswith("ours") and s["unavailable"]:
            # this tree has no `applier migrate start --cutover` yet: the report must say so, not fail silently
            assert "migrate" in s["unavailable"]
            assert "not run: " in (tmp_path / "r.md").read_text()
            continue
        assert s["failed"] == 0 and s["median_s"] is not None, (tool, s, res.stderr[-3000:])
        assert s["peak_pss_mb"] > 0 and s["peak_rss_mb"] >= s["peak_pss_mb"]
        # the CPU it used: its own processes and both servers (the target always works)
        assert s["cpu"]["target"] > 0 and s["cpu"]["total"] >= s["cpu"]["tool"] + s["cpu"]["target"] - 0.2, s
    if not by_tool["ours_load"]["unavailable"]:
        # pgbench wrote to ours' source until the fence; the target equals the source as the writes left it
        (writes,) = by_tool["ours_load"]["writes"]
        assert writes["transactions"] > 0 and writes["writers_downtime_s"] >= 0, writes
        assert "under writes" in (tmp_path / "r.md").read_text()
    runs = [r for r in data["results"] if r["tool"] in tools]
    assert all(r["verified"] for r in runs), runs
    # 5 pgbench/big tables (pgbench_* and big) + 3 small ones, all counted on the source
    assert len(data["expected"]["rows"]) == 8
    assert data["expected"]["indexes"]["public.big"] == 4  # primary key + three secondary, one GIN
    # the critical-path floor: the 2 largest tables measured alone, the slowest is the floor; ours against it
    floor = data["floor"]
    assert len(floor["tables"]) == 2 and floor["seconds"] == max(t["seconds"] for t in floor["tables"]) > 0
    assert all(len(t["indexes"]) >= 1 for t in floor["tables"]), floor
    report = (tmp_path / "r.md").read_text()
    assert "CPU s: tool + source + target" in report
    assert "Critical-path floor" in report and (by_tool["ours"]["unavailable"] or "the floor:" in report)
    assert res.returncode == (1 if any(s["failed"] for s in data["summaries"]) else 0), res.stderr[-3000:]


def test_verification_catches_a_lost_row_index_and_sequence_value(
    bench: ModuleType, pg15: PostgresCluster
) -> None:
    ds = bench.Dataset.scaled(0.005, 2)
    bench.build_dataset(pg15, ds, str(DEBIAN_PG15_BINDIR))
    pg15.execute(f"CREATE DATABASE copy TEMPLATE {bench.SOURCE_DB}")
    with pg15.connect(bench.SOURCE_DB) as src, pg15.connect("copy") as copy:
        schemas = bench.user_schemas(src)
        expected = bench.snapshot(src, schemas)
        assert bench.differences(expected, bench.snapshot(copy, schemas)) == []
        copy.execute("DELETE FROM small_001 WHERE id = 3")
        copy.execute("DROP INDEX big_doc")
        copy.execute("SELECT setval('small_000_id_seq', 1)")
        copy.execute("ALTER TABLE pgbench_accounts DROP CONSTRAINT pgbench_accounts_bid_fkey")
        found = bench.differences(expected, bench.snapshot(copy, schemas))
    assert any(d.startswith("rows public.small_001:") for d in found), found
    assert any(d.startswith("indexes public.big: source 4, target 3") for d in found), found
    assert any(d.startswith("sequences public.small_000_id_seq:") for d in found), found
    assert any(d.startswith("constraints f:") for d in found), found
    assert len(found) == 4, found
