"""``applier drop``: the slot(s) on the publisher first, then the origin and the catalog rows on the target, so
that a failure leaves something ``drop`` can simply be run again on."""

from __future__ import annotations

import time

import psycopg
import sqlalchemy as sa

from applier.catalog.store import Catalog, Subscription
from applier.ddl import capture
from applier.subscriptions import ddl
from applier.subscriptions.common import (
    QUIET,
    SYNC_SLOT_PATTERN,
    Console,
    SubscriptionError,
    _db_error,
    _drop_slot,
    _pub_query,
    connect_publisher,
    open_catalog,
    require_subscription,
    rollback_prepared,
    target_errors,
)
from applier.subscriptions.lock import SubscriptionLock


def drop(target: str, name: str, *, force: bool = False, console: Console = QUIET) -> None:
    """Drop the slot(s) on the publisher, then the origin and the catalog rows on the target.

    Unlike PostgreSQL (behaviour 73), prepared transactions this subscription left on the target are not silently
    orphaned: they hold locks and, once the subid is gone, nobody would ever finish them. So drop refuses while they
    exist, and ``force`` rolls them back. ``force`` also lets drop proceed without the publisher, dropping the local
    state only and printing the slot to drop there by hand.
    """
    catalog = open_catalog(target)
    with target_errors(target):
        sub = require_subscription(catalog, name)
    with SubscriptionLock(target, sub, "drop"):
        with target_errors(target):
            pending = catalog.pending_prepared(sub.subid)
        if pending and not force:
            raise SubscriptionError(
                f'subscription "{name}" has {len(pending)} prepared transaction(s) on the target: '
                + ", ".join(gid for gid, _ in pending),
                "finish them as the publisher did (COMMIT PREPARED or ROLLBACK PREPARED on the target), or pass "
                "--force to roll them back (PostgreSQL's DROP SUBSCRIPTION would leave them behind)",
            )
        _drop_publisher_slots(sub, force=force, console=console)
        with target_errors(target):
            if force:
                rollback_prepared(catalog, sub, console)
            _delete_with_patience(catalog, sub)
    console.info(f'dropped subscription "{name}"')


def _drop_publisher_slots(sub: Subscription, *, force: bool, console: Console) -> None:
    slot = sub.subslotname
    try:
        pub = connect_publisher(sub.subconninfo, "drop", sub.subname, doing="drop its slot")
    except SubscriptionError as exc:
        manual = (
            f"SELECT pg_drop_replication_slot('{slot}') on the publisher"
            if slot
            else "nothing (the subscription has no slot)"
        )
        if sub.subddl and slot:
            manual += f", and remove the DDL capture there: {capture.manual_removal(slot)}"
        if not force:
            raise SubscriptionError(
                exc.message + "; nothing was dropped",
                f"make the publisher reachable and run this again, or pass --force to drop only the local state "
                f"and then run {manual}; meanwhile the slot keeps WAL on the publisher",
            ) from None
        console.warn(f"{exc.message}\nthe publisher's slot is left behind: drop it by hand with {manual}")
        return
    with pub:
        # the capture first: one that cannot be removed then leaves everything as it was
        if sub.subddl and slot is not None:
            _remove_capture(sub, slot, force=force, console=console)
        names = [
            r[0]
            for r in _pub_query(
                pub,
                "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE %s AND database = current_database()",
                (SYNC_SLOT_PATTERN.format(subid=sub.subid),),
            )
        ]
        if slot is not None:
            names.insert(0, slot)
        for name in names:
            if _drop_slot(pub, name):
                console.info(f'dropped replication slot "{name}" on the publisher')
            elif name == slot:
                console.warn(f'replication slot "{name}" did not exist on the publisher')


def _remove_capture(sub: Subscription, slot: str, *, force: bool, console: Console) -> None:
    """The slot's DDL capture, as the slot goes; with ``force``, one that cannot be removed (the publisher's role
    may no longer) is left with a warning that says how, as the slot's case does."""
    try:
        ddl.remove(sub.subconninfo, sub.subname, slot, console)
    except SubscriptionError as exc:
        if not force:
            raise SubscriptionError(
                exc.message + "; nothing was dropped",
                (exc.hint or "make the publisher reachable")
                + f"; then run applier drop {sub.subname} again, or pass --force to leave the capture behind",
            ) from None
        console.warn(
            f"{exc.message}\nthe DDL capture is left behind: remove it on the publisher as a superuser with "
            + capture.manual_removal(slot)
        )


def _delete_with_patience(catalog: Catalog, sub: Subscription, patience: float = 10.0) -> None:
    """The origin cannot be dropped while a session still has it set up; the backend of a worker that has just
    exited may need a moment to go."""
    deadline = time.monotonic() + patience
    while True:
        try:
            catalog.delete_subscription(sub.subid)
            return
        except sa.exc.OperationalError as exc:
            if not isinstance(_db_error(exc), psycopg.errors.ObjectInUse) or time.monotonic() >= deadline:
                raise
        time.sleep(0.2)
