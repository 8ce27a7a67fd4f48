"""``applier verify NAME``: prove that the target holds what the publisher holds, while replication keeps running.

Why this shape: people migrating a database want to switch over only once they have *seen* that the copy is right,
and they cannot stop writes to find out. So every table of the subscription is compared between publisher and
target by row counts and md5 hashes over primary-key ranges (the key space is split at the publisher's key
quantiles; each range is hashed on both sides with ``md5(string_agg(row::text, ... ORDER BY key))``), and a range
that differs is narrowed — split again, down to a few hundred rows, then compared row by row (key + md5 of the row)
— to the keys that differ.

Replication is live, so a difference may just be a change not applied yet. A differing range is therefore read
again in a controlled order: the publisher side in a REPEATABLE READ transaction together with
``pg_current_wal_lsn()`` (L); then we wait until the target has applied past L — the subscription's origin
``applier_<subid>`` on the target (``pg_replication_origin_progress``), or the slot's ``confirmed_flush_lsn`` on the
publisher, which the applier moves only over what the target has durably applied — and only then read the target.
A range is reported only if it still differs after that (a few attempts, since the target may have moved past L
with newer changes to the same range), and a key only if it differed in every settled row-by-row read of its range
(a real divergence is stable; a row still being changed differs only now and then). If the target does not get past L within ``--settle-timeout``, the range is
reported as differing and the report says the target lagged.

Tables without a primary key have no key ranges: their whole-table counts and hashes (rows ordered by their text)
are compared, and the output says so; differing keys cannot be named for them, and a keyless table that is written
to without pause may never settle into equal hashes (it is then reported as differing: verify it in a quiet moment).

Where the first pass runs: the hash is computed by the servers and only a 32-byte digest per range travels, so for
most tables a thread pool here (publisher and target queried in parallel, ranges in parallel) is the fastest way,
and Spark's start-up would cost more than it saves. Tables of at least ``spark_rows`` rows (the publisher's estimate;
``--spark-rows``) are hashed as a Spark job instead — one task per range and side, on ``local[*]`` or a cluster
(``SPARK_REMOTE``, as the initial copy) — so very large tables spread their hashing over many connections and
machines; the re-checks and the narrowing of the few differing ranges stay here, where the settle waits are.
Identifiers are composed with ``psycopg.sql`` only; connection strings (and so passwords) never appear in the
output.

Exit status (from the CLI): 0 when every table is equal, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from applier.conninfo import scrub
from applier.errors import ApplierError

if TYPE_CHECKING:
    from applier.catalog.store import RelState

__all__ = ["TableReport", "VerifyError", "VerifyReport", "format_report", "verify", "wait_applied"]

#: a range with at most this many rows (on either side) is compared row by row
LEAF_ROWS = 500
#: a differing range that is larger is split into this many sub-ranges
SPLIT = 16
#: at most this many differing keys are listed per table (all are counted)
MAX_KEYS = 100
#: tables with at least this many rows (the publisher's estimate) are hashed as a Spark job
SPARK_ROWS = 5_000_000


class VerifyError(ApplierError):
    """verify could not run (a server unreachable, a table missing); the message says which and why."""


@dataclass
class DifferingKey:
    key: dict[str, Any]
    kind: str  # "changed" (both sides, different content), "missing" (publisher only), "extra" (target only)


@dataclass
class TableReport:
    table: str  # the target table
    publisher_table: str
    key: list[str] | None  # None: no primary key, compared as a whole
    publisher_rows: int = 0
    target_rows: int = 0
    ranges: int = 0
    rechecked: int = 0  # ranges read again after the target applied past the publisher's read position
    differing: int = 0
    keys: list[DifferingKey] = field(default_factory=list)
    note: str | None = None
    spark: bool = False  # the first pass ran as a Spark job (a table of at least spark_rows rows)

    @property
    def equal(self) -> bool:
        return self.differing == 0

    @property
    def matched(self) -> int:
        """Publisher rows found identical on the target."""
        if self.key is None:
            return self.publisher_rows if self.equal else 0
        not_matched = sum(1 for k in self.keys if k.kind != "extra")
        if self.differing > len(self.keys):  # more than listed: count conservatively
            not_matched = self.differing
        return max(self.publisher_rows - not_matched, 0)


@dataclass
class VerifyReport:
    subscription: str
    tables: list[TableReport]

    @property
    def equal(self) -> bool:
        return all(t.equal for t in self.tables)

    def to_json(self) -> str:
        def table(t: TableReport) -> dict[str, Any]:
            d = asdict(t)
            d["matched"], d["equal"] = t.matched, t.equal
            return d

        doc = {
            "subscription": self.subscription,
            "equal": self.equal,
            "tables": [table(t) for t in self.tables],
        }
        return json.dumps(doc, indent=2, default=str)


def format_report(report: VerifyReport) -> str:
    """One line per relation (rows on each side, matched, differing), then the differing keys."""
    head = ("table", "publisher rows", "target rows", "matched", "differing", "method")
    rows = [head]
    for t in report.tables:
        method = f"{t.ranges} key ranges" if t.key is not None else "whole table (no primary key)"
        if t.spark:
            method += " (Spark)"
        rows.append(
            (t.table, str(t.publisher_rows), str(t.target_rows), str(t.matched), str(t.differing), method)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for t in report.tables:
        for k in t.keys:
            key = ", ".join(f"{c}={v!r}" for c, v in k.key.items())
            lines.append(f"{t.table}: {k.kind} row ({key})")
        if t.key is not None and t.differing > len(t.keys):
            lines.append(f"{t.table}: ... and {t.differing - len(t.keys)} more differing rows")
        if t.note:
            lines.append(f"{t.table}: {t.note}")
    verdict = "EQUAL" if report.equal else "DIFFERENT"
    lines.append(f"subscription {report.subscription}: {verdict}")
    return "\n".join(lines)


# --- a table on both sides -------------------------------------------------------------------------------------

Bound = tuple[Any, ...] | None  # a key tuple; None is open-ended
Range = tuple[Bound, Bound]  # (lo, hi]: lo exclusive, hi inclusive


@dataclass
class _Side:
    """One server's view of one table: how to name it and its compared columns."""

    conninfo: str
    table: sql.Composable
    columns: list[str]
    key: list[str] | None

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.conninfo, autocommit=True, application_name="applier verify")

    def _cols(self, names: Sequence[str]) -> sql.Composable:
        return sql.SQL(", ").join(sql.Identifier(c) for c in names)

    def _where(self, rng: Range) -> tuple[sql.Composable, list[Any]]:
        assert self.key is not None
        keyrow = sql.SQL("({})").format(self._cols(self.key))
        parts: list[sql.Composable] = []
        params: list[Any] = []
        lo, hi = rng
        placeholders = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() * len(self.key)))
        if lo is not None:
            parts.append(sql.SQL("{} > {}").format(keyrow, placeholders))
            params += lo
        if hi is not None:
            parts.append(sql.SQL("{} <= {}").format(keyrow, placeholders))
            params += hi
        return (sql.SQL(" AND ").join(parts) if parts else sql.SQL("true")), params

    def _rows(self, rng: Range | None) -> tuple[sql.Composable, list[Any]]:
        """``SELECT columns FROM table WHERE range`` as a subquery whose rows print as ``(a,b,c)``."""
        if rng is None:
            return sql.SQL("SELECT {} FROM {}").format(self._cols(self.columns), self.table), []
        where, params = self._where(rng)
        return sql.SQL("SELECT {} FROM {} WHERE {}").format(
            self._cols(self.columns), self.table, where
        ), params

    def hash(self, conn: psycopg.Connection[Any], rng: Range | None) -> tuple[int, str | None]:
        """(rows, md5 of the rows' text in key order — or text order for a table without a key)."""
        sub, params = self._rows(rng)
        order = self._cols(self.key) if self.key else sql.SQL("r::text")
        query = sql.SQL("SELECT count(*), md5(string_agg(r::text, E'\\n' ORDER BY {})) FROM ({}) r").format(
            order, sub
        )
        row = conn.execute(query, params).fetchone()
        assert row is not None
        return int(row[0]), row[1]

    def row_hashes(self, conn: psycopg.Connection[Any], rng: Range) -> dict[tuple[Any, ...], str]:
        """key → md5 of the row's text, for every row of the range."""
        assert self.key is not None
        sub, params = self._rows(rng)
        query = sql.SQL("SELECT {}, md5(r::text) FROM ({}) r").format(
            sql.SQL(", ").join(sql.SQL("r.{}").format(sql.Identifier(c)) for c in self.key), sub
        )
        return {tuple(r[:-1]): r[-1] for r in conn.execute(query, params)}

    def estimated_rows(self, conn: psycopg.Connection[Any]) -> int:
        """The planner's row estimate (``pg_class.reltuples``; -1 or 0 before the first ANALYZE)."""
        query = sql.SQL("SELECT reltuples::bigint FROM pg_catalog.pg_class WHERE oid = {}::regclass").format(
            sql.Literal(self.table.as_string())
        )
        row = conn.execute(query).fetchone()
        return int(row[0]) if row is not None else 0

    def bounds(self, conn: psycopg.Connection[Any], rng: Range, parts: int) -> list[Bound]:
        """Keys splitting the range into ``parts`` ranges of about equal row counts (quantiles of the keys)."""
        assert self.key is not None
        where, params = self._where(rng)
        count = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE {}").format(self.table, where), params)
        n = int(count.fetchone()[0])  # type: ignore[index]
        step = max(n // parts, 1)
        if n <= parts:
            return []
        query = sql.SQL(
            "SELECT {keys} FROM (SELECT {keys}, row_number() OVER (ORDER BY {keys}) AS rn FROM {t} WHERE {w}) s"
            " WHERE rn %% {step} = 0 AND rn < {n} ORDER BY {keys}"
        ).format(keys=self._cols(self.key), t=self.table, w=where, step=sql.Literal(step), n=sql.Literal(n))
        return [tuple(r) for r in conn.execute(query, params)]


def spark_hashes(
    jobs: Sequence[tuple[_Side, Range | None]], spark_master: str | None = None
) -> list[tuple[int, str | None]]:
    """:meth:`_Side.hash` of every (side, range) as one Spark job, one task each, results in order.

    Each task connects to its server and lets it hash the range; only (rows, md5) comes back. The same job runs on
    ``local[*]`` and through Spark Connect (``tablesync.job.spark_session``)."""
    if not jobs:
        return []
    from tablesync import job as spark_job

    todo = list(jobs)

    def hash_ranges(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        schema = pa.schema([("i", pa.int64()), ("rows", pa.int64()), ("md5", pa.string())])
        for batch in batches:
            out = []
            for i in batch.column(0).to_pylist():
                side, rng = todo[i]
                with side.connect() as conn:
                    rows, md5 = side.hash(conn, rng)
                out.append({"i": i, "rows": rows, "md5": md5})
            yield pa.RecordBatch.from_pylist(out, schema=schema)

    handle = spark_job.spark_session(spark_master)
    try:
        n = len(todo)
        result = (
            handle.session.range(0, n, 1, n)
            .mapInArrow(hash_ranges, "i long, rows long, md5 string")
            .collect()
        )
    finally:
        spark_job.release(handle)
    by_index = {r.i: (int(r.rows), r.md5) for r in result}
    return [by_index[i] for i in range(len(todo))]


def _split(rng: Range, bounds: list[Bound]) -> list[Range]:
    points: list[Bound] = [rng[0], *bounds, rng[1]]
    return [(points[i], points[i + 1]) for i in range(len(points) - 1)]


# --- the comparison --------------------------------------------------------------------------------------------


@dataclass
class _Context:
    publisher: str
    target: str
    origin: str
    slot: str
    settle_timeout: float
    attempts: int
    pool: ThreadPoolExecutor
    spark_rows: int = SPARK_ROWS
    spark_master: str | None = None

    def wait_applied(self, lsn: str) -> bool:
        """Until the target has applied everything the publisher had committed at ``lsn``; False on timeout."""
        with (
            psycopg.connect(self.target, autocommit=True, application_name="applier verify") as t,
            psycopg.connect(self.publisher, autocommit=True, application_name="applier verify") as p,
        ):
            return wait_applied(t, p, self.origin, self.slot, lsn, timeout=self.settle_timeout)


def wait_applied(target: psycopg.Connection[Any], publisher: psycopg.Connection[Any], origin: str, slot: str,
                 lsn: str, *, timeout: float, origin_at: str | None = None) -> bool:  # fmt: skip
    """Wait until the target has applied everything the publisher had committed at ``lsn``: its replication
    ``origin`` is past it, or the publisher's ``slot`` confirmed it (a worker that applied and acknowledged it
    before its origin's progress was flushed). False after ``timeout`` seconds. One rule for ``verify``'s settling
    and ``migrate cutover``'s catch-up.

    ``origin_at``, when the caller knows it: where the origin will be once the target has applied everything up to
    ``lsn``: the end of the stream's last event (commit, prepare, commit or rollback prepared) at or before it (the
    cutover reads it from its ``_count`` slot). The origin only ever moves to such an end, and ``lsn`` (the WAL's
    insert position) usually lies past the last one (an abort, a catalog change), so without it the wait ends only
    when the slot confirms ``lsn``: after the target flushed its WAL and the worker reported it, about 0.4 s more
    (issue 28)."""
    deadline = time.monotonic() + timeout
    while True:
        done = target.execute(
            "SELECT coalesce(pg_replication_origin_progress(%s, false) >= %s::pg_lsn, false)",
            (origin, origin_at or lsn),
        ).fetchone()
        if done and done[0]:
            return True
        done = publisher.execute(
            "SELECT coalesce(confirmed_flush_lsn >= %s::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = %s",
            (lsn, slot),
        ).fetchone()
        if done and done[0]:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _both(ctx: _Context, pub: Callable[[], Any], tgt: Callable[[], Any]) -> tuple[Any, Any]:
    fp, ft = ctx.pool.submit(pub), ctx.pool.submit(tgt)
    return fp.result(), ft.result()


def _settled(
    ctx: _Context,
    pub_side: _Side,
    read_pub: Callable[[psycopg.Connection[Any]], Any],
    read_tgt: Callable[[], Any],
) -> tuple[Any, Any, bool]:
    """Publisher read with the WAL position it saw, then the target read once it applied past that position."""
    with pub_side.connect() as conn, conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        lsn = row[0]
        p = read_pub(conn)
    caught_up = ctx.wait_applied(lsn)
    return p, read_tgt(), caught_up


class _TableCheck:
    def __init__(self, ctx: _Context, pub: _Side, tgt: _Side, report: TableReport) -> None:
        self.ctx, self.pub, self.tgt, self.report = ctx, pub, tgt, report
        self.lagged = False

    def _hash_settled(self, rng: Range | None) -> tuple[tuple[int, str | None], tuple[int, str | None]]:
        def read_tgt() -> tuple[int, str | None]:
            with self.tgt.connect() as c:
                return self.tgt.hash(c, rng)

        for attempt in range(self.ctx.attempts):
            p, t, caught_up = _settled(self.ctx, self.pub, lambda c: self.pub.hash(c, rng), read_tgt)
            self.lagged |= not caught_up
            if p == t or attempt == self.ctx.attempts - 1:
                return p, t
        raise AssertionError("unreachable")

    def whole_table(self) -> None:
        def hash_on(side: _Side) -> Callable[[], tuple[int, str | None]]:
            def run() -> tuple[int, str | None]:
                with side.connect() as c:
                    return side.hash(c, None)

            return run

        p, t = _both(self.ctx, hash_on(self.pub), hash_on(self.tgt))
        if p != t:
            self.report.rechecked += 1
            p, t = self._hash_settled(None)
        self.report.publisher_rows, self.report.target_rows = p[0], t[0]
        self.report.ranges = 1
        self.report.differing = 0 if p == t else max(abs(p[0] - t[0]), 1)
        self.report.note = "no primary key: compared whole-table row counts and hashes; keys cannot be named"

    def by_ranges(self, ranges: int) -> None:
        with self.pub.connect() as c:
            estimate = self.pub.estimated_rows(c)
            on_spark = self.ctx.spark_rows <= 0 or estimate >= self.ctx.spark_rows
            bounds = self.pub.bounds(c, (None, None), ranges)
        parts = _split((None, None), bounds)
        self.report.ranges = len(parts)
        if on_spark:
            self.report.spark = True
            hashes = spark_hashes(
                [(side, rng) for rng in parts for side in (self.pub, self.tgt)], self.ctx.spark_master
            )
            self._compare_ranges([(rng, hashes[2 * i], hashes[2 * i + 1]) for i, rng in enumerate(parts)])
            return

        def hash_range(side: _Side, rng: Range) -> Callable[[], tuple[int, str | None]]:
            def run() -> tuple[int, str | None]:
                with side.connect() as c:
                    return side.hash(c, rng)

            return run

        futures = [
            (
                rng,
                self.ctx.pool.submit(hash_range(self.pub, rng)),
                self.ctx.pool.submit(hash_range(self.tgt, rng)),
            )
            for rng in parts
        ]
        self._compare_ranges([(rng, fp.result(), ft.result()) for rng, fp, ft in futures])

    def _compare_ranges(
        self, hashed: Sequence[tuple[Range, tuple[int, str | None], tuple[int, str | None]]]
    ) -> None:
        """First-pass results in: count rows, re-check the ranges that differ once settled, narrow what still does."""
        differing: list[Range] = []
        for rng, p, t in hashed:
            self.report.publisher_rows += p[0]
            self.report.target_rows += t[0]
            if p != t:
                differing.append(rng)
        for rng in differing:
            self.report.rechecked += 1
            p, t = self._hash_settled(rng)
            if p != t:
                self._narrow(rng, max(p[0], t[0]))
        if self.lagged:
            self.report.note = (
                f"the target did not apply past the publisher's read position within {self.ctx.settle_timeout:g}s:"
                " differences may be replication lag"
            )

    def _narrow(self, rng: Range, rows: int) -> None:
        if rows <= LEAF_ROWS:
            self._leaf(rng)
            return
        with self.pub.connect() as c:
            bounds = self.pub.bounds(c, rng, SPLIT)
        if not bounds:  # the publisher has few rows here: the target's extra rows make it large
            with self.tgt.connect() as c:
                bounds = self.tgt.bounds(c, rng, SPLIT)
        if not bounds:
            self._leaf(rng)
            return
        for sub in _split(rng, bounds):
            p, t = self._hash_settled(sub)
            if p != t:
                self._narrow(sub, max(p[0], t[0]))

    def _leaf(self, rng: Range) -> None:
        """Row-by-row comparison of a small range. Each attempt is a settled read; a key is reported only if it
        differed in *every* attempt: a real divergence is stable, while a row that replication is still changing
        differs only now and then (it may change again between the target reaching L and our read of it)."""

        def read_tgt() -> dict[tuple[Any, ...], str]:
            with self.tgt.connect() as c:
                return self.tgt.row_hashes(c, rng)

        suspects: dict[tuple[Any, ...], str] | None = None
        for _ in range(self.ctx.attempts):
            p, t, caught_up = _settled(self.ctx, self.pub, lambda c: self.pub.row_hashes(c, rng), read_tgt)
            self.lagged |= not caught_up
            now = {
                k: ("changed" if k in p and k in t else ("missing" if k in p else "extra"))
                for k in set(p) | set(t)
                if p.get(k) != t.get(k)
            }
            suspects = now if suspects is None else {k: v for k, v in now.items() if k in suspects}
            if not suspects:
                return
        assert self.pub.key is not None and suspects is not None
        for k in sorted(suspects, key=repr):
            self.report.differing += 1
            if len(self.report.keys) < MAX_KEYS:
                self.report.keys.append(DifferingKey(dict(zip(self.pub.key, k, strict=True)), suspects[k]))


# --- entry point -----------------------------------------------------------------------------------------------


def _names(conn: psycopg.Connection[Any], regclass: str | int) -> tuple[str, str]:
    row = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.oid = %s::regclass",
        (str(regclass),),
    ).fetchone()
    if row is None:
        raise VerifyError(f"table {regclass} not found")
    return row[0], row[1]


def _columns(conn: psycopg.Connection[Any], schema: str, table: str) -> list[str]:
    rows = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = format('%%I.%%I', %s::text, %s::text)::regclass"
        " AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum",
        (schema, table),
    )
    return [r[0] for r in rows]


def _primary_key(conn: psycopg.Connection[Any], schema: str, table: str) -> list[str] | None:
    rows = conn.execute(
        "SELECT a.attname FROM pg_index i, unnest(i.indkey) WITH ORDINALITY AS k(attnum, pos)"
        " JOIN pg_attribute a ON a.attnum = k.attnum"
        " WHERE i.indrelid = format('%%I.%%I', %s::text, %s::text)::regclass AND i.indisprimary"
        " AND a.attrelid = i.indrelid ORDER BY k.pos",
        (schema, table),
    )
    key = [r[0] for r in rows]
    return key or None


@contextlib.contextmanager
def _connection(conninfo: str, what: str) -> Iterator[psycopg.Connection[Any]]:
    try:
        conn = psycopg.connect(
            conninfo, autocommit=True, application_name="applier verify", connect_timeout=10
        )
    except psycopg.Error as exc:
        raise VerifyError(f"could not connect to the {what}: {scrub(str(exc), conninfo).strip()}") from None
    with conn:
        yield conn


def verify(
    target: str,
    name: str,
    *,
    publisher: str | None = None,
    ranges: int = 16,
    settle_timeout: float = 30.0,
    attempts: int = 3,
    workers: int = 4,
    spark_rows: int = SPARK_ROWS,
    spark_master: str | None = None,
) -> VerifyReport:
    """Compare every table of subscription ``name`` between its publisher and ``target``.

    ``publisher`` overrides the stored conninfo (which never holds a password: pass one here, or use ~/.pgpass /
    PGPASSWORD). ``ranges`` is how many key ranges a table is split into first; a differing range is re-read up to
    ``attempts`` times, each after waiting up to ``settle_timeout`` seconds for the target to catch up. Tables of at
    least ``spark_rows`` rows (estimated) get their first pass as a Spark job on ``spark_master`` (default:
    ``SPARK_REMOTE``, else ``local[*]``).
    """
    from applier.subscriptions import open_catalog, require_subscription

    catalog = open_catalog(target)
    sub = require_subscription(catalog, name)
    rels = catalog.table_states(sub.subid)
    pub_conninfo = publisher or sub.subconninfo
    report = VerifyReport(name, [])
    with (
        _connection(pub_conninfo, "publisher") as pconn,
        _connection(target, "target") as tconn,
        ThreadPoolExecutor(max_workers=max(workers, 2) * 2) as pool,
    ):
        ctx = _Context(
            pub_conninfo,
            target,
            sub.origin_name,
            sub.subslotname or sub.subname,
            settle_timeout,
            max(attempts, 1),
            pool,
            spark_rows,
            spark_master,
        )
        for rel in rels:
            report.tables.append(_verify_table(ctx, pconn, tconn, rel, ranges))
    return report


def _verify_table(
    ctx: _Context, pconn: psycopg.Connection[Any], tconn: psycopg.Connection[Any], rel: RelState, ranges: int
) -> TableReport:
    """One table: the columns both sides have, by key ranges when both have its primary key, else as a whole."""
    pub_conninfo, target = ctx.publisher, ctx.target
    t_schema, t_name = _names(tconn, rel.relid)
    p_schema, p_name = _names(pconn, rel.remote_name)
    columns = _columns(pconn, p_schema, p_name)
    t_columns = set(_columns(tconn, t_schema, t_name))
    columns = [c for c in columns if c in t_columns]
    key = _primary_key(pconn, p_schema, p_name)
    if key is not None and not set(key) <= t_columns:
        key = None
    tr = TableReport(rel.name, f"{p_schema}.{p_name}", key)
    pub_side = _Side(pub_conninfo, sql.Identifier(p_schema, p_name), columns, key)
    tgt_side = _Side(target, sql.Identifier(t_schema, t_name), columns, key)
    check = _TableCheck(ctx, pub_side, tgt_side, tr)
    try:
        if key is None:
            check.whole_table()
        else:
            check.by_ranges(ranges)
    except psycopg.Error as exc:
        raise VerifyError(
            f"comparing {rel.name} failed: {scrub(str(exc), pub_conninfo, target).strip()}"
        ) from None
    return tr
