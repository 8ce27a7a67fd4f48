"""Create, alter, drop and inspect subscriptions: what ``applier create|alter|drop|status`` do, apart from parsing.

Each command checks everything it can *before* it changes anything, and says what is wrong and what to do
(:class:`SubscriptionError` carries a message and a hint, printed as psql prints ``ERROR``/``HINT``). Where a command
must change two servers (a catalog row on the target and a slot on the publisher) it orders the steps so that a
failure leaves nothing half-made: ``create`` undoes its catalog row and origin if the slot cannot be created, and
``drop`` removes the slot before the local state, so it can simply be run again.

Who may run a subscription is decided by a session-level advisory lock on the target, keyed by subid
(:class:`SubscriptionLock`): ``applier run`` holds it for the life of the worker, and ``drop`` and
``alter --set two_phase`` take it for their duration, so they never act under a running worker and a worker never
starts in their middle. Advisory locks vanish with the session, so a crashed worker never leaves a stale lock.

One module per verb (:mod:`.cmd_create`, :mod:`.cmd_alter`, :mod:`.cmd_drop`, :mod:`.cmd_status`), so that a
change to one command is read in one place; what they share is in :mod:`.common` (errors, console, the target's
catalog, the publisher connection), :mod:`.lock` (the per-subscription lock) and :mod:`.grants` (the apply role's
privileges). The verb modules are not named ``create`` and so on: the package re-exports functions of those names
(``subs.create``), which would hide a submodule of the same name from ``import ... as``. Callers import from this
package, as they did when it was one module; the names below are its interface.
"""

from __future__ import annotations

from applier.subscriptions.cmd_alter import (
    SETTABLE,
    alter_options,
    parse_set_options,
    refresh_publication,
    reset_stats,
    set_connection,
    set_enabled,
    set_skip_lsn,
)
from applier.subscriptions.cmd_create import CreateOptions, create
from applier.subscriptions.cmd_drop import drop
from applier.subscriptions.cmd_status import format_status, status
from applier.subscriptions.common import (
    ALTER_SLOT_TWO_PHASE_VERSION,
    LOCK_NAMESPACE,
    MIN_PUBLISHER_VERSION,
    QUIET,
    STANDBY_NAMESPACE,
    SYNC_SLOT_PATTERN,
    Console,
    SubscriptionBusy,
    SubscriptionError,
    connect_publisher,
    open_catalog,
    origin_progress,
    published_tables,
    require_subscription,
    rollback_prepared,
    target_errors,
)
from applier.subscriptions.grants import read_target_facts, warn_if_superuser, warn_superuser_once
from applier.subscriptions.lock import LockHolder, SubscriptionLock, lock_holder, standbys

__all__ = [
    "ALTER_SLOT_TWO_PHASE_VERSION",
    "LOCK_NAMESPACE",
    "MIN_PUBLISHER_VERSION",
    "QUIET",
    "SETTABLE",
    "STANDBY_NAMESPACE",
    "SYNC_SLOT_PATTERN",
    "Console",
    "CreateOptions",
    "LockHolder",
    "SubscriptionBusy",
    "SubscriptionError",
    "SubscriptionLock",
    "alter_options",
    "connect_publisher",
    "create",
    "drop",
    "format_status",
    "lock_holder",
    "open_catalog",
    "origin_progress",
    "parse_set_options",
    "published_tables",
    "read_target_facts",
    "refresh_publication",
    "require_subscription",
    "reset_stats",
    "rollback_prepared",
    "set_connection",
    "set_enabled",
    "set_skip_lsn",
    "standbys",
    "status",
    "target_errors",
    "warn_if_superuser",
    "warn_superuser_once",
]
