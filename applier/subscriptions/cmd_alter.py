"""``applier alter``: ``--enable``/``--disable``, ``--set OPTION=VALUE``, ``--skip-lsn``, ``--reset-stats``,
``--connection`` and ``--refresh-publication``. Every option is validated before any is changed; the transitions
the state machines decide (:mod:`state.twophase`) are asked before the catalog or the slot is touched."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.catalog.store import Catalog, Subscription
from applier.conninfo import describe, without_password
from applier.lsn import format_lsn, parse_lsn
from applier.replication import ReplicationConnection
from applier.subscriptions import ddl
from applier.subscriptions.common import (
    ALTER_SLOT_TWO_PHASE_VERSION,
    QUIET,
    Console,
    SubscriptionBusy,
    SubscriptionError,
    _check_slot_name,
    _pub_query,
    _slot_row,
    _target_tables,
    check_publisher_version,
    connect_publisher,
    missing_publications,
    open_catalog,
    origin_progress,
    published_tables,
    require_subscription,
    rollback_prepared,
    set_slot_failover,
    slot_mismatch,
    target_errors,
    warn_password_not_stored,
)
from applier.subscriptions.lock import SubscriptionLock, _holder
from state.tables import initial_sync_state
from state.twophase import (
    GID_FORMATS,
    TwoPhaseState,
    check_alter_gid_format,
    check_alter_two_phase,
    check_refresh_publication,
    check_skip_lsn,
)

_TRUE = {"true", "on", "yes", "1", "t", "y"}
_FALSE = {"false", "off", "no", "0", "f", "n"}
SETTABLE = (
    "two_phase",
    "streaming",
    "binary",
    "disable_on_error",
    "origin",
    "slot_name",
    "gid_format",
    "run_as_owner",
    "failover",
    "conflict_log",
    "ddl",
)
_BOOLEANS = ("two_phase", "binary", "disable_on_error", "run_as_owner", "failover", "ddl")
#: what each option takes, as the hint for a wrong value lists it: a user who typed one wrong value should not
#: have to guess the next
_VALID_VALUES = {
    **dict.fromkeys(_BOOLEANS, "true, false (or on, off)"),
    "streaming": "off, on, parallel",
    "origin": "any, none",
    "conflict_log": "log, table, all",
    "gid_format": ", ".join(GID_FORMATS),
    "slot_name": "a slot name (1-63 lower case letters, digits and underscores), or NONE",
}


def _valid(option: str) -> str:
    return f"valid values of {option}: {_VALID_VALUES[option]}"


def _bool(option: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SubscriptionError(f'{option} requires a Boolean value, not "{value}"', _valid(option))


def _streaming(value: str) -> str:
    v = value.lower()
    if v == "parallel":
        return "parallel"
    if v in _TRUE | _FALSE:
        return "on" if v in _TRUE else "off"
    raise SubscriptionError(
        f'streaming requires a Boolean value or "parallel", not "{value}"', _valid("streaming")
    )


def _one_of(option: str, value: str, values: Sequence[str]) -> str:
    if value.lower() not in values:
        raise SubscriptionError(f'unrecognized {option} value: "{value}"', _valid(option))
    return value.lower()


def _slot_name(value: str) -> str | None:
    if value.upper() == "NONE":
        return None
    try:
        _check_slot_name(value, default=False)
    except SubscriptionError as exc:
        raise SubscriptionError(exc.message, _valid("slot_name")) from None
    return value


def _value(option: str, value: str) -> Any:
    """One option's value, parsed (``option`` is one of :data:`SETTABLE`)."""
    if option in _BOOLEANS:
        return _bool(option, value)
    if option == "streaming":
        return _streaming(value)
    if option == "origin":
        return _one_of(option, value, ("any", "none"))
    if option == "gid_format":
        return _one_of(option, value, GID_FORMATS)
    if option == "conflict_log":
        return _one_of(option, value, ("log", "table", "all"))
    return _slot_name(value)


def parse_set_options(items: Sequence[str]) -> dict[str, Any]:
    """``["streaming=on", "binary=false"]`` -> ``{"streaming": "on", "binary": False}``, validated."""
    result: dict[str, Any] = {}
    for item in items:
        option, sep, value = item.partition("=")
        option = option.strip().lower()
        if not sep:
            raise SubscriptionError(f'--set needs OPTION=VALUE, not "{item}"', "e.g. --set streaming=on")
        if option not in SETTABLE:
            raise SubscriptionError(
                f'unrecognized subscription option "{option}"', f"settable options: {', '.join(SETTABLE)}"
            )
        if option in result:
            raise SubscriptionError(f'option "{option}" given twice')
        result[option] = _value(option, value.strip())
    if "two_phase" in result and "slot_name" in result:
        raise SubscriptionError(
            "slot_name and two_phase cannot be altered at the same time", "run two separate alter commands"
        )
    return result


_COLUMNS = {
    "streaming": "substream",
    "binary": "subbinary",
    "disable_on_error": "subdisableonerr",
    "origin": "suborigin",
    "slot_name": "subslotname",
    "gid_format": "subgidformat",
    "run_as_owner": "subrunasowner",
    "failover": "subfailover",
    "conflict_log": "subconflictlog",
    "ddl": "subddl",
}


def set_enabled(target: str, name: str, enabled: bool, console: Console = QUIET) -> None:
    """``alter --enable`` / ``--disable``. A running worker notices a disable and exits; ``applier run`` starts an
    enabled one."""
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
        if enabled and sub.subslotname is None:
            raise SubscriptionError(
                f'cannot enable subscription "{name}": it has no slot name',
                f"set one first: applier alter {name} --set slot_name=SLOT",
            )
        catalog.update_subscription(sub.subid, subenabled=enabled)
        holder = _holder(catalog, sub.subid)
    console.info(f'subscription "{name}" {"enabled" if enabled else "disabled"}')
    if not enabled and holder is not None:
        console.info(f"its worker ({holder}) stops by itself shortly")


def alter_options(
    target: str, name: str, items: Sequence[str], *, force: bool = False, console: Console = QUIET
) -> None:
    """``alter --set OPTION=VALUE ...``: all options validated before any is changed, then changed together."""
    options = parse_set_options(items)
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
    _check_options(catalog, sub, target, options, force=force)
    if "failover" in options and options["failover"] != sub.subfailover:
        _set_failover(sub, options["failover"], console)  # the slot first; the catalog below
    _set_ddl(
        catalog, sub, options, console
    )  # the publisher's capture first (on: after subddl); the catalog below
    values = {_COLUMNS[k]: v for k, v in options.items() if k != "two_phase"}
    if "two_phase" not in options:
        with target_errors(target):
            catalog.update_subscription(sub.subid, **values)
        console.info(f'subscription "{name}" altered: ' + ", ".join(items))
        return
    # two_phase: only with no worker running, which holding the lock ourselves guarantees for the duration
    lock = SubscriptionLock(target, sub, "alter")
    try:
        lock.acquire()
        worker_running = False
    except SubscriptionBusy:
        worker_running = True
    try:
        with target_errors(target):
            pending = catalog.pending_prepared(sub.subid)
        new_state = check_alter_two_phase(
            sub.subtwophasestate,
            options["two_phase"],
            enabled=sub.subenabled,
            worker_running=worker_running,
            prepared_xacts=len(pending),
            force=force,
            subname=name,
        )
        if new_state == sub.subtwophasestate:
            with target_errors(target):
                catalog.update_subscription(sub.subid, **values)
            console.info(f'subscription "{name}" altered: two_phase unchanged ({new_state.value})')
            return
        if new_state is TwoPhaseState.DISABLED:
            _two_phase_off(catalog, sub, target, values, force=force, console=console)
        else:
            with target_errors(target):
                catalog.update_subscription(sub.subid, subtwophasestate=new_state, **values)
        console.info(f'subscription "{name}" altered: two-phase state {new_state.value}')
    finally:
        lock.release()


def _check_options(
    catalog: Catalog, sub: Subscription, target: str, options: dict[str, Any], *, force: bool
) -> None:
    """The refusals that need the subscription (and, for some options, the publisher), before anything changes."""
    name = sub.subname
    if "slot_name" in options and options["slot_name"] is None and sub.subenabled:
        raise SubscriptionError(
            f'cannot set slot_name = NONE for enabled subscription "{name}"',
            f"disable it first: applier alter {name} --disable",
        )
    if force and options.get("two_phase") is not False:
        raise SubscriptionError(
            "--force only applies to --set two_phase=off (it rolls back prepared transactions)"
        )
    if "gid_format" in options:
        _check_gid_format(catalog, sub, target, options["gid_format"])
    turning_on = options.get("two_phase") is True and sub.subtwophasestate is TwoPhaseState.DISABLED
    if turning_on or options.get("origin") == "none":
        _check_publisher_can(sub, two_phase=turning_on, origin=options.get("origin", "any"))


def _set_failover(sub: Subscription, failover: bool, console: Console) -> None:
    """``--set failover``: on the slot first (as native, only while the subscription is disabled: the worker's
    walsender holds the slot), then in the catalog with the other options."""
    if sub.subenabled:
        raise SubscriptionError(
            f'cannot set failover for enabled subscription "{sub.subname}"',
            f"disable it first: applier alter {sub.subname} --disable",
        )
    if sub.subslotname is None:
        raise SubscriptionError(
            f'cannot set failover for subscription "{sub.subname}": it has no slot (slot_name = NONE)',
            "set a slot first: applier alter NAME --set slot_name=SLOT",
        )
    with connect_publisher(sub.subconninfo, "alter", sub.subname, doing="set failover on the slot") as pub:
        two_phase = sub.subtwophasestate is not TwoPhaseState.DISABLED
        check_publisher_version(pub.server_version, failover=failover, two_phase=two_phase)
        set_slot_failover(pub, sub.subslotname, failover, console)


def _set_ddl(catalog: Catalog, sub: Subscription, options: dict[str, Any], console: Console) -> None:
    """``--set ddl`` (and a new ``slot_name`` while it is on): the capture of the slot the subscription will use
    installed, that of the slot it used removed. Turning it on, the catalog says ``subddl`` first and the capture
    comes after (a refusal puts ``subddl`` back): a running worker then meets the capture's first message either
    in a session that replays or in one that restarts for it (applier.apply.ddl_replay.DdlConsumer), so no DDL
    committed after the install is missed."""
    want = options.get("ddl", sub.subddl)
    old = sub.subslotname
    new = options["slot_name"] if "slot_name" in options else old
    pubs = sub.subpublications
    if want and (not sub.subddl or new != old) and (new is not None or "ddl" in options):
        if not sub.subddl and new == old:
            catalog.update_subscription(sub.subid, subddl=True)
        try:
            ddl.set_capture(sub.subconninfo, sub.subname, new, pubs, True, console)
        except BaseException:
            if not sub.subddl:
                catalog.update_subscription(sub.subid, subddl=False)
            raise
    if sub.subddl and old is not None and (not want or new != old):
        ddl.set_capture(sub.subconninfo, sub.subname, old, pubs, False, console)


def _check_publisher_can(sub: Subscription, *, two_phase: bool, origin: str) -> None:
    """Options the publisher's version must support (two-phase from 15, with failover from 18; origin = none from
    16), checked before anything changes."""
    doing = "check that the publisher supports " + ("two-phase" if two_phase else "origin = none")
    with connect_publisher(sub.subconninfo, "alter", sub.subname, doing=doing) as pub:
        check_publisher_version(
            pub.server_version, two_phase=two_phase, origin=origin, failover=sub.subfailover
        )


def _check_gid_format(catalog: Catalog, sub: Subscription, target: str, new: str) -> None:
    """``--set gid_format``: a running worker names its prepared transactions as it started, so only on a disabled
    subscription, and never while some are prepared under the current names (state.twophase)."""
    if new != sub.subgidformat and sub.subenabled:
        raise SubscriptionError(
            f'cannot set option "gid_format" for enabled subscription "{sub.subname}"',
            f"disable it first (applier alter {sub.subname} --disable), then run this again and re-enable it",
        )
    with target_errors(target):
        pending = catalog.pending_prepared(sub.subid)
    check_alter_gid_format(sub.subgidformat, new, prepared_xacts=len(pending), subname=sub.subname)


def _two_phase_off(
    catalog: Catalog, sub: Subscription, target: str, values: dict[str, Any], *, force: bool, console: Console
) -> None:
    """on -> off: roll back our prepared transactions if forced, turn two-phase off on the slot (PostgreSQL 18+),
    and record ``d``. The catalog change commits only after the slot was altered."""
    slot = sub.subslotname
    with contextlib.ExitStack() as stack:
        pub: ReplicationConnection | None = None
        slot_two_phase = False
        if slot is not None:
            pub = stack.enter_context(
                connect_publisher(
                    sub.subconninfo, "alter", sub.subname, doing=f'turn two-phase off on slot "{slot}"'
                )
            )
            row = _slot_row(pub, slot)
            slot_two_phase = bool(row and row[1])
            if slot_two_phase and pub.server_version < ALTER_SLOT_TWO_PHASE_VERSION:
                raise SubscriptionError(
                    f'cannot turn two-phase off: slot "{slot}" decodes prepared transactions, and the publisher '
                    f"(PostgreSQL {pub.server_version // 10000}) cannot change that on an existing slot "
                    "(ALTER_REPLICATION_SLOT ... TWO_PHASE needs PostgreSQL 18)",
                    f"drop and create the subscription again without --two-phase (applier drop {sub.subname}; "
                    "applier create ...), or upgrade the publisher",
                )
        if force:
            with target_errors(target):
                rollback_prepared(catalog, sub, console)
        with target_errors(target), catalog.engine.begin() as c:
            catalog.update_subscription(sub.subid, c, subtwophasestate=TwoPhaseState.DISABLED, **values)
            if pub is not None and slot_two_phase:
                _slot_two_phase_off(pub, slot, console)  # type: ignore[arg-type]


def _slot_two_phase_off(pub: ReplicationConnection, slot: str, console: Console) -> None:
    """``ALTER_REPLICATION_SLOT ... (TWO_PHASE false)`` (PostgreSQL 18+), inside the caller's catalog transaction,
    which commits only if this succeeded."""
    try:
        pub.connection.execute(
            sql.SQL("ALTER_REPLICATION_SLOT {} ( TWO_PHASE false )").format(sql.Identifier(slot))  # type: ignore[arg-type]
        )
    except psycopg.Error as exc:
        raise SubscriptionError(
            f'could not turn two-phase off on slot "{slot}" on the publisher: {str(exc).strip()}'
        ) from None
    console.info(f'two-phase turned off on slot "{slot}" on the publisher')


def set_skip_lsn(target: str, name: str, value: str, console: Console = QUIET) -> None:
    """``alter --skip-lsn LSN|NONE``: skip the remote transaction finishing at LSN (behaviours 97-100)."""
    if value.strip().upper() == "NONE":
        lsn = 0
    else:
        try:
            lsn = parse_lsn(value)
        except ValueError as exc:
            raise SubscriptionError(
                str(exc), "give the finish LSN from the worker's error message, or NONE"
            ) from None
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
        check_skip_lsn(lsn, origin_progress(catalog, sub), subname=name)
        catalog.update_subscription(sub.subid, subskiplsn=lsn or None)
    console.info(
        f'subscription "{name}" will skip the transaction finishing at {format_lsn(lsn)}'
        if lsn
        else f'subscription "{name}": skip-LSN cleared'
    )


def reset_stats(target: str, name: str, console: Console = QUIET) -> None:
    """``alter --reset-stats``: zero the subscription's counters and set ``stats_reset`` to now, as
    ``pg_stat_reset_subscription_stats`` does (``status`` shows them as ``stats``)."""
    catalog = open_catalog(target, create=True)  # a catalog older than version 12 gets its stats table
    with target_errors(target):
        sub = require_subscription(catalog, name)
        catalog.reset_stats(sub.subid)
    console.info(f'subscription "{name}": statistics reset')


def refresh_publication(target: str, name: str, *, copy_data: bool = True, console: Console = QUIET) -> None:
    """``alter --refresh-publication``: start replicating newly published tables, stop replicating unpublished ones."""
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
    check_refresh_publication(sub.subtwophasestate, copy_data, subname=name)
    with connect_publisher(sub.subconninfo, "refresh", sub.subname, doing="read the publications") as pub:
        published = published_tables(pub, sub.subpublications)
    with target_errors(target):
        current = {t.remote_name: t for t in catalog.table_states(sub.subid)}
        added = [t for t in published if t not in current]
        removed = [t for name_, t in current.items() if name_ not in set(published)]
        relids = _target_tables(catalog, added)
        state = initial_sync_state(copy_data)
        with catalog.engine.begin() as c:
            for t in added:
                catalog.add_table(sub.subid, relids[t], t, state, conn=c)
            for t in removed:
                catalog.remove_table(sub.subid, t.relid, conn=c)
    console.info(
        f'subscription "{name}" refreshed: '
        + (f"added {', '.join(added)} (state {state.value})" if added else "no table added")
        + (f"; removed {', '.join(t.name for t in removed)}" if removed else "; no table removed")
    )
    if added and copy_data:
        holder = _holder(catalog, sub.subid)
        # a running worker copies and catches them up live (tablesync.live); otherwise the next applier run does
        console.info(
            f"the new tables are being copied and caught up by the running worker ({holder})"
            if holder
            else "the new tables are copied when applier run next starts this subscription"
        )


def set_connection(target: str, name: str, conninfo: str, console: Console = QUIET) -> None:
    """``ALTER SUBSCRIPTION ... CONNECTION``: the publisher's new address (a moved server, a promoted standby),
    checked before it is stored: it answers, its version allows the subscription's options, its publications exist
    and the subscription's slot is there, a pgoutput slot of its database (on a promoted standby: a failover slot
    it had synchronized). A running worker sees the change and reconnects (the conninfo is a stream option)."""
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
    with connect_publisher(conninfo, "alter", name, doing="check the new connection") as pub:
        two_phase = sub.subtwophasestate is not TwoPhaseState.DISABLED
        check_publisher_version(
            pub.server_version, two_phase=two_phase, origin=sub.suborigin, failover=sub.subfailover
        )
        _check_new_publisher(pub, sub)
        with target_errors(target):
            applied = origin_progress(catalog, sub)
        _check_nothing_lost(pub, sub, applied)
    with target_errors(target):
        catalog.update_subscription(sub.subid, subconninfo=without_password(conninfo))
    warn_password_not_stored(conninfo, console)
    console.info(
        f'subscription "{name}" altered: connection {describe(without_password(conninfo))}'
        + ("; its running worker reconnects" if sub.subenabled else "")
    )


def _check_nothing_lost(pub: ReplicationConnection, sub: Subscription, applied: int) -> None:
    """A promoted standby whose WAL ends before what the target has applied lacks transactions the target holds (a
    failover without ``synchronized_standby_slots`` can lose them): following it would leave the two apart, so
    refuse and say so. (Same LSN space: a promoted standby's WAL continues the old primary's.)"""
    ((in_recovery, wal_end),) = _pub_query(
        pub,
        "SELECT pg_is_in_recovery(), CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()"
        " ELSE pg_current_wal_lsn() END::text",
    )
    if wal_end is not None and parse_lsn(wal_end) < applied:
        raise SubscriptionError(
            f"the server at the new connection{' (still a standby)' if in_recovery else ''} has WAL up to "
            f'{wal_end}, but the target has applied subscription "{sub.subname}"\'s changes up to '
            f"{format_lsn(applied)}: it lacks transactions that the target holds (a failover that lost them: set "
            "synchronized_standby_slots on the primary to prevent it)",
            "the target and that server have diverged; re-create the subscription against it (applier drop, then "
            "applier create, which copies again); the connection is unchanged",
        )


def _check_new_publisher(pub: ReplicationConnection, sub: Subscription) -> None:
    ((dbname,),) = _pub_query(pub, "SELECT current_database()")
    missing = missing_publications(pub, sub.subpublications)
    if missing:
        raise SubscriptionError(
            f"the publisher at the new connection (database {dbname}) has no publication "
            + ", ".join(f'"{p}"' for p in missing),
            "check the conninfo's host and dbname; the connection is unchanged",
        )
    slot = sub.subslotname
    if slot is None:
        return
    row = _slot_row(pub, slot)
    if row is None:
        raise SubscriptionError(
            f'replication slot "{slot}" does not exist on the publisher at the new connection (database {dbname}): '
            "the subscription could not resume there",
            "point it at the server that has the slot; after a failover, the slot is on the promoted standby only "
            "if it was a failover slot that the standby synchronized (PostgreSQL 17+); the connection is "
            "unchanged",
        )
    mismatch = slot_mismatch(row, dbname)
    if mismatch:
        raise SubscriptionError(
            f'replication slot "{slot}" at the new connection is {mismatch}',
            "check the conninfo's dbname; the connection is unchanged",
        )
