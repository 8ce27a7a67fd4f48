"""``migrate start``'s set-up: the migration's row, the publication, the slot and its exported snapshot, the
pre-data and the post-data steps read at that snapshot, the subscription's catalog rows, then the copy at the same
snapshot with post-data built as each table lands.

Apart from following (:mod:`applier.migrate.follow`) because the two share nothing but the stop event and the
migration's name: each step here is resumable from the migration's phase (see :mod:`applier.migrate.start`), and a
start resumed after the copy skips this module's work entirely.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from applier.catalog import sql as catalog_sql
from applier.conninfo import describe, without_password
from applier.lsn import format_lsn
from applier.migrate import (
    ddl_capture,
    identity,
    knobs,
    largeobjects,
    matviews,
    objects,
    ownership,
    partitions,
    postdata,
    preflight,
    schema,
    store,
)
from applier.migrate import publications as pubs
from applier.migrate.follow import outcome
from applier.migrate.selection import SourceTables
from applier.migrate.state import MigrationError, Phase
from applier.migrate.steps import Step
from applier.migrate.survey import source_tables
from applier.migrate.tools import find_dump_tools
from applier.replication import TWO_PHASE_VERSION, ReplicationConnection, ReplicationConnectionError

if TYPE_CHECKING:
    from applier.migrate.start import StartOptions
    from tablesync.initial import InitialCopy

__all__ = ["SetUp"]


def _quoted(src: psycopg.Connection[Any], names: list[tuple[str, str]]) -> list[str]:
    return [
        r[0]
        for r in src.execute(
            "SELECT format('%%I.%%I', s, t) FROM unnest(%s::text[], %s::text[]) AS x(s, t)",
            ([s for s, _ in names], [t for _, t in names]),
        )
    ]


def _event_triggers(src: psycopg.Connection[Any], superuser: bool) -> tuple[list[Step], list[str]]:
    """The source's event triggers as steps, or none and why for a target role that is not a superuser (only a
    superuser creates event triggers)."""
    triggers = objects.event_triggers(src)
    if not triggers or superuser:
        return triggers, []
    names = ", ".join(t.step for t in triggers)
    return [], [
        f"{len(triggers)} event trigger(s) skipped: only a superuser creates them on the target ({names})"
    ]


def _import_the_apply_loop() -> None:
    """Import ``applier run``'s modules and start the fork server its worker will start from
    (:func:`applier.runner.prefork`), in a thread while the last builds run (this process then waits on the
    target), not after them: following began with a 0.3-0.5 s import here and a 1.2-1.5 s one in the spawned
    worker, both on the critical path. Not earlier: the driver's copy shares this process's interpreter."""

    def warm_up() -> None:
        from applier import runner

        runner.prefork()

    threading.Thread(target=warm_up, name="warm-up", daemon=True).start()


def two_phase_from_the_start(target: str, subname: str, say: Callable[[str], None]) -> bool:
    """When two-phase is pending and every table was copied at the slot's own snapshot
    (:func:`state.twophase.ready_at_slot_snapshot`, which says why that is safe), make every table ``r`` and
    two-phase ``e`` in one transaction, so that the apply worker's first stream already decodes prepared
    transactions at PREPARE and needs no restart to enable it (behaviour 57's). True when it did."""
    from applier.catalog.store import Catalog
    from state.tables import SyncState
    from state.twophase import TwoPhaseState, ready_at_slot_snapshot

    catalog = Catalog.connect(target)
    try:
        with catalog.engine.begin() as c:
            sub = catalog.get(subname, conn=c)
            if sub is None or sub.subtwophasestate is not TwoPhaseState.PENDING:
                return False
            tables = catalog.table_states(sub.subid, conn=c)
            if not ready_at_slot_snapshot([(t.state, t.lsn) for t in tables], sub.subslotconsistentlsn):
                return False
            for t in tables:
                catalog.set_table_state(sub.subid, t.relid, SyncState.READY, t.lsn, conn=c)
            catalog.update_subscription(sub.subid, c, subtwophasestate=TwoPhaseState.ENABLED)
        say("every table was copied at the slot's snapshot: all ready, two-phase on from the stream's start")
        return True
    finally:
        catalog.engine.dispose()


class SetUp:
    """One ``start``'s set-up: the steps as methods, sharing the target connection, the held snapshot and the stop
    event (a signal, or the migration ended from another shell)."""

    def __init__(self, opts: StartOptions, say: Callable[[str], None], stop: threading.Event) -> None:
        self.opts = opts
        self.say = say
        self.stop = stop
        self.times: dict[str, float] = {}
        self.target = psycopg.connect(opts.target, autocommit=True)
        self.slot_conn: ReplicationConnection | None = None
        self.snapshot: str | None = None
        self.snapshot_lsn: int | None = None
        self.skipped: list[str] = []  # what a target without superuser cannot have (said, and in the record)

    # --- bookkeeping ------------------------------------------------------------------------------------------
    def migration(self) -> store.Migration:
        m = store.load(self.target, self.opts.name)
        assert m is not None
        return m

    def phase(self, phase: Phase, **seconds: float) -> None:
        store.set_phase(self.target, self.opts.name, phase, seconds=seconds)
        self.say(f"phase {phase}")

    def register(self, tables: SourceTables) -> store.Migration:
        """The migration's row: new, or the same migration again (same source and selection)."""
        from applier.catalog.store import Catalog

        catalog = Catalog.connect(self.opts.target)
        try:
            catalog.ensure()
        finally:
            catalog.engine.dispose()
        source = without_password(self.opts.source, "source")
        selection = self.opts.selection.to_json()
        store.register(self.target, self.opts.name, source, selection)
        m = self.migration()
        if m.source != source or m.selection != selection:
            raise MigrationError(
                f'migration "{self.opts.name}" exists on this target with another source or selection '
                f"({describe(m.source)}, {m.selection})"
            )
        return m

    # --- the source -------------------------------------------------------------------------------------------
    def publication(self, m: store.Migration, tables: SourceTables) -> None:
        """Create the migration's publications of the selected tables (once; the same table lists when started
        again before the copy is over; after it, a start that resumes leaves them as they are): the tables without
        a usable replica identity in an insert-only one, so that the source keeps taking every write (publications);
        then the DDL capture, before the slot (:mod:`applier.migrate.ddl_capture`)."""
        with psycopg.connect(self.opts.source, autocommit=True) as src:
            split = pubs.create(src, self.target, m, tables.tables)
        ddl_capture.install(
            self.opts.source, self.target, self.migration(), self.opts.selection, self.opts.ddl, self.say
        )
        if split is None:
            return
        main, ins = pubs.names(m.name)
        self.say(f"publication {main}: {len(split.full)} table(s)")
        if split.insert_only:
            listed = ", ".join(f"{s}.{t}" for s, t in split.insert_only)
            self.say(
                f"publication {ins}: {len(split.insert_only)} table(s) without a primary key or usable replica "
                f"identity, published for INSERT and TRUNCATE only (their UPDATE/DELETE are not migrated; the "
                f"cutover copies such a table again if it gets any): {listed}"
            )

    def fresh_slot(self, m: store.Migration) -> None:
        """(Re)create the slot with an exported snapshot; keep its connection idle while the snapshot is used."""
        try:
            conn = ReplicationConnection.open(self.opts.source, application_name=f"{m.name}_migrate")
        except ReplicationConnectionError as exc:
            raise MigrationError(f"cannot open a replication connection to the source: {exc}") from exc
        try:
            if m.slot_created:
                with psycopg.ClientCursor(conn.connection) as cur:  # walsenders: simple protocol only
                    cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (m.slot,))
                    rows = cur.fetchall()
                if rows:
                    conn.drop_slot(m.slot)
                    self.say(f"slot {m.slot} of an interrupted start dropped")
            store.mark_slot_created(self.target, m.name)
            info = conn.create_slot(m.slot, snapshot="export")
        except BaseException:
            conn.close()
            raise
        self.slot_conn = conn
        self.snapshot = info.snapshot_name
        self.snapshot_lsn = info.consistent_point
        self.say(
            f"slot {m.slot} created at {format_lsn(info.consistent_point)}, snapshot {info.snapshot_name}"
        )

    # --- schema -----------------------------------------------------------------------------------------------
    def pre_data(self, m: store.Migration, tables: SourceTables) -> None:
        """Pre-data, the post-data steps and the large objects, read at the snapshot; applied in one target
        transaction (a kill leaves all of it or none)."""
        started = time.monotonic()
        src = psycopg.connect(self.opts.source, autocommit=False)
        try:
            src.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            src.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(self.snapshot)))
            src.execute("SET LOCAL search_path = ''")
            quoted = _quoted(src, tables.tables)
            steps, notes = postdata.definitions(src, quoted)
            steps += self.object_steps(src, tables, quoted, steps)
            parents = set(_quoted(src, tables.partitioned))
            notes = [n for n in notes if n.references not in parents]  # partitions.steps makes those
            tools, found = find_dump_tools(self._source_major())
            if tools is None:
                raise MigrationError("no pg_dump new enough for the source (see applier migrate plan)")
            settings = [r[0] for r in self.target.execute("SELECT name FROM pg_settings")]
            script = schema.dump_pre_data(
                tools, self.opts.source, self.snapshot, tables.schemas, tables.exclude, settings
            )
            script, dropped = schema.without_unrestorable(
                script, schema.read_target_roles(self.target), schema.default_public_owner(src)
            )
            skipped = [*dropped, *self.skipped]
            with self.target.transaction():
                self.target.execute(script)
                self.target.execute("SET search_path TO DEFAULT")
                always = identity.by_default_until_cutover(
                    self.target, [*quoted, *_quoted(src, tables.partitioned)]
                )
                store.save_steps(self.target, m.name, [*steps, *always])
                los = largeobjects.copy(src, self.target) if largeobjects.selected(m.selection) else 0
                store.set_snapshot_lsn(self.target, m.name, self.snapshot_lsn or 0)
                if skipped:
                    store.add_notes(self.target, m.name, {"skipped": skipped})
        finally:
            src.close()
        for note in [*tables.skipped, *notes]:
            self.say(f"note: {note}")
        for line in skipped:
            self.say(f"WARNING: {line}")
        self.times["schema"] = time.monotonic() - started
        self.say(
            f"pre-data restored with {tools.pg_dump} ({tools.major}); {len(steps)} post-data step(s) planned, "
            f"{los} large object(s) copied ({self.times['schema']:.1f}s)"
        )

    def object_steps(
        self, src: psycopg.Connection[Any], tables: SourceTables, quoted: list[str], steps: list[Step]
    ) -> list[Step]:
        """The post-data steps of the partitioned tables, materialized views, rules, policies and statistics objects
        (their own modules say how)."""
        extra = partitions.steps(src, _quoted(src, tables.partitioned), quoted, steps, len(steps))
        extra += matviews.steps(src, tables.schemas, quoted, len(steps) + len(extra))
        extra += objects.steps(
            src, tables.schemas, tables.exclude, quoted, [*steps, *extra], len(steps) + len(extra)
        )
        if self.opts.selection.schemas or self.opts.selection.tables:
            return extra
        triggers, skipped = _event_triggers(src, schema.read_target_roles(self.target).superuser)
        self.skipped += skipped
        return extra + triggers

    def _source_major(self) -> int:
        with psycopg.connect(self.opts.source, autocommit=True) as src:
            return int(src.execute("SHOW server_version_num").fetchone()[0]) // 10000  # type: ignore[index]

    def _gid_format(self) -> str:
        """``original`` (prepared transactions keep the source's GIDs, what ``cutover --prepared carry`` needs),
        unless the source and the target are one cluster, where a GID exists once: there the target's copy could
        never be prepared while the source's is, so the subscription names them ``pg_gid_<subid>_<xid>``."""
        query = "SELECT system_identifier::text FROM pg_control_system()"
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.opts.source, autocommit=True) as src:
            if src.execute(query).fetchone() == self.target.execute(query).fetchone():
                self.say(
                    "note: the source and the target are one cluster: --prepared carry will not be possible"
                )
                return "subscription"
        return "original"

    def subscription(self, m: store.Migration, tables: list[str]) -> None:
        """The subscription's catalog rows (every table ``i``, two-phase pending until all are ready, or off from a
        PostgreSQL 14 source), using the slot made above; one left by an interrupted start is replaced."""
        from applier.catalog.store import Catalog
        from state.tables import initial_sync_state
        from state.twophase import initial_two_phase

        catalog = Catalog.connect(self.opts.target)
        try:
            old = catalog.get(m.subname)
            if old is not None:
                catalog.delete_subscription(old.subid)
            # two-phase decoding needs a source of 15 or later; from 14, prepared transactions arrive at COMMIT
            # PREPARED as ordinary ones, and the cutover cannot carry them (applier.migrate.cutover)
            decodes_prepared = self._source_major() >= TWO_PHASE_VERSION // 10000
            two_phase, _ = initial_two_phase(decodes_prepared, True, False, has_tables=bool(tables))
            sub = catalog.create_subscription(
                subname=m.subname,
                conninfo=m.source,
                publications=pubs.names(m.name),  # both exist: made together just before
                two_phase_state=two_phase.value,
                streaming="on",
                binary=False,
                disable_on_error=False,
                origin="any",
                slot_name=m.slot,
                enabled=True,
                copy_data=True,
                gid_format=self._gid_format(),
                ddl=ddl_capture.captured(m),
            )
            with catalog.engine.begin() as c:
                for name in tables:
                    relid = c.exec_driver_sql("SELECT %(n)s::regclass::oid::int8", {"n": name}).scalar_one()
                    catalog.add_table(sub.subid, relid, name, initial_sync_state(True).value, conn=c)
            catalog.update_subscription(sub.subid, subslotconsistentlsn=self.snapshot_lsn)
        finally:
            catalog.engine.dispose()

    # --- copy and post-data ------------------------------------------------------------------------------------
    def copied(self, conn: psycopg.Connection[Any]) -> set[str]:
        """The tables whose copy is finished (read through ``conn``, polled a few times a second)."""
        return {r[0] for r in conn.execute(catalog_sql.SUBSCRIPTION_COPIED_TABLE_NAMES, (self.opts.name,))}

    def source_pages(self, steps: list[Step]) -> dict[str, int]:
        """Each table's size in pages on the source (now, not at the snapshot: an estimate that orders the work)."""
        tables = sorted({r for s in steps for r in s.relnames})
        with psycopg.connect(self.opts.source, autocommit=True) as src:
            rows = src.execute(
                "SELECT t, pg_relation_size(t::regclass) / current_setting('block_size')::int"
                " FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL",
                (tables,),
            ).fetchall()
        return {t: int(n) for t, n in rows}

    def copy_and_post_data(self, m: store.Migration) -> bool:
        """The copy (this thread) and post-data (a thread, as tables land); True when both completed.

        Critical path first: the copy takes the table with the most work behind it first (its pages plus its
        builds, :func:`postdata.table_weights`) and post-data starts the most expensive ready build first, so the
        biggest table's builds overlap the copy of all the others instead of following it."""
        steps = [s for s in store.load_steps(self.target, m.name) if not s.kind.at_cutover]
        pages = self.source_pages(steps)
        copying = threading.Event()
        copying.set()
        outcome: dict[str, Any] = {}
        thread = self._post_data_thread(m, steps, postdata.step_costs(steps, pages), copying, outcome)
        thread.start()
        started = time.monotonic()
        copier = self._copier(m, postdata.table_weights(steps, pages))
        master = None if knobs.spark_remote() else f"local[{max(1, self.opts.table_jobs)},4]"
        try:
            result = copier.run(spark_master=master)
        finally:
            self.slot_conn = None  # closed by the copy: the snapshot is over
            copying.clear()
        self.times["copy"] = time.monotonic() - started
        self.say(f"copy: {result} ({self.times['copy']:.1f}s)")
        _import_the_apply_loop()
        thread.join()
        if "error" in outcome:
            raise MigrationError(f"post-data failed: {outcome['error']}") from outcome["error"]
        self.times["post-data"] = outcome.get("seconds", 0.0)
        if result.stopped or self.stop.is_set():
            return False
        if not outcome.get("ok"):
            raise MigrationError("post-data could not finish: a step waits for a table that was not copied")
        return True

    def _post_data_thread(
        self,
        m: store.Migration,
        steps: list[Step],
        cost: dict[str, float],
        copying: threading.Event,
        outcome: dict[str, Any],
    ) -> threading.Thread:
        """The post-data thread (not started): it runs the steps as their tables land while ``copying`` is set,
        and leaves in ``outcome`` whether all ran (``ok``), its error (which stops the copy too) and its time."""

        def post() -> None:
            started = time.monotonic()
            try:
                with psycopg.connect(self.opts.target, autocommit=True) as conn:
                    outcome["ok"] = postdata.run_steps(
                        self.opts.target,
                        m.name,
                        steps,
                        lambda: self.copied(conn),
                        jobs=self.opts.index_jobs,
                        copy_running=copying.is_set,
                        stop=self.stop,
                        say=self.say,
                        cost=cost,
                    )
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                outcome["error"] = exc
                self.stop.set()
            outcome["seconds"] = time.monotonic() - started

        return threading.Thread(target=post, name="postdata", daemon=True)

    def _copier(self, m: store.Migration, weights: dict[str, float]) -> InitialCopy:
        """The initial copy, at the migration's own snapshot when this run holds it (a resumed run takes a new
        one), the heaviest table first (``weights``), with a driver head start as wide as ``--table-jobs``."""
        from tablesync.initial import ExportedSnapshot, InitialCopy
        from tablesync.progress import CopyProgress

        held = None
        if self.slot_conn is not None and self.snapshot is not None:
            held = ExportedSnapshot(self.slot_conn, m.slot, self.snapshot_lsn or 0, self.snapshot)
        partition = knobs.partition_bytes()
        kwargs: dict[str, Any] = {"partition_bytes": partition} if partition else {}
        return InitialCopy(
            self.opts.target,
            m.subname,
            stop=self.stop,
            reporter=CopyProgress.for_setting(None),
            snapshot=held,
            weights=weights,
            head_start=max(1, self.opts.table_jobs),
            **kwargs,
        )

    # --- all --------------------------------------------------------------------------------------------------
    def run(self) -> store.Migration | int:
        """Every set-up step the migration's phase has not passed; the migration to follow, or start's exit status
        when it ends here (done already, or stopped during the copy)."""
        preflight.check_source_password(self.opts.source)
        with psycopg.connect(self.opts.source, autocommit=True) as src:
            tables = source_tables(src, self.opts.selection)
        if not tables.tables:
            raise MigrationError("the selection covers no table on the source (see applier migrate plan)")
        known = store.load(self.target, self.opts.name)
        if known is None or (known.phase is Phase.SCHEMA and known.snapshot_lsn is None):
            preflight.check(self.opts)
        m = self.register(tables)
        if m.phase is Phase.DONE:
            self.say(f'migration "{m.name}" is done')
            return 0
        if m.phase is Phase.FAILED:
            raise MigrationError(f'migration "{m.name}" failed: {m.error}; abort it (applier migrate abort)')
        m = ownership.recover(self.target, m, self.say)
        if (m.error or "").startswith(preflight.START_FAILED):
            store.record_error(self.target, m.name, None)
        if m.phase is Phase.SCHEMA:
            try:
                m = self.schema(m, tables)
            except Exception as exc:
                if not self.stop.is_set():
                    self.undo(m, exc)
                    raise
                # a signal to the process group stopped pg_dump too: a stop, not a failure
                self.undo(m, None)
                return outcome(self.target, self.opts.name, 0, self.say)
            except BaseException as exc:
                self.undo(m, exc)
                raise
        else:
            self.publication(m, tables)
        if m.phase is Phase.COPY:
            if not self.copy_and_post_data(m):
                return outcome(self.target, self.opts.name, 0, self.say)
            two_phase_from_the_start(self.opts.target, m.subname, self.say)
            self.phase(Phase.FOLLOWING, **{k: v for k, v in self.times.items() if k != "schema"})
        return m

    def schema(self, m: store.Migration, tables: SourceTables) -> store.Migration:
        """Phase ``schema``: the publication, the slot and its snapshot, the pre-data, the subscription; the
        migration in phase ``copy`` after it."""
        started = time.monotonic()
        self.publication(m, tables)
        self.fresh_slot(self.migration())
        m = self.migration()
        if m.snapshot_lsn is None:
            self.pre_data(m, tables)
        else:
            self.say("pre-data restored by an interrupted start; copying at a new snapshot")
        quoted = [
            r[0]
            for r in self.target.execute(
                "SELECT format('%%I.%%I', s, t) FROM unnest(%s::text[], %s::text[]) AS x(s, t)",
                ([s for s, _ in tables.tables], [t for _, t in tables.tables]),
            )
        ]
        self.subscription(m, quoted)
        self.phase(Phase.COPY, schema=time.monotonic() - started)
        return self.migration()

    def undo(self, m: store.Migration, exc: BaseException | None) -> None:
        """After a failure (``exc``) or a stop (None) in phase ``schema``: the held snapshot released, then what
        this start created on the source taken back (:func:`applier.migrate.preflight.undo`)."""
        if self.slot_conn is not None:
            with contextlib.suppress(Exception):
                self.slot_conn.close()
            self.slot_conn = None
        preflight.undo(self.target, self.opts.source, m, exc, self.say)

    def close(self) -> None:
        """Release the held snapshot (when the copy did not take it over) and the target connection."""
        if self.slot_conn is not None:
            with contextlib.suppress(Exception):
                self.slot_conn.close()
        self.target.close()
