"""Set up a subscription the short way, for tests and benchmarks of the apply worker.

``applier create`` is the real way (it checks everything and copies the tables). Here the tables already exist on
both sides, start ``r`` (ready, as with ``--no-copy-data``), and the slot is created with plain SQL, so a test
reaches the interesting part in a few hundred milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from applier.apply.worker import ApplyWorker, WorkerThread
from applier.catalog.store import Catalog, Subscription
from applier.testing.cluster import Database
from state.tables import SyncState
from state.twophase import TwoPhaseState


@dataclass
class ApplySetup:
    """A subscription named ``name`` from ``publisher`` to ``target``: publication, slot and slot all ``name``."""

    publisher: Database
    target: Database
    name: str
    catalog: Catalog
    sub: Subscription

    def worker(self, **kwargs: Any) -> ApplyWorker:
        kwargs.setdefault("retry_initial", 0.1)
        kwargs.setdefault("retry_max", 1.0)
        return ApplyWorker(self.target.dsn, self.name, **kwargs)

    def start(self, **kwargs: Any) -> WorkerThread:
        """Run the worker in a thread; ``stop()`` it at the end."""
        return WorkerThread(self.worker(**kwargs)).start()

    def refresh(self) -> Subscription:
        self.sub = self.catalog.require(self.name)
        return self.sub


def setup_subscription(
    publisher: Database,
    target: Database,
    name: str,
    tables: Sequence[str],
    *,
    two_phase_state: TwoPhaseState | str = TwoPhaseState.DISABLED,
    streaming: str = "off",
    binary: bool = False,
    disable_on_error: bool = False,
    table_state: SyncState | str = SyncState.READY,
    run_as_owner: bool = False,
    ddl: bool = False,
) -> ApplySetup:
    """Publication ``name`` FOR TABLE ``tables`` (which must exist on both sides), catalog rows with every table in
    ``table_state``, and a pgoutput slot ``name`` (two-phase when ``two_phase_state`` is ``e``). The states may be
    given as the catalog's letters, for short tests."""
    two_phase_state, table_state = TwoPhaseState(two_phase_state), SyncState(table_state)
    idents = [sql.Identifier(*t.split(".", 1)) for t in tables]
    publisher.execute(
        sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(name), sql.SQL(", ").join(idents))
    )
    publisher.execute(
        "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)",
        (name, two_phase_state == TwoPhaseState.ENABLED),
    )
    catalog = Catalog.connect(target.dsn)
    catalog.ensure()
    sub = catalog.create_subscription(
        subname=name,
        conninfo=publisher.dsn,
        publications=[name],
        two_phase_state=two_phase_state,
        streaming=streaming,
        binary=binary,
        disable_on_error=disable_on_error,
        origin="any",
        slot_name=name,
        enabled=True,
        copy_data=False,
        run_as_owner=run_as_owner,
        ddl=ddl,
    )
    for t in tables:
        relid = target.scalar("SELECT %s::regclass::oid", (t,))
        catalog.add_table(sub.subid, int(relid), t, table_state, None)
    return ApplySetup(publisher, target, name, catalog, sub)
