"""The narrow interface through which the apply worker has tables added while streaming synchronised.

PostgreSQL's apply worker launches tablesync workers and meets them at SYNCWAIT (``process_syncing_tables``,
``wait_for_relation_state_change``); our worker does the same through a :class:`TableSyncCoordinator` that the
composition root (:mod:`applier.runner`) hands it: ``tablesync.live.LiveSyncCoordinator``, whose sync runs the copy
and then the catch-up, on the very apply loop (:mod:`applier.apply.loop`) in a sync-worker context. ``applier.apply``
never imports ``tablesync`` (an import-linter contract checks it); without a coordinator, added tables simply wait
(as with ``max_sync_workers_per_subscription = 0``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SyncFailure:
    """Why a sync failed, in the terms of an apply error's record (``applier status``, behaviour 54): the tables as
    ``relation`` (the one that failed when known, else every table of the sync), ``message_type`` ``COPY`` for the
    copy or the catch-up's message (``INSERT``, ``COMMIT``..., ``CATCHUP`` when no message was being applied).
    ``context``: a catch-up error's context line (:meth:`applier.apply.context.ErrorContext.describe`), for the
    log line only: the record keeps its parts in columns, and the message without it."""

    message: str
    relation: str | None
    message_type: str
    sqlstate: str | None = None
    remote_xid: int | None = None
    context: str | None = None


class TableSync(Protocol):
    """One running synchronisation of every table in ``i``/``d``/``f``."""

    @property
    def waiting(self) -> bool:
        """At SYNCWAIT: the copy is done and the sync needs the stream's position (:meth:`proceed`)."""
        ...

    @property
    def finished(self) -> bool:
        """Done (the tables are ``s``) or failed."""
        ...

    @property
    def failed(self) -> bool: ...

    @property
    def failure(self) -> SyncFailure | None:
        """Why it failed; None while it runs, after a success, and when it was stopped (not an error)."""
        ...

    def proceed(self, current_lsn: int) -> None:
        """The apply stream is at a transaction boundary at ``current_lsn``: join it there."""
        ...

    def wait(
        self,
        interrupt: threading.Event | None = None,
        timeout: float | None = None,
        *,
        tick: Callable[[], None] | None = None,
    ) -> bool:
        """Block until finished (``tick`` keeps the apply stream alive meanwhile); ``interrupt`` stops the sync."""
        ...

    def close(self) -> None: ...


class TableSyncCoordinator(Protocol):
    """Starts the synchronisation of the tables added while streaming."""

    def start(self, target_conninfo: str, subname: str, log: logging.Logger) -> TableSync: ...
