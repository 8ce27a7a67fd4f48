"""The apply worker's CPU per transaction in the live regime, without the live bench's noise (issue 19).

The live bench (``bench/live_bench.py``) measures CPU under ``pgbench -R`` on a machine that pgbench, the
publisher and the target share: how many transactions each round reads, and so what a transaction costs, moves
with the machine's load (single runs of one revision differed by ±10 %). This replays instead:

* ``pgbench -t`` (tpcb-like) runs once on a real publisher; its pgoutput messages are read from a slot through the
  SQL interface (``pg_logical_slot_peek_binary_changes``, protocol 1) and wrapped as XLogData.
* A real :class:`~applier.apply.worker.ApplyWorker` (real target, pipeline, housekeeping, catalog) applies them to a
  fresh target database initialised as the publisher's was, through a stand-in replication connection
  (:class:`ReplayStream`) that delivers ``--per-arrival`` transactions per arrival, paced at ``--rate`` a second:
  the first message through ``read()``, the rest through ``read_undecoded()``, as the worker meets them under a
  steady load.
* CPU: ``time.thread_time()`` of the worker's thread from arrival ``--warm`` to the last (the catalog watch and
  the bench's own threads left out).

``--callgrind`` (run the script under ``valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes``)
switches instrumentation on and off around the same window, and advances the housekeeping's monotonic clock by
one arrival period per arrival, so that what it does by the clock (status updates, flush polls, metrics) happens
as often per transaction as at full speed: the worker thread's instruction count is then repeatable to 0.3 %,
where CPU time on the shared machine moved by 5-10 %. What it leaves out: the publisher's socket (the stand-in
replaces ``ReplicationConnection``) and kernel time.

Run: ``PYTHONPATH=. .venv/bin/python bench/replay_cpu.py [--txns 12000] [--rate 1600] [--per-arrival 1]
[--repeat 3]``.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import threading
import time
import types
from typing import Any

import applier.apply.housekeeping as housekeeping_module
import applier.apply.loop as loop_module
import applier.apply.worker as worker_module
from applier.apply.testing import setup_subscription
from applier.apply.worker import WorkerThread
from applier.decoder import decode_envelope
from applier.encoder import encode_envelope
from applier.messages import StandbyStatusUpdate
from applier.testing.cluster import Database, PostgresCluster, find_binaries

TABLES = ["pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history"]
_XLOG_HEAD = struct.Struct(">cQQq")


class VirtualClock:
    """The housekeeping's and the loop's monotonic clock under ``--callgrind``: one arrival period per arrival."""

    def __init__(self) -> None:
        self.now = 1000.0

    def install(self) -> None:
        shim = types.SimpleNamespace(monotonic=lambda: self.now, time=time.time, sleep=time.sleep)
        for module in (housekeeping_module, loop_module, worker_module):
            module.time = shim  # type: ignore[attr-defined]


class ReplayStream:
    """Stands in for ``ReplicationConnection``: ``per`` transactions per arrival, one arrival per ``per / rate``
    seconds; ``stop`` is set after the last."""

    def __init__(self, txns: list[list[bytes]], rate: float, per: int, warm: int, stop: threading.Event,
                 clock: VirtualClock | None) -> None:  # fmt: skip
        self.txns, self.period, self.per, self.warm, self.stop, self.clock = (
            txns,
            per / rate,
            per,
            warm,
            stop,
            clock,
        )
        self.i = 0
        self.rest: list[bytes] = []
        self.ran_dry = True
        self.next_at = 0.0
        self.cpu = [0.0, 0.0]
        self.statuses = 0
        self.done = threading.Event()

    def _callgrind(self, on: bool) -> None:
        if self.clock is not None:
            subprocess.run(
                ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], capture_output=True
            )

    def read(self, timeout: float) -> Any:
        if self.i >= len(self.txns):
            if not self.done.is_set():
                self.cpu[1] = time.thread_time()
                self._callgrind(False)
                self.stop.set()
                self.done.set()
            time.sleep(min(timeout, 0.01))
            return None
        now = self.next_at if self.clock is not None else time.monotonic()
        if now < self.next_at:
            if self.next_at - now > timeout:
                time.sleep(timeout)
                return None
            time.sleep(self.next_at - now)
        self.next_at = max(now, self.next_at) + self.period
        if self.clock is not None:
            self.clock.now += self.period
        if self.i == self.warm:
            self._callgrind(True)
            self.cpu[0] = time.thread_time()
        messages = [m for t in self.txns[self.i : self.i + self.per] for m in t]
        self.i += self.per
        self.rest = messages[1:]
        return decode_envelope(messages[0])

    def read_undecoded(self, into: list[bytes], limit: int, wanted: bytes, *, refill: bool = False) -> Any:
        into.extend(self.rest)
        self.rest = []
        self.ran_dry = True
        return None

    def send_status(self, write: int, flush: int, apply: int, *, reply_requested: bool = False) -> None:
        self.statuses += 1
        encode_envelope(StandbyStatusUpdate(write, flush, apply, 0, reply_requested))

    def close(self) -> None:
        pass


def capture(pub: Database, slot: str, publication: str) -> list[list[bytes]]:
    """The slot's transactions, each a list of XLogData (envelope included) as the walsender would send them."""
    rows = pub.query(
        "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1',"
        " 'publication_names', %s)",
        (slot, publication),
    )
    txns: list[list[bytes]] = []
    current: list[bytes] = []
    for lsn, data in rows:
        hi, lo = lsn.split("/")
        pos = (int(hi, 16) << 32) | int(lo, 16)
        current.append(_XLOG_HEAD.pack(b"w", pos, pos, 0) + bytes(data))
        if data[0:1] == b"C":
            txns.append(current)
            current = []
    return txns


def _pgbench(bindir: Any, *args: str) -> None:
    subprocess.run([str(bindir / "pgbench"), *args], check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--txns", type=int, default=12000, help="transactions replayed (default 12000)")
    ap.add_argument("--warm", type=int, default=960, help="arrivals before the measured window start (960)")
    ap.add_argument("--rate", type=float, default=1600, help="transactions a second (1600)")
    ap.add_argument("--per-arrival", type=int, default=1, help="transactions per arrival (1)")
    ap.add_argument("--repeat", type=int, default=3, help="runs, each on a fresh target database (3)")
    ap.add_argument("--callgrind", action="store_true", help="under callgrind: see the module docstring")
    a = ap.parse_args(argv)
    if a.warm % a.per_arrival:
        ap.error("--warm must be a multiple of --per-arrival")
    clock = VirtualClock() if a.callgrind else None
    if clock is not None:
        clock.install()
    binaries = find_binaries()
    common = {
        "autovacuum": "off",
        "max_wal_size": "8GB",
        "checkpoint_timeout": "1h",
        "max_connections": "100",
    }
    pubc = PostgresCluster(binaries, name="replay-pub", settings={**common, "fsync": "off"})
    tgtc = PostgresCluster(binaries, name="replay-tgt", durable=True, settings=common)
    connect = worker_module.ApplyWorker._connect_publisher
    try:
        pubc.start()
        tgtc.start()
        pubc.execute("CREATE DATABASE src")
        pub = pubc.database("src")
        _pgbench(binaries.bindir, "-i", "-q", "-s", "1", "-n", pub.dsn)
        pub.execute("CREATE PUBLICATION cap FOR TABLE " + ", ".join(TABLES))
        pub.execute("SELECT pg_create_logical_replication_slot('cap', 'pgoutput')")
        _pgbench(
            binaries.bindir,
            "-n",
            "-t",
            str(a.txns // 4 + 1),
            "-c",
            "4",
            "-j",
            "2",
            "-b",
            "tpcb-like",
            pub.dsn,
        )
        txns = capture(pub, "cap", "cap")[: a.txns]
        print(f"captured {len(txns)} transactions, {sum(map(len, txns))} messages", flush=True)
        results = []
        for r in range(a.repeat):
            name = f"r{r}"
            tgtc.execute(f"CREATE DATABASE {name}")
            tgt = tgtc.database(name)
            _pgbench(binaries.bindir, "-i", "-q", "-s", "1", "-n", tgt.dsn)
            setup = setup_subscription(pub, tgt, name, TABLES)
            stop = threading.Event()
            stream = ReplayStream(txns, a.rate, a.per_arrival, a.warm, stop, clock)
            worker_module.ApplyWorker._connect_publisher = lambda *_args, s=stream: s  # type: ignore[method-assign]
            worker = setup.worker(stop=stop)
            thread = WorkerThread(worker).start()
            stream.done.wait(3600)
            thread.join(60)
            n = len(txns) - a.warm
            us = 1e6 * (stream.cpu[1] - stream.cpu[0]) / n
            results.append(us)
            rows = tgt.scalar("SELECT count(*) FROM pgbench_history")
            print(f"run {r}: {us:.1f} µs of worker-thread CPU per transaction over {n} (status updates "
                  f"{stream.statuses}, history rows {rows}, bulk {worker.stats.bulk_transactions})", flush=True)  # fmt: skip
        results.sort()
        print(f"median {results[len(results) // 2]:.1f} µs per transaction, min {results[0]:.1f}")
    finally:
        worker_module.ApplyWorker._connect_publisher = connect  # type: ignore[method-assign]
        tgtc.destroy()
        pubc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
