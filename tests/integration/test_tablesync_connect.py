"""The same copy job through Spark Connect: a Connect server started from the pyspark package (pyspark 4 bundles
``spark-connect_2.13-<version>.jar`` in ``pyspark/jars``, so ``sbin/start-connect-server.sh`` needs no
``--packages`` download), on a free localhost port, with ``SPARK_REMOTE=sc://127.0.0.1:<port>``.

The Python client needs the ``connect`` extra (grpcio, grpcio-status, googleapis-common-protos, zstandard).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from applier.testing import table_digest, wait_until
from applier.testing.cluster import free_port
from tablesync import job as spark_job
from tablesync import run_initial_copy
from tablesync.testing import subscribe

pytestmark = [pytest.mark.spark, pytest.mark.slow]

pytest.importorskip("grpc", reason="Spark Connect's client needs grpcio: pip install 'pyspark[connect]'")


def _sbin() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "sbin"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect server on localhost, running tasks with this interpreter; stopped afterwards."""
    import pyspark
    from pyspark import SparkContext

    assert SparkContext._active_spark_context is None, "a classic session would shadow SPARK_REMOTE"
    port = free_port()
    logdir = tmp_path_factory.mktemp("spark-connect")
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(Path(pyspark.__file__).parent), SPARK_LOG_DIR=str(logdir), SPARK_PID_DIR=str(logdir),
        SPARK_IDENT_STRING=f"applier-test-{port}", PYSPARK_PYTHON=sys.executable,
    )  # fmt: skip
    env.pop("SPARK_REMOTE", None)
    args = ["--master", "local[2,4]", "--conf", f"spark.connect.grpc.binding.port={port}",
            "--conf", "spark.connect.grpc.binding.address=127.0.0.1", "--conf", "spark.ui.enabled=false",
            "--driver-java-options", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"]  # fmt: skip
    subprocess.run(["bash", str(_sbin() / "start-connect-server.sh"), *args], env=env, check=True)
    try:

        def up() -> bool:
            logs = "".join(p.read_text(errors="replace") for p in logdir.glob("*.out"))
            if "Exception" in logs and "started at" not in logs and not list(logdir.glob("*.pid")):
                raise AssertionError(logs[-3000:])
            return _port_open(port)

        wait_until(up, timeout=180, interval=0.5, what="the Spark Connect server to listen")
        yield f"sc://127.0.0.1:{port}"
    finally:
        subprocess.run(["bash", str(_sbin() / "stop-connect-server.sh")], env=env, check=False)


def test_copy_runs_through_spark_connect(pair, connect_server, monkeypatch):
    for db in (pair.publisher, pair.target):
        db.execute("CREATE TABLE c (id int PRIMARY KEY, v text, j jsonb)")
    pair.publisher.execute(
        "INSERT INTO c SELECT g, md5(g::text), jsonb_build_object('g', g) FROM generate_series(1, 30000) g"
    )
    pair.publisher.execute("CREATE PUBLICATION pub FOR TABLE c")
    subscribe(pair.target.dsn, pair.publisher.dsn, pair.name, ["public.c"])
    monkeypatch.setenv("SPARK_REMOTE", connect_server)

    result = run_initial_copy(pair.target.dsn, pair.name, progress=False, partition_bytes=256 * 1024)

    assert result.completed and result.rows == 30000 and result.tables["public.c"].partitions > 1
    assert table_digest(pair.publisher, "public.c") == table_digest(pair.target, "public.c")
    assert pair.target.scalar("SELECT srsubstate::text FROM applier.subscription_rel") == "s"
    # the process can build classic sessions again (pyspark's Connect flag was cleared with the session): the
    # session stops in the background, and a new start waits for that on the start lock, so look under it too
    with spark_job._START_LOCK:
        assert "SPARK_CONNECT_MODE_ENABLED" not in os.environ
