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

The set-up (:mod:`applier.migrate.setup`) and the following (:mod:`applier.migrate.follow`) are classes of their
own; :func:`start` composes them under one stop event, set by SIGTERM/SIGINT or by the migration ending.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from applier.errors import ApplierError
from applier.migrate import ownership, store
from applier.migrate.follow import CAUGHT_UP_BYTES, Follower, watch
from applier.migrate.preflight import START_FAILED
from applier.migrate.selection import Selection
from applier.migrate.setup import SetUp
from applier.signals import STOP_SIGNALS, set_once

__all__ = ["CAUGHT_UP_BYTES", "StartOptions", "start"]


@dataclass(frozen=True)
class StartOptions:
    """What ``applier migrate start`` was asked: the migration, both servers, the selection, the jobs, and whether to
    cut over by itself once caught up."""

    name: str
    source: str
    target: str
    selection: Selection
    table_jobs: int = 2
    index_jobs: int = 2
    cutover: bool = False
    ddl: bool = True  # the DDL capture on the source (start --no-ddl: off)


def start(opts: StartOptions, say: Callable[[str], None]) -> int:
    """Set up what the migration's phase has not, then follow until the migration ends; start's exit status.

    Signals as ``applier run``'s: SIGTERM/SIGINT/SIGHUP set the stop event (:func:`applier.signals.set_once`: a
    second signal inside the first must not deadlock). While following, ``runner.run`` installs its own handlers and
    takes the same event as its ``stop``, so a signal that came before stops its worker too, as a first signal
    would. The whole run holds ``start``'s lock (:mod:`applier.migrate.ownership`): a cutover fences nothing
    without it, and a second ``start`` of the migration is refused. A failure is recorded in the migration, where
    ``status`` shows it with what to do."""
    stop = threading.Event()

    def on_signal(signum: int) -> None:
        say(f"{signal.Signals(signum).name} received: stopping")

    lock = ownership.hold_start(opts.target, opts.name)
    previous = {s: signal.signal(s, set_once(stop, on_signal)) for s in STOP_SIGNALS}
    finished = threading.Event()
    watcher = threading.Thread(
        target=watch,
        args=(opts.target, opts.name, stop, finished, lock, say),
        name="migration-watch",
        daemon=True,
    )
    watcher.start()
    try:
        setup = SetUp(opts, say, stop)
        try:
            ready = setup.run()
        finally:
            setup.close()
        return ready if isinstance(ready, int) else Follower(opts, say, stop).run(ready)
    except (ApplierError, psycopg.Error) as exc:
        _record(opts, exc)
        raise
    finally:
        finished.set()
        for s, h in previous.items():
            signal.signal(s, h)


def _record(opts: StartOptions, exc: BaseException) -> None:
    """Why start stopped, into the migration's record (``status``'s ``error``) with what to do; best effort (the
    target may be what failed). The set-up's own failures say it themselves (:meth:`SetUp.undo`)."""
    with contextlib.suppress(Exception), psycopg.connect(opts.target, autocommit=True) as target:
        m = store.load(target, opts.name)
        if m is None or m.phase.ended or (m.error or "").startswith(START_FAILED):
            return
        where = (
            f"; the slot {m.slot} keeps WAL on the source until start resumes (abort removes it)"
            if m.slot_created
            else ""
        )
        store.record_error(target, opts.name, f"{START_FAILED}{exc}{where}; fix it and run start again")
