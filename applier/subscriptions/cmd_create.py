"""``applier create``: check the target, the publisher and the grants first, then write the catalog and create
the slot; a failure at any step undoes what was done, so no half-created subscription is left."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from applier.catalog.store import Catalog, Subscription
from applier.conninfo import without_password
from applier.lsn import format_lsn
from applier.privileges import TargetFacts
from applier.replication import ReplicationConnection, ReplicationConnectionError
from applier.subscriptions import ddl
from applier.subscriptions.common import (
    QUIET,
    Console,
    SubscriptionError,
    _check_slot_name,
    _drop_slot,
    _pub_query,
    _slot_row,
    _target_tables,
    check_publisher_version,
    connect_publisher,
    missing_publications,
    open_catalog,
    published_tables,
    set_slot_failover,
    slot_mismatch,
    target_errors,
    warn_password_not_stored,
)
from applier.subscriptions.grants import _require_grants, read_target_facts, warn_superuser_once
from state.tables import SyncState, initial_sync_state
from state.twophase import initial_two_phase


@dataclass(frozen=True)
class CreateOptions:
    """``applier create``'s options, named as CREATE SUBSCRIPTION names them."""

    name: str
    publisher: str
    publications: tuple[str, ...]
    two_phase: bool = False
    streaming: str = "off"
    copy_data: bool = True
    binary: bool = False
    origin: str = "any"
    disable_on_error: bool = False
    slot_name: str | None = None  # default: the subscription's name
    create_slot: bool = True
    enabled: bool = True
    run_as_owner: bool = False  # PostgreSQL 16's: trust the tables' owners (docs/security.md)
    failover: bool = False  # PostgreSQL 17's: a slot that standbys synchronize (docs/operations.md)
    conflict_log: str = "log"  # where conflicts go: log, table (applier.conflict_log), all
    ddl: bool = False  # replay the publisher's schema changes (applier.subscriptions.ddl)

    @property
    def slot(self) -> str:
        return self.slot_name or self.name


def create(target: str, opts: CreateOptions, console: Console = QUIET) -> Subscription:
    """Create a subscription: check, write the catalog, create the slot; on any failure undo what was done."""
    if not opts.name.strip():
        raise SubscriptionError("the subscription name must not be empty")
    if not opts.publications:
        raise SubscriptionError("at least one --publication is needed")
    _check_slot_name(opts.slot, default=opts.slot_name is None)

    catalog = open_catalog(target)
    with target_errors(target):
        _refuse_existing(catalog, opts.name)  # before the publisher is asked anything: its slot is that one's
        facts = _check_target(catalog, opts, console)

    with connect_publisher(opts.publisher, "create", opts.name, doing="create the subscription") as pub:
        tables = _check_publisher(pub, opts)
        with target_errors(target):
            relids = _target_tables(catalog, tables)
            _require_grants(catalog, facts, relids)  # everything is checked: only now is anything written
            catalog.ensure()
            _refuse_existing(catalog, opts.name)  # created by someone else while the publisher was checked
        # --ddl: the capture before the slot (no DDL after its consistent point missed), undone if create fails
        with ddl.installed_for(opts.publisher, opts.name, opts.slot, opts.publications, enabled=opts.ddl,
                               console=console):  # fmt: skip
            state = _write(catalog, target, pub, opts, tables, relids, console)

    warn_password_not_stored(opts.publisher, console)
    created = catalog.require(opts.name)
    console.info(
        f'created subscription "{created.subname}" (subid {created.subid}): {len(tables)} table(s) in state '
        f"{state.value}, two-phase state {created.subtwophasestate.value}"
        + (
            f', slot "{opts.slot}" at {format_lsn(created.subslotconsistentlsn)}'
            if created.subslotconsistentlsn
            else ""
        )
    )
    return created


def _write(
    catalog: Catalog,
    target: str,
    pub: ReplicationConnection,
    opts: CreateOptions,
    tables: Sequence[str],
    relids: dict[str, int],
    console: Console,
) -> SyncState:
    """Everything checked: the catalog row, the tables and the slot (undone together on a failure); returns the
    tables' first state."""
    two_phase, slot_two_phase = initial_two_phase(
        opts.two_phase, opts.copy_data, opts.create_slot, has_tables=bool(tables)
    )
    with target_errors(target):
        sub = catalog.create_subscription(
            subname=opts.name,
            conninfo=without_password(opts.publisher),
            publications=list(opts.publications),
            two_phase_state=two_phase,
            streaming=opts.streaming,
            binary=opts.binary,
            disable_on_error=opts.disable_on_error,
            origin=opts.origin,
            slot_name=opts.slot,
            enabled=opts.enabled,
            copy_data=opts.copy_data,
            run_as_owner=opts.run_as_owner,
            failover=opts.failover,
            ddl=opts.ddl,
            conflict_log=opts.conflict_log,
        )
        _warn_untrusted(catalog, relids, opts, console)
    return _add_tables_and_slot(catalog, target, pub, sub, opts, tables, relids, slot_two_phase, console)


def _refuse_existing(catalog: Catalog, name: str) -> None:
    """Refuse a name the target's catalog already has. Checked first: the publisher's checks would otherwise meet
    that subscription's own slot (named after it) and report a slot to drop, the one a live subscription uses."""
    if catalog.exists() and catalog.get(name) is not None:
        raise SubscriptionError(
            f'subscription "{name}" already exists on this target',
            f"choose another name, or remove the old one first: applier drop {name}",
        )


def _warn_untrusted(catalog: Catalog, relids: dict[str, int], opts: CreateOptions, console: Console) -> None:
    """Say now which tables have code the trust check will refuse (docs/security.md), rather than at their first
    change; a failure to look only loses the warning."""
    if opts.run_as_owner or not relids:
        return
    try:
        found = catalog.untrusted_code(list(relids.values()))
    except (
        sa.exc.SQLAlchemyError
    ) as exc:  # e.g. a catalog function missing: the check itself still runs later
        console.warn(
            f"could not look for code the apply role does not trust: {' '.join(str(exc).split())[:200]}"
        )
        return
    for tbl, kind, obj, _owner, why in found:
        console.warn(
            f"table {tbl}: {kind} {obj} {why}".replace("  ", " ") + ": changes to it will be refused"
        )
    if found:
        console.warn(
            "the apply role runs no code that a role other than itself or a superuser controls: make it own that "
            "code, drop or disable it, or trust the tables' owners with --run-as-owner (docs/security.md)"
        )


def _add_tables_and_slot(
    catalog: Catalog,
    target: str,
    pub: ReplicationConnection,
    sub: Subscription,
    opts: CreateOptions,
    tables: Sequence[str],
    relids: dict[str, int],
    slot_two_phase: bool,
    console: Console,
) -> SyncState:
    """The new subscription's tables, in their first state (returned), then its slot; on any failure (Ctrl-C
    included) the slot, the rows and the origin go: no half-created subscription."""
    slot_created = False
    try:
        state = initial_sync_state(opts.copy_data)
        with target_errors(target), catalog.engine.begin() as c:
            for name in tables:
                catalog.add_table(sub.subid, relids[name], name, state, conn=c)
        if opts.create_slot:
            lsn = _create_slot(pub, opts.slot, slot_two_phase, console, failover=opts.failover)
            slot_created = True
            with target_errors(target):
                catalog.update_subscription(sub.subid, subslotconsistentlsn=lsn)
        elif opts.failover:  # an existing slot becomes a failover slot, as native's CREATE SUBSCRIPTION does
            set_slot_failover(pub, opts.slot, True, console)
    except BaseException:
        with contextlib.suppress(Exception):
            if slot_created:
                _drop_slot(pub, opts.slot)
        with contextlib.suppress(Exception):
            catalog.delete_subscription(sub.subid)
        raise
    return state


def _check_target(catalog: Catalog, opts: CreateOptions, console: Console) -> TargetFacts:
    """What the target must allow, read before anything is written: the role's privileges (returned, completed
    with the tables' once the publisher has named them), and prepared transactions if two-phase is asked."""
    with catalog.engine.connect() as c:
        facts = read_target_facts(c)
        max_prepared = c.execute(sa.text("SELECT current_setting('max_prepared_transactions')::int")).scalar()
    if facts.superuser:
        warn_superuser_once(facts.role, console.warn)
    if opts.two_phase and max_prepared == 0:
        raise SubscriptionError(
            "two-phase needs prepared transactions on the target, but its max_prepared_transactions is 0",
            "set max_prepared_transactions on the target (e.g. to max_connections) and restart it, or create "
            "the subscription without --two-phase",
        )
    return facts


def _check_publisher(pub: ReplicationConnection, opts: CreateOptions) -> list[str]:
    """Version, wal_level, publications and slot; returns the published tables."""
    check_publisher_version(
        pub.server_version, two_phase=opts.two_phase, origin=opts.origin, failover=opts.failover
    )
    ((wal_level, dbname),) = _pub_query(pub, "SELECT current_setting('wal_level'), current_database()")
    if wal_level != "logical":
        raise SubscriptionError(
            f'wal_level on the publisher is "{wal_level}"; logical replication needs "logical"',
            "on the publisher run ALTER SYSTEM SET wal_level = logical, then restart it",
        )
    missing = missing_publications(pub, opts.publications)
    if missing:
        names = ", ".join(f'"{p}"' for p in missing)
        raise SubscriptionError(
            f"publication {names} does not exist on the publisher (database {dbname})"
            if len(missing) == 1
            else f"publications {names} do not exist on the publisher (database {dbname})",
            "create it on the publisher (CREATE PUBLICATION name FOR TABLE ...), or check the name and the "
            "publisher's dbname",
        )
    if opts.create_slot:
        if _slot_row(pub, opts.slot) is not None:
            raise _slot_exists(opts.slot)
    else:
        row = _slot_row(pub, opts.slot)
        if row is None:
            raise SubscriptionError(
                f'replication slot "{opts.slot}" does not exist on the publisher, and --no-create-slot says not to '
                "create it",
                "create it there first (SELECT pg_create_logical_replication_slot('"
                f"{opts.slot}', 'pgoutput')), or leave out --no-create-slot",
            )
        mismatch = slot_mismatch(row, dbname)
        if mismatch:
            raise SubscriptionError(
                f'replication slot "{opts.slot}" cannot serve this subscription: it is {mismatch}',
                "name a logical pgoutput slot of the publisher's database with --slot-name, or let create make one",
            )
    return published_tables(pub, opts.publications)


def _slot_exists(slot: str) -> SubscriptionError:
    return SubscriptionError(
        f'replication slot "{slot}" already exists on the publisher',
        "choose another name with --slot-name; or, if nothing uses it, drop it on the publisher "
        f"(SELECT pg_drop_replication_slot('{slot}')); or reuse it with --no-create-slot",
    )


def _create_slot(
    pub: ReplicationConnection, slot: str, two_phase: bool, console: Console, *, failover: bool = False
) -> int:
    """Create the subscription's slot and return its consistent point. Creating a slot waits for every
    transaction open on the publisher, prepared ones included, so say so if it takes a while."""
    notice = threading.Timer(
        5.0,
        console.warn,
        (
            f'still creating replication slot "{slot}": the publisher first waits for every transaction open '
            "there to finish, prepared ones included (see pg_stat_activity and pg_prepared_xacts on the publisher)",
        ),
    )
    notice.daemon = True
    notice.start()
    try:
        info = pub.create_slot(slot, two_phase=two_phase, failover=failover)
    except ReplicationConnectionError as exc:
        if exc.sqlstate == "42710":  # duplicate_object: created by someone else since we looked
            raise _slot_exists(slot) from None
        raise SubscriptionError(
            f'could not create replication slot "{slot}" on the publisher: {exc}'
        ) from None
    finally:
        notice.cancel()
    return info.consistent_point
