"""The DDL capture on a real source (:mod:`applier.ddl.capture`, issue 39): the messages it emits, read back from a
scratch slot through pgoutput with ``messages 'true'`` and decoded by our own decoder and
:func:`applier.ddl.payload.decode_payload`, exactly as the apply reads them; the tables it puts in the migration's
publications, with the rows written in the same transaction; and that removing it leaves nothing.

Marked ``core``: the capture is SQL that runs on the source, so every supported version must run it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from applier.ddl import capture
from applier.ddl.capture_sql import SCHEMA, covers_schema_sql, covers_sql, names
from applier.ddl.payload import PREFIX, DdlEvent, DdlObject, decode_payload, verified
from applier.decoder import decode_message
from applier.messages import Insert, Message, Relation
from applier.migrate.selection import Selection
from applier.testing import Database
from applier.testing.pytest_plugin import ReplicationPair
from applier.testing.roles import drop_role

pytestmark = pytest.mark.core

MAIN, INS = "mig", "mig_ins"


@dataclass
class Source:
    """The pair's publisher with the capture of slot ``slot`` installed for ``selection``, the migration's two
    publications, and a scratch pgoutput slot made after the install (it sees what follows)."""

    db: Database
    slot: str
    scratch: str

    def changes(self) -> list[object]:
        """What the scratch slot decodes since it was made: the capture's events and the rows' relations and
        inserts (peeked, so each call sees everything)."""
        rows = self.db.query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1',"
            " 'publication_names', %s, 'messages', 'true')",
            (self.scratch, f"{MAIN},{INS}"),
        )
        key = self.db.scalar(capture.key_query(self.slot)).encode()
        out: list[object] = []
        for (data,) in rows:
            msg = decode_message(bytes(data))
            if isinstance(msg, Message) and msg.prefix == PREFIX:
                out.append(decode_payload(verified(key, msg.content)))  # signed with the capture's key
            elif isinstance(msg, (Relation, Insert)):
                out.append(msg)
        return out

    def events(self) -> list[DdlEvent]:
        return [c for c in self.changes() if isinstance(c, DdlEvent)]

    def published(self) -> dict[str, str]:
        """Each table of the two publications: ``schema.table`` -> publication."""
        rows = self.db.query(
            "SELECT schemaname || '.' || tablename, pubname FROM pg_publication_tables WHERE pubname = ANY(%s)",
            ([MAIN, INS],),
        )
        return dict(rows)


def _source(pair: ReplicationPair, selection: Selection, setup: str = "") -> Source:
    db = pair.publisher
    if setup:
        db.execute(setup)
    db.execute(sql.SQL("CREATE PUBLICATION {}").format(sql.Identifier(MAIN)))
    db.execute(
        sql.SQL("CREATE PUBLICATION {} WITH (publish = 'insert, truncate')").format(sql.Identifier(INS))
    )
    slot = pair.name[:40]
    with db.connect() as conn:
        capture.install(conn, slot, selection, (MAIN, INS))
    scratch = f"{slot}_scratch"
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (scratch,))
    return Source(db, slot, scratch)


@pytest.fixture
def source(pair: ReplicationPair) -> Iterator[Source]:
    """The whole database selected, with table ``t`` (a key) made before the capture."""
    yield _source(pair, Selection(), "CREATE TABLE t (id int PRIMARY KEY, v text)")


def _obj(
    type_: str, identity: str, table: str | None, *, dropped: bool = False, schema: str = "public"
) -> DdlObject:
    return DdlObject(type_, schema, identity, table, dropped)


def test_alter_table_add_column_is_one_message_with_the_contract_s_fields(source: Source) -> None:
    with source.db.connect() as conn:
        conn.execute("SET search_path = public, pg_catalog")
        conn.execute("ALTER TABLE t ADD COLUMN c int")
    (event,) = source.events()
    assert event.slot == source.slot and event.tag == "ALTER TABLE" and event.n == 1
    assert event.query == "ALTER TABLE t ADD COLUMN c int"
    assert event.search_path == "public, pg_catalog"
    assert event.ts and event.ts[:2] == "20"
    assert event.objects == (_obj("table", "public.t", "public.t"),)


def test_n_counts_every_command_of_a_client_string_emitted_or_not(pair: ReplicationPair) -> None:
    """One client string: the commands outside the selection are counted though not emitted; our own ALTER
    PUBLICATION (a table created) neither; a COMMIT inside the string does not restart the count."""
    src = _source(pair, Selection(schemas=("public",)), "CREATE SCHEMA other")
    query = (
        "CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE other.x (id int); INSERT INTO a VALUES (1);"
        " ALTER TABLE a ADD COLUMN v int; COMMIT; CREATE INDEX a_v ON a (v)"
    )
    with src.db.connect() as conn:
        conn.execute(query)
    events = src.events()
    assert [(e.tag, e.n) for e in events] == [("CREATE TABLE", 1), ("ALTER TABLE", 3), ("CREATE INDEX", 4)]
    assert {e.statement_key for e in events} == {(events[0].ts, query)}
    assert events[0].created_tables == ("public.a",)
    assert events[2].objects == (_obj("index", "public.a_v", "public.a"),)


def test_nothing_outside_the_selection(pair: ReplicationPair) -> None:
    """Another schema, an excluded table, a temporary table, an object of no schema: no message at all."""
    selection = Selection(schemas=("public",), exclude_tables=("skip*",))
    src = _source(pair, selection, "CREATE SCHEMA other; CREATE TABLE skip_me (id int PRIMARY KEY)")
    src.db.execute(
        "CREATE TABLE other.t (id int); ALTER TABLE other.t ADD COLUMN c int; DROP TABLE other.t;"
        " ALTER TABLE skip_me ADD COLUMN c int; CREATE INDEX ON skip_me (c); CREATE TEMP TABLE tmp (id int);"
        " CREATE PUBLICATION elsewhere; CREATE TABLE skipped_too (id int)"
    )
    assert src.events() == []
    assert "public.skipped_too" not in src.published()


def test_drops_name_the_dropped_objects_and_their_table(source: Source) -> None:
    source.db.execute("ALTER TABLE t DROP COLUMN v")
    source.db.execute("DROP TABLE t")
    column, table = source.events()
    assert column.tag == "ALTER TABLE"
    assert column.objects == (
        _obj("table", "public.t", "public.t"),
        _obj("table column", "public.t.v", "public.t", dropped=True),
    )
    assert table.tag == "DROP TABLE" and table.n == 1
    assert table.objects == (_obj("table", "public.t", "public.t", dropped=True),)
    assert table.dropped_tables == ("public.t",) and table.tables == frozenset({"public.t"})


def test_an_application_role_s_create_table_joins_the_publication_with_its_rows(
    pair: ReplicationPair,
) -> None:
    """DDL by a role that is no superuser (the worker function runs as the installer): the table is published
    inside the same transaction, so its rows inserted right after CREATE TABLE are decoded."""
    role = f"app_{pair.name}"[:63]
    pair.publisher.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        pair.publisher.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(role)))
        src = _source(pair, Selection())
        with src.db.as_user(role).connect(autocommit=False) as conn:
            conn.execute("CREATE TABLE app_t (id int PRIMARY KEY, v text)")
            conn.execute("INSERT INTO app_t SELECT g, 'x' FROM generate_series(1, 3) g")
            conn.commit()
        changes = src.changes()
    finally:
        drop_role(pair.publisher, role)
    (event,) = [c for c in changes if isinstance(c, DdlEvent)]
    assert event.tag == "CREATE TABLE" and event.created_tables == ("public.app_t",)
    assert src.published() == {"public.app_t": MAIN}
    (rel,) = [c for c in changes if isinstance(c, Relation)]
    assert (rel.namespace, rel.relname) == ("public", "app_t")
    inserts = [c for c in changes if isinstance(c, Insert)]
    assert len(inserts) == 3 and {i.relid for i in inserts} == {rel.relid}
    assert changes.index(event) < changes.index(rel)


def test_a_keyless_table_is_published_insert_only_until_it_gets_a_key(source: Source) -> None:
    with source.db.connect(autocommit=False) as conn:
        conn.execute("CREATE TABLE k (a int NOT NULL)")
        conn.execute("INSERT INTO k VALUES (1)")
        conn.commit()
    assert source.published()["public.k"] == INS
    source.db.execute("UPDATE k SET a = 2")  # the source keeps taking every write
    source.db.execute("ALTER TABLE k ADD PRIMARY KEY (a)")
    assert source.published()["public.k"] == MAIN
    source.db.execute("ALTER TABLE k DROP CONSTRAINT k_pkey")  # without its key, insert-only again
    assert source.published()["public.k"] == INS
    source.db.execute("DELETE FROM k")
    assert [c.relid for c in source.changes() if isinstance(c, Insert)] != []
    tags = [e.tag for e in source.events()]
    assert tags == ["CREATE TABLE", "ALTER TABLE", "ALTER TABLE"]


def test_a_partition_goes_with_its_root(pair: ReplicationPair) -> None:
    """A new partition of a covered tree is covered by its root's name and published as itself (its leaves are
    what the migration publishes); a partitioned table of another name is not."""
    src = _source(
        pair,
        Selection(tables=("public.tree",)),
        "CREATE TABLE tree (id int PRIMARY KEY) PARTITION BY RANGE (id)",
    )
    src.db.execute(
        "CREATE TABLE tree_1 PARTITION OF tree FOR VALUES FROM (0) TO (10); INSERT INTO tree VALUES (1)"
    )
    src.db.execute("CREATE TABLE other_tree (id int) PARTITION BY RANGE (id)")
    (event,) = src.events()
    assert event.created_tables == ("public.tree_1",), src.events()
    assert src.published() == {"public.tree_1": MAIN}


def test_installing_twice_is_harmless_and_removing_leaves_nothing(pair: ReplicationPair) -> None:
    db = pair.publisher
    two = [f"{pair.name[:30]}_a", f"{pair.name[:30]}_b"]
    with db.connect() as conn:
        for slot in two:
            capture.install(conn, slot, Selection())
        capture.install(conn, two[0], Selection(schemas=("public",)))  # a resumed start
        assert len(capture.installed(conn, two[0])) == 4
        assert capture.remove(conn, two[0])
        assert capture.installed(conn, two[0]) == [] and len(capture.installed(conn, two[1])) == 4
        conn.execute("CREATE TABLE after_one (id int)")  # the other consumer's capture still works
        assert capture.remove(conn, two[1])
        assert not capture.remove(conn, two[1])  # nothing there: nothing done
    assert db.scalar("SELECT count(*) FROM pg_event_trigger") == 0
    assert db.scalar("SELECT to_regnamespace(%s)", (SCHEMA,)) is None
    assert db.scalar("SELECT count(*) FROM pg_proc WHERE proname LIKE %s", (f"ddl_{pair.name[:30]}%",)) == 0


def test_can_capture_says_why_a_role_may_not(pair: ReplicationPair) -> None:
    db = pair.publisher
    with db.connect() as conn:
        assert capture.can_capture(conn) == (True, "role postgres is a superuser")
    role = f"plain_{pair.name}"[:63]
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        db.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(pair.name), sql.Identifier(role)
            )
        )
        with db.as_user(role).connect() as conn:
            ok, why = capture.can_capture(conn)
            assert not ok and "may not create event triggers" in why and "rds_superuser" in why
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                capture.install(conn, "nope", Selection())
            assert not capture.remove(conn, "nope")  # nothing there: no right needed
    finally:
        drop_role(db, role)
    assert db.scalar("SELECT to_regnamespace(%s)", (SCHEMA,)) is None


NAMES = [
    "t",
    "T",
    "orders",
    "orders_2024",
    "a.b",
    "x*y",
    "my table",
    "ç",
    "[x]",
    "a_b",
    "ab",
    "pg_temp_3",
    "o'brien",
    "a$b",
]
SELECTIONS = [
    Selection(),
    Selection(schemas=("s*",)),
    Selection(tables=("orders*",), exclude_tables=("*_2024",)),
    Selection(tables=("s?.a[_.]b", "T")),
    Selection(schemas=("pg_temp_3", "s1"), tables=("[!o]*",)),
    Selection(tables=("o'*", "a$?", "*[[]*")),
]


@pytest.mark.parametrize("selection", SELECTIONS, ids=str)
def test_the_sql_selection_decides_as_selection_covers(pair: ReplicationPair, selection: Selection) -> None:
    schemas = ["public", "s1", "sx", "pg_temp_3", SCHEMA, "applier", *NAMES]
    pairs = [(s, t) for s in schemas for t in NAMES]
    decide = f"{covers_sql(selection, 'x.s', 'x.t')}, {covers_schema_sql(selection, 'x.s')}".replace(
        "%", "%%"
    )
    query = f"SELECT x.s, x.t, {decide} FROM unnest(%s::text[], %s::text[]) AS x(s, t)"  # noqa: S608
    rows = pair.publisher.query(query, ([s for s, _ in pairs], [t for _, t in pairs]))
    wrong = [(s, t) for s, t, covers, schema in rows
             if covers != selection.covers(s, t) or schema != selection.covers_schema(s)]  # fmt: skip
    assert wrong == []
    assert fnmatch.fnmatchcase("a_b", "a[_.]b")  # the patterns above mean what they say
    assert names("x").end_trigger == "applier_ddl_x"


def test_create_table_as_s_own_rows_come_before_its_event(source: Source) -> None:
    """``CREATE TABLE AS`` writes its rows before ``ddl_command_end`` fires, so they precede the table's joining
    the publication and are not in the stream (the apply copies such a table: payload.py, ``created_tables``);
    rows written after it in the same transaction are."""
    with source.db.connect(autocommit=False) as conn:
        conn.execute("CREATE TABLE c AS SELECT g AS id FROM generate_series(1, 3) g")
        conn.execute("INSERT INTO c VALUES (4)")
        conn.commit()
    changes = source.changes()
    (event,) = [c for c in changes if isinstance(c, DdlEvent)]
    assert event.tag == "CREATE TABLE AS" and event.created_tables == ("public.c",)
    assert source.published()["public.c"] == INS
    assert len([c for c in changes if isinstance(c, Insert)]) == 1
