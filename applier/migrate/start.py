"""``applier migrate start``: publication and slot on the source, pre-data at the slot's exported snapshot, the
data copy at that same snapshot (the existing tablesync), post-data as each table lands, then the apply loop in
the foreground until a cutover completes.

One snapshot: the subscription's slot is created with ``SNAPSHOT 'export'`` at point X, the pre-data dump and
the post-data definitions are read in snapshot S, and the copy imports S too (its tables become ``s`` at X); the
stream then starts at X, so nothing between the schema, the rows and the stream can differ.

Resumable at every step (state in ``applier.migration``/``migration_step``):

- killed before the pre-data committed: the slot made for it is dropped and everything starts again (the
  pre-data commits in one target transaction with the post-data steps, so it is all there or not at all);
- killed after, before the subscription existed: a new slot and snapshot; the copy runs at the new snapshot (the
  schema is the one dumped before; DDL on the source in between is not supported, as always);
- killed during the copy: finished tables stay (``f`` settles to ``s``), unfinished ones are emptied and copied
  again at a new snapshot by the tablesync's own resume; post-data steps already built stay built;
- killed while following: the apply loop resumes from its replication origin, exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from applier.catalog import sql as catalog_sql
from applier.conninfo import describe, without_password
from applier.lsn import format_lsn
from applier.migrate import largeobjects, matviews, objects, partitions, postdata, schema, store
from applier.migrate.selection import Selection, SourceTables
from applier.migrate.state import MigrationError
from applier.migrate.steps import Step, StepKind
from applier.migrate.survey import source_tables
from applier.migrate.tools import find_dump_tools
from applier.replication import ReplicationConnection, ReplicationConnectionError
from applier.signals import set_once

if TYPE_CHECKING:
    from tablesync.initial import InitialCopy

__all__ = ["CAUGHT_UP_BYTES", "StartOptions", "start"]

#: ``start --cutover`` cuts over once every table is ready and the apply is this close to the source's position.
CAUGHT_UP_BYTES = 1 << 20


@dataclass(frozen=True)
class StartOptions:
    name: str
    source: str
    target: str
    selection: Selection
    table_jobs: int = 2
    index_jobs: int = 2
    cutover: bool = False


class _Runner:
    """One ``start``: the steps as methods, sharing connections and the stop event."""

    def __init__(self, opts: StartOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.stop = threading.Event()
        self.times: dict[str, float] = {}
        self.target = psycopg.connect(opts.target, autocommit=True)
        self.slot_conn: ReplicationConnection | None = None
        self.snapshot: str | None = None
        self.snapshot_lsn: int | None = None
        self.auto_error: str | None = None

    # --- bookkeeping ------------------------------------------------------------------------------------------
    def migration(self) -> store.Migration:
        m = store.load(self.target, self.opts.name)
        assert m is not None
        return m

    def phase(self, phase: str, **seconds: float) -> None:
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
        """Create the publication of the selected tables (once; the same table list when started again before
        the copy is over; after it, a start that resumes leaves it as it is)."""
        with psycopg.connect(self.opts.source, autocommit=True) as src:
            exists = src.execute(
                "SELECT 1 FROM pg_publication WHERE pubname = %s", (m.publication,)
            ).fetchone()
            names = sql.SQL(", ").join(sql.Identifier(s, t) for s, t in tables.tables)
            if exists and not m.pub_created:
                raise MigrationError(
                    f'a publication "{m.publication}" already exists on the source and was not made by this '
                    "migration: choose another migration name"
                )
            if exists and m.phase not in ("schema", "copy"):
                return  # its tables are settled; a cutover may have fenced the source already (read-only)
            store.mark_publication_created(self.target, m.name)
            if exists:
                src.execute(
                    sql.SQL("ALTER PUBLICATION {} SET TABLE {}").format(sql.Identifier(m.publication), names)
                )
            else:
                src.execute(
                    sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(m.publication), names)
                )
        self.say(f"publication {m.publication}: {len(tables.tables)} table(s)")

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
            quoted = self._quoted(src, tables.tables)
            steps, notes = postdata.definitions(src, quoted)
            steps += self.object_steps(src, tables, quoted, steps)
            parents = set(self._quoted(src, tables.partitioned))
            notes = [n for n in notes if n.references not in parents]  # partitions.steps makes those
            tools, found = find_dump_tools(self._source_major())
            if tools is None:
                raise MigrationError("no pg_dump new enough for the source (see applier migrate plan)")
            settings = [r[0] for r in self.target.execute("SELECT name FROM pg_settings")]
            script = schema.dump_pre_data(
                tools, self.opts.source, self.snapshot, tables.schemas, tables.exclude, settings
            )
            with self.target.transaction():
                self.target.execute(script)
                self.target.execute("SET search_path TO DEFAULT")
                always = self.identity_always([*quoted, *self._quoted(src, tables.partitioned)])
                store.save_steps(self.target, m.name, [*steps, *always])
                los = largeobjects.copy(src, self.target) if largeobjects.selected(m.selection) else 0
                store.set_snapshot_lsn(self.target, m.name, self.snapshot_lsn or 0)
        finally:
            src.close()
        for note in [*tables.skipped, *notes]:
            self.say(f"note: {note}")
        self.times["schema"] = time.monotonic() - started
        self.say(f"pre-data restored with {tools.pg_dump} ({tools.major}); {len(steps)} post-data step(s) planned, "
                 f"{los} large object(s) copied ({self.times['schema']:.1f}s)")  # fmt: skip

    @staticmethod
    def _quoted(src: psycopg.Connection[Any], names: list[tuple[str, str]]) -> list[str]:
        return [r[0] for r in src.execute(
            "SELECT format('%%I.%%I', s, t) FROM unnest(%s::text[], %s::text[]) AS x(s, t)",
            ([s for s, _ in names], [t for _, t in names]),
        )]  # fmt: skip

    def object_steps(
        self,
        src: psycopg.Connection[Any],
        tables: SourceTables,
        quoted: list[str],
        steps: list[Step],
    ) -> list[Step]:
        """The post-data steps of the partitioned tables, materialized views, rules, policies and statistics objects
        (their own modules say how)."""
        extra = partitions.steps(src, self._quoted(src, tables.partitioned), quoted, steps, len(steps))
        extra += matviews.steps(src, tables.schemas, quoted, len(steps) + len(extra))
        extra += objects.steps(
            src, tables.schemas, tables.exclude, quoted, [*steps, *extra], len(steps) + len(extra)
        )
        whole = not self.opts.selection.schemas and not self.opts.selection.tables
        return extra + (objects.event_triggers(src) if whole else [])

    def identity_always(self, tables: list[str]) -> list[Step]:
        """Make the target's ``GENERATED ALWAYS`` identity columns ``BY DEFAULT`` until the cutover, which puts them
        back (steps of kind ``cutover_identity``): the apply loop can write an ALWAYS column, but an UPDATE that may
        change one switches it for each statement under an ACCESS EXCLUSIVE lock (docs/differences.md); while only
        the migration writes to the target, BY DEFAULT costs nothing."""
        rows = self.target.execute(
            "SELECT format('%%I.%%I', n.nspname, c.relname), a.attname FROM pg_attribute a"
            " JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE a.attidentity = 'a' AND NOT a.attisdropped AND NOT c.relispartition"
            " AND format('%%I.%%I', n.nspname, c.relname) = ANY(%s)"
            " ORDER BY 1, 2",
            (tables,),
        ).fetchall()
        steps = []
        for table, column in rows:
            alter = sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET GENERATED ").format(
                sql.SQL(table), sql.Identifier(column)
            )
            self.target.execute(alter + sql.SQL("BY DEFAULT"))
            always = (alter + sql.SQL("ALWAYS")).as_string(self.target)
            steps.append(Step.of(StepKind.CUTOVER_IDENTITY, f"{table}.{column}", (table,), (), (always,),
                                 10_000 + len(steps)))  # fmt: skip
        return steps

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
        """The subscription's catalog rows (every table ``i``, two-phase pending until all are ready), using the
        slot made above; one left by an interrupted start is replaced."""
        from applier.catalog.store import Catalog
        from state.tables import initial_sync_state
        from state.twophase import initial_two_phase

        catalog = Catalog.connect(self.opts.target)
        try:
            old = catalog.get(m.subname)
            if old is not None:
                catalog.delete_subscription(old.subid)
            two_phase, _ = initial_two_phase(True, True, False, has_tables=bool(tables))
            sub = catalog.create_subscription(
                subname=m.subname, conninfo=m.source, publications=[m.publication], two_phase_state=two_phase.value,
                streaming="on", binary=False, disable_on_error=False, origin="any", slot_name=m.slot, enabled=True,
                copy_data=True, gid_format=self._gid_format(),
            )  # fmt: skip
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
        master = None if os.environ.get("SPARK_REMOTE") else f"local[{max(1, self.opts.table_jobs)},4]"
        try:
            result = copier.run(spark_master=master)
        finally:
            self.slot_conn = None  # closed by the copy: the snapshot is over
            copying.clear()
        self.times["copy"] = time.monotonic() - started
        self.say(f"copy: {result} ({self.times['copy']:.1f}s)")
        thread.join()
        if "error" in outcome:
            raise MigrationError(f"post-data failed: {outcome['error']}") from outcome["error"]
        self.times["post-data"] = outcome.get("seconds", 0.0)
        if result.stopped or self.stop.is_set():
            return False
        if not outcome.get("ok"):
            raise MigrationError("post-data could not finish: a step waits for a table that was not copied")
        return True

    def _post_data_thread(self, m: store.Migration, steps: list[Step], cost: dict[str, float],
                          copying: threading.Event, outcome: dict[str, Any]) -> threading.Thread:  # fmt: skip
        """The post-data thread (not started): it runs the steps as their tables land while ``copying`` is set,
        and leaves in ``outcome`` whether all ran (``ok``), its error (which stops the copy too) and its time."""

        def post() -> None:
            started = time.monotonic()
            try:
                with psycopg.connect(self.opts.target, autocommit=True) as conn:
                    outcome["ok"] = postdata.run_steps(
                        self.opts.target, m.name, steps, lambda: self.copied(conn), jobs=self.opts.index_jobs,
                        copy_running=copying.is_set, stop=self.stop, say=self.say, cost=cost,
                    )  # fmt: skip
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
        partition = int(os.environ.get("APPLIER_MIGRATE_PARTITION_BYTES", "0") or 0)
        kwargs: dict[str, Any] = {"partition_bytes": partition} if partition else {}
        return InitialCopy(self.opts.target, m.subname, stop=self.stop, reporter=CopyProgress.for_setting(None),
                           snapshot=held, weights=weights, head_start=max(1, self.opts.table_jobs),
                           **kwargs)  # fmt: skip

    # --- all --------------------------------------------------------------------------------------------------
    def run(self) -> int:
        with psycopg.connect(self.opts.source, autocommit=True) as src:
            tables = source_tables(src, self.opts.selection)
        if not tables.tables:
            raise MigrationError("the selection covers no table on the source (see applier migrate plan)")
        m = self.register(tables)
        if m.phase == "done":
            self.say(f'migration "{m.name}" is done')
            return 0
        if m.phase == "failed":
            raise MigrationError(f'migration "{m.name}" failed: {m.error}; abort it (applier migrate abort)')
        self.publication(m, tables)
        if m.phase == "schema":
            started = time.monotonic()
            self.fresh_slot(self.migration())
            m = self.migration()
            if m.snapshot_lsn is None:
                self.pre_data(m, tables)
            else:
                self.say("pre-data restored by an interrupted start; copying at a new snapshot")
            quoted = [r[0] for r in self.target.execute(
                "SELECT format('%%I.%%I', s, t) FROM unnest(%s::text[], %s::text[]) AS x(s, t)",
                ([s for s, _ in tables.tables], [t for _, t in tables.tables]),
            )]  # fmt: skip
            self.subscription(m, quoted)
            self.phase("copy", schema=time.monotonic() - started)
            m = self.migration()
        if m.phase == "copy":
            if not self.copy_and_post_data(m):
                return self.outcome(0)
            self.phase("following", **{k: v for k, v in self.times.items() if k != "schema"})
        self.summary()
        return self.follow(m)

    def summary(self) -> None:
        times = self.migration().times
        order = ["schema", "copy", "post-data"]
        keys = sorted(times, key=lambda k: order.index(k) if k in order else len(order))
        self.say("summary: " + ", ".join(f"{k} {times[k]:.1f}s" for k in keys))

    def follow(self, m: store.Migration) -> int:
        """The apply loop (``applier run``'s) in the foreground until a cutover completes or a signal stops it."""
        from applier import runner

        if self.stop.is_set():
            return 0
        self.say(
            f'following the source (subscription "{m.subname}") until a cutover; Ctrl-C stops, start resumes'
        )
        runner.configure_logging(self.opts.target)
        finished = threading.Event()
        auto = None
        if self.opts.cutover:
            auto = threading.Thread(
                target=self._auto_cutover, args=(finished,), name="auto-cutover", daemon=True
            )
            auto.start()
        try:
            status = runner.run(self.opts.target, [m.subname], wait_target=runner.WAIT_TARGET, stop=self.stop)
        finally:
            finished.set()
            if auto is not None:
                auto.join()
        if self.auto_error is not None:
            self.say(f"ERROR: the cutover failed: {self.auto_error}")
            return 1
        return self.outcome(status)

    def outcome(self, status: int) -> int:
        """What start says and returns once it stops."""
        phase = self.migration().phase
        if phase == "done":
            self.say(f'migration "{self.opts.name}" done: the target has taken over')
            return 0
        if phase == "failed":
            self.say(f'migration "{self.opts.name}" was aborted')
            return 1
        if status == 0:
            self.say("stopped; applier migrate start again resumes")
        return status

    def _auto_cutover(self, finished: threading.Event) -> None:
        """``start --cutover``: once every table is ready and the lag is under :data:`CAUGHT_UP_BYTES`, cut over
        (as ``applier migrate cutover`` would); a failure stops start with its reason (the source is unfenced)."""
        from applier.migrate import cutover as co

        lag = self._wait_caught_up(finished)
        if lag is None:
            return
        self.say(f"caught up (lag {lag} bytes): cutting over")
        try:
            co.cutover(co.CutoverOptions(self.opts.name, self.opts.target), self.say)
        except Exception as exc:  # noqa: BLE001 - reported by follow(), start exits 1
            self.auto_error = str(exc)
        self.stop.set()  # done (or failed): the worker stops now, not at its next look at the catalog

    def _wait_caught_up(self, finished: threading.Event) -> int | None:
        """Look once a second (:func:`~applier.migrate.cutover.ready_for_cutover`) until the migration may cut
        over: its lag then, or None when following ended first. One connection to each server serves every look
        (one that fails, e.g. a target restarting, is opened again at the next); both are closed before the
        cutover, whose fence ends the source's sessions."""
        from applier.migrate.cutover import ready_for_cutover

        conns: dict[str, psycopg.Connection[Any]] = {}
        try:
            while not finished.wait(1.0):
                try:
                    self._connect(conns)
                    lag = ready_for_cutover(conns["target"], conns["source"], self.opts.name,
                                            caught_up=CAUGHT_UP_BYTES)  # fmt: skip
                except Exception:  # noqa: BLE001 - a server may be restarting: try again
                    _close_all(conns)
                    continue
                if lag is not None:
                    return lag
            return None
        finally:
            _close_all(conns)

    def _connect(self, conns: dict[str, psycopg.Connection[Any]]) -> None:
        """(Re)open the auto-cutover's connection to the target and to the source where it is missing or lost."""
        for side, dsn in (("target", self.opts.target), ("source", self.opts.source)):
            if side not in conns or conns[side].closed or conns[side].broken:
                conns[side] = psycopg.connect(dsn, autocommit=True, connect_timeout=5)

    def watch(self, finished: threading.Event) -> None:
        """Stop when the migration is done (a cutover completed) or failed (aborted), as another shell decides."""
        while not finished.wait(0.5):
            with contextlib.suppress(Exception), psycopg.connect(self.opts.target, autocommit=True) as c:
                if store.phase_of(c, self.opts.name) in ("done", "failed"):
                    self.stop.set()
                    return

    def close(self) -> None:
        if self.slot_conn is not None:
            with contextlib.suppress(Exception):
                self.slot_conn.close()
        self.target.close()


def _close_all(conns: dict[str, psycopg.Connection[Any]]) -> None:
    """Close and forget ``conns`` (the next look opens them again)."""
    for c in conns.values():
        c.close()
    conns.clear()


def start(opts: StartOptions, say: Callable[[str], None]) -> int:
    runner = _Runner(opts, say)

    def on_signal(signum: int) -> None:
        say(f"{signal.Signals(signum).name} received: stopping")

    # As applier run's own: the signal sets the stop event (set_once: a second signal inside the first must not
    # deadlock). runner.run installs its handlers while it follows and takes the same event as its ``stop``, so a
    # signal that came before stops its worker too, as a first signal would.
    handler = set_once(runner.stop, on_signal)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    finished = threading.Event()
    watcher = threading.Thread(target=runner.watch, args=(finished,), name="migration-watch", daemon=True)
    watcher.start()
    try:
        return runner.run()
    finally:
        finished.set()
        for s, h in previous.items():
            signal.signal(s, h)
        runner.close()
