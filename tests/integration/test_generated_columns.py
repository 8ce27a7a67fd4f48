"""Published generated columns (issue 40), held against PostgreSQL's own subscriber on the same publisher.

From PostgreSQL 18 a publication can publish stored generated columns: ``WITH (publish_generated_columns =
stored)``, or a column list that names one (``FOR TABLE t (id, g)``). PostgreSQL 18's subscriber then fills the
target's *ordinary* column of that name, in the initial copy (``fetch_remote_table_info`` takes the column list
from ``pg_get_publication_tables``, which holds such a column, and ``copy_table`` selects it) and in every change;
a target column that is itself generated is refused (``logicalrep_rel_open``: "... has incompatible generated
column"). A generated column the publication does not publish is neither copied nor sent: the target computes it
(or leaves its plain column NULL).

Ours runs as ``applier create`` / ``applier run`` on the target cluster; the native subscription is in another
database of the same cluster, subscribed to the same publications. The copy is held on the driver's head start
and in Spark's tasks (``APPLIER_TABLESYNC_HEAD_START=0``): both run the column lists the planner builds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from applier.testing import Database, PostgresCluster, tables_differ, wait_until
from tests.support.cli import catalog_tables, ok, status
from tests.support.native import caught_up, drop_native_subscription
from tests.support.tap import CliApplier

TIMEOUT = 120.0

#: publisher side of each table, the target side (ours and native alike), and the publication of it
STORED = (
    # published with publish_generated_columns = stored: g and gt are copied and sent; v (VIRTUAL) never is;
    # a dropped column keeps the table's attribute count above its published columns'
    "CREATE TABLE t_stored (id int PRIMARY KEY, a int, txt text, dropme int,"
    " g int GENERATED ALWAYS AS (a * 2) STORED, gt text GENERATED ALWAYS AS (upper(txt) || '!') STORED,"
    " v int GENERATED ALWAYS AS (a * 5) VIRTUAL); ALTER TABLE t_stored DROP COLUMN dropme",
    "CREATE TABLE t_stored (id int PRIMARY KEY, a int, txt text, g int, gt text, v int)",
    "CREATE PUBLICATION p_stored FOR TABLE t_stored WITH (publish_generated_columns = stored)",
)
LISTED = (
    # a column list naming the generated column g (not h, which the target generates its own way, nor b)
    "CREATE TABLE t_list (id int PRIMARY KEY, a int, b text, g int GENERATED ALWAYS AS (a + 100) STORED,"
    " h int GENERATED ALWAYS AS (a * 3) STORED)",
    "CREATE TABLE t_list (id int PRIMARY KEY, a int, b text, g int, h int GENERATED ALWAYS AS (a * 7) STORED)",
    "CREATE PUBLICATION p_list FOR TABLE t_list (id, a, g)",
)
DEFAULT = (
    # not published: the target computes its own g, and its plain g2 stays NULL
    "CREATE TABLE t_default (id int PRIMARY KEY, a int, g int GENERATED ALWAYS AS (a - 1) STORED,"
    " g2 int GENERATED ALWAYS AS (a * a) STORED)",
    "CREATE TABLE t_default (id int PRIMARY KEY, a int, g int GENERATED ALWAYS AS (a * 10) STORED, g2 int)",
    "CREATE PUBLICATION p_default FOR TABLE t_default",
)
ROWS = {
    "t_stored": "INSERT INTO t_stored (id, a, txt) SELECT g, CASE WHEN g % 17 = 0 THEN NULL ELSE g END,"
    " CASE g % 3 WHEN 0 THEN E'tab\\there \\\\ back' WHEN 1 THEN 'ü ' || g END FROM generate_series(1, 400) g",
    "t_list": "INSERT INTO t_list (id, a, b) SELECT g, g, 'b' || g FROM generate_series(1, 400) g",
    "t_default": "INSERT INTO t_default (id, a) SELECT g, g FROM generate_series(1, 400) g",
}


def _tables(major: int) -> list[tuple[str, str, str]]:
    """The cases the publisher's version has: before 18 nothing publishes a generated column."""
    return [STORED, LISTED, DEFAULT] if major >= 18 else [DEFAULT]


def _name(case: tuple[str, str, str]) -> str:
    return case[2].split()[5]  # CREATE PUBLICATION p FOR TABLE <t> ...


@dataclass
class Sides:
    publisher: Database
    ours: Database
    native: Database
    name: str  # our subscription (and slot)

    @property
    def native_name(self) -> str:
        return f"{self.name}_n"


@contextlib.contextmanager
def sides(pair, target_cluster: PostgresCluster) -> Iterator[Sides]:
    """The pair's databases and a database for the native subscriber on the target cluster; the native
    subscription (if made), our subscription and that database are dropped afterwards."""
    native = target_cluster.create_database(pair.name + "_n")
    s = Sides(pair.publisher, pair.target, native, pair.name)
    try:
        yield s
    finally:
        drop_native_subscription(native, s.native_name)
        target_cluster.drop_database(native.name)
        with contextlib.suppress(AssertionError):
            ok(pair.target, "drop", s.name, "--force")


def _native_subscribe(s: Sides, publications: list[str]) -> None:
    s.native.execute(
        sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}").format(
            sql.Identifier(s.native_name),
            sql.Literal(s.publisher.dsn),
            sql.SQL(", ").join(sql.Identifier(p) for p in publications),
        )
    )


def _create(s: Sides, publications: list[str]) -> None:
    pubs = [arg for p in publications for arg in ("--publication", p)]
    ok(s.ours, "create", s.name, "--publisher", s.publisher.dsn, *pubs)


def _native_ready(s: Sides, n: int) -> bool:
    return s.native.scalar("SELECT count(*) FROM pg_subscription_rel WHERE srsubstate = 'r'") == n


def _ours_copied(s: Sides, n: int) -> bool:
    states = [state for _, state in catalog_tables(s.ours, s.name)]
    return len(states) == n and all(state in ("s", "r") for state in states)


def _copy_ended(s: Sides, n: int = 1) -> dict[str, Any] | None:
    """Our subscription's status once its copy of ``n`` tables has failed or finished."""
    entry = status(s.ours, s.name)
    return entry if entry["last_error"] is not None or _ours_copied(s, n) else None


def _caught_up(s: Sides, cli: CliApplier) -> None:
    """Both subscribers have replayed everything the publisher has written so far."""
    lsn = s.publisher.scalar("SELECT pg_current_wal_lsn()::text")
    for app in (s.name, s.native_name):
        wait_until(lambda app=app: caught_up(s.publisher, app, lsn), timeout=TIMEOUT,
                   what=f"{app} to replay up to {lsn}; applier log:\n{cli.log_tail()}")  # fmt: skip


def _same_as_native(s: Sides, tables: list[str]) -> None:
    problems = [d for t in tables if (d := tables_differ(s.ours, s.native, f"public.{t}"))]
    assert not problems, "ours differs from PostgreSQL's subscriber:\n" + "\n".join(problems)


def _schema(s: Sides, cases: list[tuple[str, str, str]]) -> None:
    """Each case's table and publication on the publisher, its rows, and its table on both subscribers."""
    for publisher_ddl, target_ddl, publication in cases:
        with s.publisher.connect() as conn:
            conn.execute(publisher_ddl)
            conn.execute(publication)
            conn.execute(ROWS[_name((publisher_ddl, target_ddl, publication))])
        for db in (s.ours, s.native):
            db.execute(target_ddl)


def _filled_by_the_copy(s: Sides, major: int) -> None:
    """The values the comparison with native rests on (so that it proves something): the published generated
    columns hold the publisher's values, an unpublished one the target's own, a virtual one nothing."""
    if major >= 18:
        filled = "SELECT count(*) FROM t_stored WHERE g IS NOT DISTINCT FROM a * 2 AND gt = upper(txt) || '!'"
        assert s.ours.scalar(filled) == 400 - 133  # every row with a txt (g % 3 = 2 has none)
        assert s.ours.scalar("SELECT count(*) FROM t_list WHERE g = a + 100") == 400
        assert s.ours.scalar("SELECT count(v) FROM t_stored") == 0  # virtual: never published
    assert s.ours.scalar("SELECT count(*) FROM t_default WHERE g = a * 10 AND g2 IS NULL") == 400


def _changes(s: Sides, tables: list[str], major: int) -> None:
    """INSERTs, UPDATEs of the generated columns' sources (and of a column outside the list), DELETEs."""
    with s.publisher.connect() as conn:
        for t in tables:
            conn.execute(f"INSERT INTO {t} (id, a) SELECT g, g * 3 FROM generate_series(401, 450) g")  # noqa: S608
            conn.execute(f"UPDATE {t} SET a = a + 1000 WHERE id % 5 = 0")  # noqa: S608
            conn.execute(f"DELETE FROM {t} WHERE id % 7 = 0")  # noqa: S608
        if major >= 18:
            conn.execute("UPDATE t_stored SET txt = 'changed ' || id WHERE id % 4 = 1")
            conn.execute("UPDATE t_list SET b = 'not listed' WHERE id % 4 = 2")


@pytest.mark.core
@pytest.mark.parametrize("where", ["driver", pytest.param("spark", marks=pytest.mark.spark)])
def test_published_generated_columns_are_copied_and_applied_as_natively(pair, target_cluster, where) -> None:
    """Three publications on one publisher (``publish_generated_columns = stored``, a column list naming the
    generated column, neither); ours and PostgreSQL's subscriber subscribe to all three. After the initial copy,
    and after later INSERTs, UPDATEs (of the generated columns' sources) and DELETEs, our target's rows equal
    native's, table by table. Before 18 only the unpublished case exists, and nothing may change there."""
    major = pair.publisher.cluster.binaries.major
    if where == "spark" and major < 18:
        pytest.skip("the Spark path's column lists are the driver's: held once, on PostgreSQL 18")
    cases = _tables(major)
    tables = [_name(c) for c in cases]
    publications = [c[2].split()[2] for c in cases]
    env = {"APPLIER_TABLESYNC_HEAD_START": "0"} if where == "spark" else {}
    with sides(pair, target_cluster) as s:
        _schema(s, cases)
        _create(s, publications)
        _native_subscribe(s, publications)
        with CliApplier(s.ours, s.name, env=env).start() as cli:
            wait_until(lambda: _native_ready(s, len(tables)), timeout=TIMEOUT, what="the native copy")
            entry = wait_until(lambda: _copy_ended(s, len(tables)), timeout=TIMEOUT * 2,
                               what=f"our copy; applier log:\n{cli.log_tail()}")  # fmt: skip
            assert entry["last_error"] is None, entry["last_error"]
            _caught_up(s, cli)
            _same_as_native(s, tables)
            _filled_by_the_copy(s, major)
            # the path held: the driver's streams, or Spark's tasks only
            assert ("copying on the driver" in cli.log_tail(200)) == (where == "driver"), cli.log_tail(200)

            _changes(s, tables, major)
            _caught_up(s, cli)
            _same_as_native(s, tables)
            if major >= 18:
                assert s.ours.scalar("SELECT g FROM t_stored WHERE id = 410") == 2 * (410 * 3 + 1000)
            entry = status(s.ours, s.name)
            assert entry["last_error"] is None, entry


@pytest.mark.core
def test_a_target_may_lack_the_columns_the_publications_leave_out(pair, target_cluster) -> None:
    """PostgreSQL checks the target for the *published* columns only (``logicalrep_rel_open`` over the column list
    ``fetch_remote_table_info`` kept): a target without a column the list leaves out (b), or without a generated
    column that is not published (h), takes the copy and the changes as natively."""
    major = pair.publisher.cluster.binaries.major
    listed = "(id, a, g)" if major >= 18 else "(id, a)"  # a column list names a generated column from 18 on
    with sides(pair, target_cluster) as s:
        with s.publisher.connect() as conn:
            conn.execute(
                "CREATE TABLE t (id int PRIMARY KEY, a int, b text, g int GENERATED ALWAYS AS (a + 1) STORED);"
                "CREATE TABLE u (id int PRIMARY KEY, a int, h int GENERATED ALWAYS AS (a * 2) STORED);"
                "INSERT INTO t (id, a, b) SELECT g, g, 'b' || g FROM generate_series(1, 100) g;"
                "INSERT INTO u (id, a) SELECT g, g FROM generate_series(1, 100) g"
            )
            conn.execute(sql.SQL("CREATE PUBLICATION p FOR TABLE t {}, u").format(sql.SQL(listed)))
        for db in (s.ours, s.native):
            db.execute(
                "CREATE TABLE t (id int PRIMARY KEY, a int, g int); CREATE TABLE u (id int PRIMARY KEY, a int)"
            )
        _create(s, ["p"])
        _native_subscribe(s, ["p"])
        with CliApplier(s.ours, s.name).start() as cli:
            wait_until(lambda: _native_ready(s, 2), timeout=TIMEOUT, what="the native copy")
            entry = wait_until(lambda: _copy_ended(s, 2), timeout=TIMEOUT,
                               what=f"our copy; applier log:\n{cli.log_tail()}")  # fmt: skip
            assert entry["last_error"] is None, entry["last_error"]
            _caught_up(s, cli)
            _same_as_native(s, ["t", "u"])
            s.publisher.execute(
                "INSERT INTO t (id, a, b) VALUES (101, 101, 'new'); UPDATE u SET a = -a WHERE id < 10"
            )
            _caught_up(s, cli)
            _same_as_native(s, ["t", "u"])
        assert s.ours.scalar("SELECT count(*) FROM t WHERE g IS NOT DISTINCT FROM a + 1") == (
            101 if major >= 18 else 0
        )


def _native_error(cluster: PostgresCluster, offset: int, needle: str) -> str | None:
    """The first ERROR in the server log after ``offset`` that contains ``needle``, without its prefix."""
    with open(cluster.logfile, errors="replace") as log:
        log.seek(offset)
        for line in log:
            if needle in line and "ERROR:" in line:
                return line.split("ERROR:", 1)[1].strip()
    return None


@pytest.mark.core
@pytest.mark.parametrize("publication", ["stored", "list"])
def test_a_published_generated_column_into_a_generated_target_column_is_refused_as_natively(
    pair, target_cluster, publication
) -> None:
    """The publication publishes g, which the target generates: PostgreSQL's subscriber refuses the table's copy
    with ``logicalrep_rel_open``'s error, and ours refuses it with the same words (``applier status`` shows it)
    before a row is written."""
    if pair.publisher.cluster.binaries.major < 18:
        pytest.skip("generated columns are published from PostgreSQL 18 on")
    publisher_ddl = "CREATE TABLE tg (id int PRIMARY KEY, a int, g int GENERATED ALWAYS AS (a * 2) STORED)"
    target_ddl = "CREATE TABLE tg (id int PRIMARY KEY, a int, g int GENERATED ALWAYS AS (a * 3) STORED)"
    pub = {
        "stored": "CREATE PUBLICATION p FOR TABLE tg WITH (publish_generated_columns = stored)",
        "list": "CREATE PUBLICATION p FOR TABLE tg (id, g)",
    }[publication]
    with sides(pair, target_cluster) as s:
        s.publisher.execute(publisher_ddl)
        s.publisher.execute(pub)
        s.publisher.execute("INSERT INTO tg (id, a) SELECT g, g FROM generate_series(1, 100) g")
        for db in (s.ours, s.native):
            db.execute(target_ddl)
        offset = target_cluster.logfile.stat().st_size
        _native_subscribe(s, ["p"])
        native = wait_until(lambda: _native_error(target_cluster, offset, "generated column"), timeout=TIMEOUT,
                            what="the native subscriber's error")  # fmt: skip
        _create(s, ["p"])
        with CliApplier(s.ours, s.name).start() as cli:
            entry = wait_until(lambda: _copy_ended(s), timeout=TIMEOUT,
                               what=f"our copy to end; applier log:\n{cli.log_tail()}")  # fmt: skip
        assert entry["last_error"] is not None, f"the copy was not refused: {entry}"
        message = entry["last_error"]["message"]
        assert (
            native == 'logical replication target relation "public.tg" has incompatible generated column: "g"'
        )
        assert message == f"cannot copy public.tg: {native}", message
        assert s.ours.scalar("SELECT count(*) FROM tg") == 0
        assert [state for _, state in catalog_tables(s.ours, s.name)] == ["i"]


@pytest.mark.core
def test_publications_that_disagree_on_a_generated_column_are_refused_as_natively(
    pair, target_cluster
) -> None:
    """One publication publishes g (``publish_generated_columns = stored``), another the same table without it:
    their column lists differ, which PostgreSQL refuses (``CREATE SUBSCRIPTION``'s ``fetch_table_list``, and
    ``fetch_remote_table_info`` at the copy); ours refuses the copy with the same words."""
    if pair.publisher.cluster.binaries.major < 18:
        pytest.skip("generated columns are published from PostgreSQL 18 on")
    with sides(pair, target_cluster) as s:
        s.publisher.execute(
            "CREATE TABLE tg (id int PRIMARY KEY, a int, g int GENERATED ALWAYS AS (a * 2) STORED)"
        )
        s.publisher.execute("CREATE PUBLICATION p1 FOR TABLE tg WITH (publish_generated_columns = stored)")
        s.publisher.execute("CREATE PUBLICATION p2 FOR TABLE tg")
        s.publisher.execute("INSERT INTO tg (id, a) SELECT g, g FROM generate_series(1, 10) g")
        for db in (s.ours, s.native):
            db.execute("CREATE TABLE tg (id int PRIMARY KEY, a int, g int)")
        with pytest.raises(psycopg.errors.FeatureNotSupported) as refused:
            _native_subscribe(s, ["p1", "p2"])
        native = refused.value.diag.message_primary
        assert native == 'cannot use different column lists for table "public.tg" in different publications'
        _create(s, ["p1", "p2"])
        with CliApplier(s.ours, s.name).start() as cli:
            entry = wait_until(lambda: _copy_ended(s), timeout=TIMEOUT,
                               what=f"our copy to end; applier log:\n{cli.log_tail()}")  # fmt: skip
        assert entry["last_error"] is not None, f"the copy was not refused: {entry}"
        assert entry["last_error"]["message"] == f"cannot copy public.tg: {native}"
        assert s.ours.scalar("SELECT count(*) FROM tg") == 0
