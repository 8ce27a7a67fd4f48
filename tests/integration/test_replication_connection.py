"""ReplicationConnection against real walsenders: commands, slots, snapshots, the COPY stream, feedback and the
ways a stream ends. Plus the pure START_REPLICATION command builder (behaviour 4), which needs no server."""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from collections.abc import Iterator

import psycopg
import psycopg.sql
import pytest

from applier.decoder import MessageDecoder
from applier.lsn import parse_lsn
from applier.messages import Begin, Commit, Insert, LogicalMessage, PrimaryKeepalive, Relation, XLogData
from applier.replication import (
    LOOPBACK_RECEIVE_BUFFER,
    REPLICATION_SESSION_OPTIONS,
    ReplicationConnection,
    ReplicationConnectionError,
    StreamEnded,
    StreamOptions,
    protocol_version_for,
    receive_buffer_for,
    receive_buffer_setting,
    scrub_conninfo,
    start_replication_command,
)
from applier.testing import Database, running_cluster, wait_until

pytestmark = pytest.mark.core


# --- start_replication_command: pure -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server_version", "proto"),
    [(130012, 1), (140000, 2), (150004, 3), (160000, 4), (180006, 4), (190000, 4)],
)
def test_protocol_version_follows_the_publisher(server_version: int, proto: int) -> None:
    assert protocol_version_for(server_version) == proto
    cmd = start_replication_command("s", 0, StreamOptions(["p"]), server_version)
    assert (
        cmd
        == f"START_REPLICATION SLOT \"s\" LOGICAL 0/0 (proto_version '{proto}', publication_names '\"p\"')"
    )


def test_everything_asked_of_a_pg18_publisher() -> None:
    opts = StreamOptions(["p1", "p2"], streaming="parallel", two_phase=True, origin="none", binary=True)
    assert start_replication_command("sub", parse_lsn("16/B374D848"), opts, 180006) == (
        "START_REPLICATION SLOT \"sub\" LOGICAL 16/B374D848 (proto_version '4', streaming 'parallel', "
        "two_phase 'on', origin 'none', publication_names '\"p1\",\"p2\"', binary 'true')"
    )


def test_pg15_publisher_gets_no_parallel_and_no_origin() -> None:
    opts = StreamOptions(["p"], streaming="parallel", two_phase=True, origin="any", binary=True)
    assert start_replication_command("s", 1, opts, 150010) == (
        "START_REPLICATION SLOT \"s\" LOGICAL 0/1 (proto_version '3', streaming 'on', two_phase 'on', "
        "publication_names '\"p\"', binary 'true')"
    )


def test_pg14_publisher_gets_no_two_phase_and_pg13_only_the_basics() -> None:
    opts = StreamOptions(["p"], streaming="on", two_phase=True, origin="none", binary=True)
    assert start_replication_command("s", 0, opts, 140005) == (
        "START_REPLICATION SLOT \"s\" LOGICAL 0/0 (proto_version '2', streaming 'on', "
        "publication_names '\"p\"', binary 'true')"
    )
    assert start_replication_command("s", 0, opts, 130000) == (
        "START_REPLICATION SLOT \"s\" LOGICAL 0/0 (proto_version '1', publication_names '\"p\"')"
    )


def test_origin_any_is_sent_explicitly_and_streaming_off_is_not_sent() -> None:
    cmd = start_replication_command("s", 0, StreamOptions(["p"], streaming="off", origin="any"), 160000)
    assert "origin 'any'" in cmd
    assert "streaming" not in cmd
    assert "two_phase" not in cmd and "binary" not in cmd


def test_explicit_proto_version_overrides_the_automatic_one() -> None:
    cmd = start_replication_command("s", 0, StreamOptions(["p"], proto_version=2, streaming="on"), 180000)
    assert cmd.startswith("START_REPLICATION SLOT \"s\" LOGICAL 0/0 (proto_version '2', streaming 'on'")


def test_names_with_quotes_are_escaped_twice_and_messages_is_never_asked_for() -> None:
    opts = StreamOptions(
        ['we"ird', "it's", "a,b", "back\\slash"], streaming="on", two_phase=True, binary=True
    )
    cmd = start_replication_command('sl"ot', 0, opts, 180000)
    # identifiers first ("" doubles "), then the whole list as a literal ('' doubles '); backslashes stay literal
    # because the replication grammar has no backslash escapes.
    assert 'SLOT "sl""ot" LOGICAL' in cmd
    assert 'publication_names \'"we""ird","it\'\'s","a,b","back\\slash"\'' in cmd
    assert "messages" not in cmd


def test_stream_options_validate() -> None:
    with pytest.raises(ValueError):
        StreamOptions([])
    with pytest.raises(TypeError):
        StreamOptions("p")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StreamOptions(["p"], streaming="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StreamOptions(["p"], origin="all")  # type: ignore[arg-type]


# --- password scrubbing: pure --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("conninfo", "secret"),
    [
        ("host=h port=5 user=u password=secret dbname=d", "secret"),
        ("host=h password='secret with spaces' dbname=d", "secret"),
        ("postgresql://u:secret@h:5/d?sslmode=disable", "secret"),
        ("host=h password=secret dbname", "secret"),  # malformed: libpq cannot parse it
        ("host=h password=se cret dbname=d", "cret"),  # malformed: where does the password end?
        ("postgresql://u:secret@h:5/d?broken", "secret"),
    ],
)
def test_scrub_conninfo_removes_the_password(conninfo: str, secret: str) -> None:
    scrubbed = scrub_conninfo(conninfo)
    assert secret not in scrubbed
    assert "h" in scrubbed


# --- helpers -------------------------------------------------------------------------------------------------


def _publish_table(db: Database, pubname: str) -> None:
    db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    db.execute(f'CREATE PUBLICATION "{pubname}" FOR TABLE t')


def _current_lsn(db: Database) -> int:
    return parse_lsn(db.scalar("SELECT pg_current_wal_lsn()::text"))


def _read_until(
    rc: ReplicationConnection, stop: int, timeout: float = 30.0
) -> Iterator[tuple[XLogData, LogicalMessage]]:
    """Yield decoded messages until the stream has passed WAL position ``stop``; fail after ``timeout`` seconds.

    Keepalives are answered with write = the position seen (flush 0: nothing confirmed), which is what makes the
    walsender send the next keepalive once it has caught up: the stream's only way to say "that was all".
    """
    decoder = MessageDecoder()
    seen = 0
    deadline = time.monotonic() + timeout
    while seen < stop:
        if time.monotonic() > deadline:
            raise AssertionError(f"stream did not reach {stop:X} within {timeout}s (last seen {seen:X})")
        msg = rc.read(0.5)
        if msg is None:
            rc.send_status(seen, 0, 0, reply_requested=True)
        elif isinstance(msg, XLogData):
            seen = max(seen, msg.data_start)
            yield msg, decoder.decode(msg.payload)
        else:
            seen = max(seen, msg.wal_end)
            rc.send_status(seen, 0, 0)


def _slot(db: Database, name: str) -> dict[str, object] | None:
    rows = db.query(
        "SELECT slot_type, temporary, two_phase, active, confirmed_flush_lsn::text, database"
        " FROM pg_replication_slots WHERE slot_name = %s",
        (name,),
    )
    if not rows:
        return None
    keys = ("slot_type", "temporary", "two_phase", "active", "confirmed_flush_lsn", "database")
    return dict(zip(keys, rows[0], strict=True))


# --- the receive buffer: pure ---------------------------------------------------------------------------------


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"])
def test_a_publisher_on_this_host_gets_a_small_receive_buffer(peer: str) -> None:
    assert receive_buffer_for(peer, None) == LOOPBACK_RECEIVE_BUFFER


@pytest.mark.parametrize(
    "peer", ["10.0.0.5", "192.168.1.20", "2001:db8::1", "fe80::1%eth0", "not-an-address"]
)
def test_a_remote_publisher_keeps_the_kernels_autotuning(peer: str) -> None:
    """A small window across a network would cap throughput at window / round trip."""
    assert receive_buffer_for(peer, None) is None


def test_the_receive_buffer_setting() -> None:
    assert receive_buffer_setting(None) is None and receive_buffer_setting(" ") is None
    assert receive_buffer_setting("0") == 0
    assert receive_buffer_for("127.0.0.1", 0) is None  # 0: the kernel's, even on loopback
    assert receive_buffer_for("10.0.0.5", receive_buffer_setting("262144")) == 262144  # any TCP peer
    assert receive_buffer_for(None, 262144) is None  # a Unix socket: nothing to set
    for bad in ("64k", "-1", "1.5"):
        with pytest.raises(
            ReplicationConnectionError, match=r"APPLIER_RECEIVE_BUFFER must be a number of bytes"
        ):
            receive_buffer_setting(bad)


# --- commands ------------------------------------------------------------------------------------------------


def test_identify_system_and_server_version(pair) -> None:
    db = pair.publisher
    with ReplicationConnection().connect(db.dsn, application_name=pair.name) as rc:
        info = rc.identify_system()
        assert info.systemid == str(db.scalar("SELECT system_identifier FROM pg_control_system()"))
        assert info.timeline == 1
        assert info.dbname == db.name
        assert 0 < info.xlogpos <= _current_lsn(db)
        assert rc.server_version == int(db.scalar("SHOW server_version_num"))


def test_session_is_configured_like_the_native_worker(pair) -> None:
    db = pair.publisher
    with ReplicationConnection().connect(db.dsn, application_name=pair.name, client_encoding="LATIN1") as rc:
        conn = rc.connection
        assert conn.execute("SHOW datestyle").fetchone() == ("ISO, MDY",)
        assert conn.execute("SHOW intervalstyle").fetchone() == ("postgres",)
        assert conn.execute("SHOW extra_float_digits").fetchone() == ("3",)
        assert conn.execute("SHOW client_encoding").fetchone() == ("LATIN1",)
        assert rc.encoding == "iso8859-1"  # for MessageDecoder(encoding=...)
        # a replication=database walsender: the backend type says so
        assert db.scalar("SELECT backend_type FROM pg_stat_activity WHERE pid = %s", (rc.backend_pid,)) == (
            "walsender"
        )
        assert db.scalar(
            "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (rc.backend_pid,)
        ) == (pair.name)


def test_explicit_application_name_and_options_in_the_conninfo_win_over_ours(pair) -> None:
    db = pair.publisher
    dsn = db.cluster.dsn(
        db.name, application_name="mine", options="-c statement_timeout=12345 -c datestyle=SQL"
    )
    with ReplicationConnection().connect(dsn, application_name="fallback") as rc:
        assert db.scalar(
            "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (rc.backend_pid,)
        ) == ("mine")
        conn = rc.connection
        assert conn.execute("SHOW statement_timeout").fetchone() == ("12345ms",)
        # ...but not over the value formats the apply side relies on
        assert conn.execute("SHOW datestyle").fetchone() == ("ISO, MDY",)
    assert REPLICATION_SESSION_OPTIONS.startswith("-c datestyle=ISO")


def _receive_buffer(fd: int) -> int:
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    finally:
        sock.close()


def test_the_replication_socket_gets_the_small_receive_buffer_on_loopback(pair, monkeypatch) -> None:
    """The harness's servers listen on 127.0.0.1. Linux reports twice what was set (its bookkeeping share)."""
    db = pair.publisher
    with psycopg.connect(db.dsn) as plain:
        kernels = _receive_buffer(plain.pgconn.socket)
    monkeypatch.delenv("APPLIER_RECEIVE_BUFFER", raising=False)
    with ReplicationConnection().connect(db.dsn) as rc:
        assert _receive_buffer(rc.connection.pgconn.socket) == 2 * LOOPBACK_RECEIVE_BUFFER != kernels
        assert rc.identify_system().dbname == db.name  # the connection is still libpq's, and works
    monkeypatch.setenv("APPLIER_RECEIVE_BUFFER", "0")
    with ReplicationConnection().connect(db.dsn) as rc:
        assert _receive_buffer(rc.connection.pgconn.socket) == kernels
    monkeypatch.setenv("APPLIER_RECEIVE_BUFFER", "100000")
    with ReplicationConnection().connect(db.dsn) as rc:
        assert _receive_buffer(rc.connection.pgconn.socket) == 200000
    monkeypatch.setenv("APPLIER_RECEIVE_BUFFER", "lots")
    rc = ReplicationConnection()
    with pytest.raises(ReplicationConnectionError, match="APPLIER_RECEIVE_BUFFER"):
        rc.connect(db.dsn)
    assert rc.closed  # refused before connecting


def test_create_and_drop_slots(pair) -> None:
    db = pair.publisher
    with ReplicationConnection().connect(db.dsn) as rc:
        info = rc.create_slot(f"{pair.name}_p")
        assert info.slot_name == f"{pair.name}_p"
        assert info.output_plugin == "pgoutput"
        assert info.snapshot_name is None
        assert 0 < info.consistent_point <= _current_lsn(db)
        assert rc.slot_exists(f"{pair.name}_p")
        assert _slot(db, f"{pair.name}_p") == {
            "slot_type": "logical",
            "temporary": False,
            "two_phase": False,
            "active": False,
            "confirmed_flush_lsn": _lsn_text(info.consistent_point),
            "database": db.name,
        }

        rc.create_slot(f"{pair.name}_2pc", two_phase=True)
        assert _slot(db, f"{pair.name}_2pc")["two_phase"] is True  # type: ignore[index]

        rc.create_slot(f"{pair.name}_tmp", temporary=True)
        assert _slot(db, f"{pair.name}_tmp")["temporary"] is True  # type: ignore[index]

        rc.drop_slot(f"{pair.name}_p")
        rc.drop_slot(f"{pair.name}_2pc", wait=False)
        assert not rc.slot_exists(f"{pair.name}_p")
        assert not rc.slot_exists(f"{pair.name}_2pc")
        with pytest.raises(ReplicationConnectionError, match="already exists"):
            rc.create_slot(f"{pair.name}_tmp")
        # The walsender's error cleanup drops the connection's temporary slots: an exporting tablesync connection
        # must not run a command that can fail.
        assert not rc.slot_exists(f"{pair.name}_tmp")
        rc.create_slot(f"{pair.name}_tmp", temporary=True)
        with pytest.raises(ReplicationConnectionError) as err:
            rc.drop_slot("no_such_slot")
        assert err.value.sqlstate == "42704"
        assert "no_such_slot" in str(err.value)
        rc.create_slot(f"{pair.name}_tmp2", temporary=True)
    # a temporary slot dies with its connection
    wait_until(lambda: _slot(db, f"{pair.name}_tmp2") is None, timeout=10, what="temporary slot to go away")


def _lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def test_exported_snapshot_is_usable_while_the_connection_stays_idle(pair) -> None:
    db = pair.publisher
    _publish_table(db, pair.name)
    db.execute("INSERT INTO t SELECT g, 'before' FROM generate_series(1, 10) g")
    with ReplicationConnection().connect(db.dsn) as rc:
        info = rc.create_slot(pair.name, temporary=True, snapshot="export")
        assert info.snapshot_name
        db.execute("INSERT INTO t SELECT g, 'after' FROM generate_series(11, 15) g")
        db.execute("UPDATE t SET v = 'changed' WHERE id = 1")
        for _ in range(2):  # any number of readers may import it while the exporter is idle
            with db.connect(autocommit=True) as reader:
                reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                reader.execute(f"SET TRANSACTION SNAPSHOT '{info.snapshot_name}'")
                assert reader.execute(
                    "SELECT count(*), count(*) FILTER (WHERE v = 'before') FROM t"
                ).fetchone() == (
                    10,
                    10,
                )
                reader.execute("COMMIT")
        assert db.scalar("SELECT count(*) FROM t") == 15
    # once the exporting connection is gone, the snapshot is too
    with db.connect(autocommit=True) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        # 22023 on PG15/16, 42704 on PG18
        with pytest.raises((psycopg.errors.UndefinedObject, psycopg.errors.InvalidParameterValue)):
            reader.execute(f"SET TRANSACTION SNAPSHOT '{info.snapshot_name}'")


def test_use_snapshot_runs_queries_in_the_slots_snapshot(pair) -> None:
    db = pair.publisher
    _publish_table(db, pair.name)
    db.execute("INSERT INTO t VALUES (1, 'before')")
    with ReplicationConnection().connect(db.dsn) as rc:
        info = rc.create_slot(pair.name, temporary=True, snapshot="use")
        assert info.snapshot_name is None
        db.execute("INSERT INTO t VALUES (2, 'after')")
        assert rc.connection.execute("SELECT count(*) FROM t").fetchone() == (1,)
        rc.connection.execute("COMMIT")
        assert rc.connection.execute("SELECT count(*) FROM t").fetchone() == (2,)


# --- streaming -----------------------------------------------------------------------------------------------


def test_stream_a_small_workload(pair) -> None:
    db = pair.publisher
    _publish_table(db, pair.name)
    with ReplicationConnection().connect(db.dsn, application_name=pair.name) as rc:
        slot = rc.create_slot(pair.name, temporary=True)
        db.execute("INSERT INTO t VALUES (1, 'one'), (2, NULL)")
        stop = _current_lsn(db)
        rc.start_replication(pair.name, slot.consistent_point, StreamOptions([pair.name]))
        assert rc.streaming
        assert db.scalar(
            "SELECT state FROM pg_stat_replication WHERE application_name = %s", (pair.name,)
        ) in ("catchup", "streaming")
        got = list(_read_until(rc, stop))
        with pytest.raises(ReplicationConnectionError, match="streaming"):
            rc.identify_system()

    msgs = [m for _, m in got]
    assert [type(m) for m in msgs] == [Begin, Relation, Insert, Insert, Commit]
    begin, rel, ins1, ins2, commit = msgs
    assert isinstance(begin, Begin) and isinstance(commit, Commit) and isinstance(rel, Relation)
    assert begin.final_lsn == commit.commit_lsn
    assert commit.end_lsn == got[-1][0].data_start  # the Commit XLogData sits at the transaction's end
    assert (rel.namespace, rel.relname, [c.name for c in rel.columns]) == ("public", "t", ["id", "v"])
    assert ins1.relid == ins2.relid == rel.relid  # type: ignore[union-attr]
    assert ins1.new.values == (b"1", b"one")  # type: ignore[union-attr]
    assert ins2.new.kinds == b"tn" and ins2.new.values == (b"2", None)  # type: ignore[union-attr]


def test_publication_names_with_quotes_and_backslashes_reach_pgoutput(pair) -> None:
    """The walsender's grammar has no E'' strings (libpq's PQescapeLiteral would emit one for a backslash): our
    plain quoting is the one that works."""
    db = pair.publisher
    odd = 'back\\slash it\'s "q"'
    db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    with db.connect() as conn:
        conn.execute(psycopg.sql.SQL("CREATE PUBLICATION {} FOR TABLE t").format(psycopg.sql.Identifier(odd)))
    with ReplicationConnection().connect(db.dsn) as rc:
        slot = rc.create_slot(pair.name, temporary=True)
        db.execute("INSERT INTO t VALUES (1, 'x')")
        stop = _current_lsn(db)
        rc.start_replication(pair.name, slot.consistent_point, StreamOptions([odd]))
        assert [type(m) for _, m in _read_until(rc, stop)] == [Begin, Relation, Insert, Commit]


def test_feedback_moves_confirmed_flush_to_exactly_what_we_report(pair) -> None:
    db = pair.publisher
    _publish_table(db, pair.name)
    with ReplicationConnection().connect(db.dsn, application_name=pair.name) as rc:
        slot = rc.create_slot(pair.name)
        db.execute("INSERT INTO t VALUES (1, 'one')")
        db.execute("INSERT INTO t VALUES (2, 'two')")
        stop = _current_lsn(db)
        rc.start_replication(pair.name, slot.consistent_point, StreamOptions([pair.name]))
        commits = [m for _, m in _read_until(rc, stop) if isinstance(m, Commit)]
        assert len(commits) == 2
        first, second = commits[0].end_lsn, commits[1].end_lsn

        def confirmed() -> str:
            return db.scalar("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                             (pair.name,))  # fmt: skip

        for flush in (first, second):
            rc.send_status(second, flush, flush)
            wait_until(
                lambda f=flush: confirmed() == _lsn_text(f), timeout=10, what=f"confirmed_flush {flush:X}"
            )
            assert confirmed() == _lsn_text(flush)
        row = db.query(
            "SELECT write_lsn::text, flush_lsn::text, replay_lsn::text FROM pg_stat_replication"
            " WHERE application_name = %s",
            (pair.name,),
        )
        assert row == [(_lsn_text(second), _lsn_text(second), _lsn_text(second))]
    # a restart resumes after the confirmed position: nothing is sent again (once the old walsender has let go of
    # the slot: it exits only when it notices the closed connection)
    wait_until(
        lambda: db.scalar("SELECT NOT active FROM pg_replication_slots WHERE slot_name = %s", (pair.name,)),
        timeout=30,
        what="the previous walsender to release the slot",
    )
    with ReplicationConnection().connect(db.dsn) as rc:
        rc.start_replication(pair.name, 0, StreamOptions([pair.name]))
        assert not [
            m for _, m in _read_until(rc, _current_lsn(db), timeout=10) if not isinstance(m, Relation)
        ]


def test_keepalive_with_reply_requested_is_answered(pair) -> None:
    """With a 2 s wal_sender_timeout the walsender asks for a reply after 1 s of silence and gives up after 2 s:
    answering keeps the stream alive well past the timeout."""
    db = pair.publisher
    _publish_table(db, pair.name)
    dsn = db.cluster.dsn(db.name, options="-c wal_sender_timeout=2s")
    with ReplicationConnection().connect(dsn, application_name=pair.name) as rc:
        slot = rc.create_slot(pair.name, temporary=True)
        rc.start_replication(pair.name, slot.consistent_point, StreamOptions([pair.name]))
        requested = 0
        last = replied = slot.consistent_point
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            msg = rc.read(0.2)
            if isinstance(msg, PrimaryKeepalive):
                last = max(last, msg.wal_end)  # other tests' WAL moves it on between replies
                if msg.reply_requested:
                    requested += 1
                    rc.send_status(last, last, last)
                    replied = last
        assert requested >= 2
        wait_until(
            lambda: db.query(
                "SELECT reply_time IS NOT NULL, flush_lsn::text FROM pg_stat_replication"
                " WHERE application_name = %s", (pair.name,),
            ) == [(True, _lsn_text(replied))],
            timeout=10, what="the last reply to show in pg_stat_replication",
        )  # fmt: skip


def test_stream_ended_when_the_walsender_is_terminated(pair) -> None:
    db = pair.publisher
    _publish_table(db, pair.name)
    with ReplicationConnection().connect(db.dsn, application_name=pair.name) as rc:
        slot = rc.create_slot(pair.name, temporary=True)
        rc.start_replication(pair.name, slot.consistent_point, StreamOptions([pair.name]))
        rc.read(1.0)  # let the walsender settle into streaming
        assert db.scalar("SELECT pg_terminate_backend(%s)", (rc.backend_pid,)) is True
        started = time.monotonic()
        with pytest.raises(StreamEnded) as err:
            while time.monotonic() - started < 10:
                rc.read(0.5)
        assert time.monotonic() - started < 5
        assert "terminating connection due to administrator command" in str(err.value)
        assert err.value.sqlstate == "57P01"
        with pytest.raises(StreamEnded):  # and it stays ended
            rc.read(0.1)


def test_connection_drop_is_a_replication_connection_error(pair) -> None:
    """The socket dies without a word from the server (a network cut): a clear error, not a hang."""
    db = pair.publisher
    _publish_table(db, pair.name)
    with _TcpProxy(db.cluster.port) as proxy:
        dsn = db.cluster.dsn(db.name, port=str(proxy.port))
        with ReplicationConnection().connect(dsn, application_name=pair.name) as rc:
            slot = rc.create_slot(pair.name, temporary=True)
            rc.start_replication(pair.name, slot.consistent_point, StreamOptions([pair.name]))
            rc.read(0.5)
            proxy.cut()
            started = time.monotonic()
            with pytest.raises(ReplicationConnectionError) as err:
                while time.monotonic() - started < 10:
                    rc.read(0.5)
            assert not isinstance(err.value, StreamEnded)
            assert "lost" in str(err.value)
            assert time.monotonic() - started < 5


def test_stream_ended_when_the_publisher_shuts_down() -> None:
    """A fast shutdown: the walsender waits for us to confirm everything it sent, then ends the COPY."""
    with running_cluster(None, name="shutdown") as cluster:
        cluster.execute("CREATE TABLE t (id int PRIMARY KEY)")
        cluster.execute("CREATE PUBLICATION p FOR TABLE t")
        with ReplicationConnection().connect(cluster.dsn()) as rc:
            slot = rc.create_slot("s")
            rc.start_replication("s", slot.consistent_point, StreamOptions(["p"]))
            stopper = threading.Thread(target=cluster.stop, daemon=True)
            stopper.start()
            last = slot.consistent_point
            started = time.monotonic()
            with pytest.raises(
                StreamEnded, match="walsender finished .COPY 0.; is the publisher shutting down"
            ):
                while time.monotonic() - started < 30:
                    msg = rc.read(0.5)
                    if msg is not None:
                        last = max(last, msg.wal_end)
                        rc.send_status(last, last, last)
            stopper.join(30)
            assert not stopper.is_alive()


def test_connect_errors_never_show_the_password() -> None:
    port = _unused_port()
    for conninfo in (
        f"host=127.0.0.1 port={port} user=postgres password=secret dbname=x connect_timeout=5",
        f"postgresql://postgres:secret@127.0.0.1:{port}/x",
    ):
        with pytest.raises(ReplicationConnectionError) as err:
            ReplicationConnection().connect(conninfo, application_name="x")
        shown = "".join(traceback.format_exception(err.value))
        assert "secret" not in shown, shown
        assert "127.0.0.1" in shown and str(port) in shown  # still says where it tried
    # malformed: libpq quotes a piece of the string it choked on ("missing "=" after "cret"")
    for conninfo in ("host=127.0.0.1 password='se cret' dbname", "host=127.0.0.1 password=se cret dbname=x"):
        with pytest.raises(ReplicationConnectionError, match="invalid publisher connection string") as err:
            ReplicationConnection().connect(conninfo)
        shown = "".join(traceback.format_exception(err.value))
        assert "cret" not in shown, shown


def test_commands_need_a_connection() -> None:
    rc = ReplicationConnection()
    with pytest.raises(ReplicationConnectionError, match="not open"):
        rc.identify_system()
    with pytest.raises(ReplicationConnectionError, match="start_replication"):
        rc.read(0)
    rc.close()  # harmless


# --- test plumbing -------------------------------------------------------------------------------------------


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TcpProxy:
    """A byte-forwarding TCP proxy whose connections can be cut: a network failure without a server error."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> _TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._socks.clear()
