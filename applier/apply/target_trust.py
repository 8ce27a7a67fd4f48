"""The trust check of the apply session's row changes (applier.catalog.trust, docs/security.md): written into the
prepared statements themselves where PostgreSQL's plan cache makes that enough, else a LOCK and a guard statement
before a table's first change in a local transaction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.apply.context import ErrorContext
from applier.apply.pipeline import Pipeline
from applier.apply.relmap import LocalTable, RelMapEntry
from applier.catalog.trust import SCHEMA as TRUST_SCHEMA


def tbl(local: LocalTable) -> sql.Composable:
    return sql.Identifier(local.schema, local.name)


def only(entry: RelMapEntry) -> sql.Composable:
    """ONLY for plain tables (inheritance children are separate publisher relations); a partitioned table's
    changes are meant for its partitions (behaviour 49)."""
    return sql.SQL("ONLY ") if entry.relkind == "r" else sql.SQL("")


def _lock_sql(entry: RelMapEntry, mode: str) -> sql.Composable:
    return sql.SQL("LOCK TABLE {}{} IN " + mode + " MODE").format(only(entry), tbl(entry.local))


def _trust_call(entry: RelMapEntry, event: str, function: str) -> sql.Composable:
    """``applier.<function>(table, event, cols)``; an INSERT's columns are the ones the change sends: the defaults
    of the others run."""
    cols = entry.names if event == "I" else ()
    return sql.SQL('{}.{}({}::pg_catalog.oid::pg_catalog.regclass, {}::"char", {}::pg_catalog.text[])').format(
        sql.Identifier(TRUST_SCHEMA), sql.SQL(function), sql.Literal(entry.local.oid), sql.Literal(event),
        sql.Literal(list(cols)),
    )  # fmt: skip


def _guard_condition(entry: RelMapEntry, event: str) -> sql.Composable:
    """``CAST(NULL AS domain) IS NULL ... AND applier.trust_ok(...) IS NULL``, which the planner folds to false
    once the check has passed (the call to true). A plan with it depends on the table (a relcache invalidation
    plans it again) and on each domain the table's columns hold: a constraint added to one of them plans it again
    too (a cast to a domain records that dependency, even while the domain has no constraint, so the casts come
    first, before the condition is known false)."""
    domains = [sql.SQL("CAST(NULL AS {}) IS NULL").format(sql.Identifier(*d)) for d in entry.local.domains]
    call = _trust_call(entry, event, "trust_ok")
    return sql.SQL(" AND ").join([*domains, sql.SQL("{} IS NULL").format(call)])


def _guard_sql(entry: RelMapEntry, event: str) -> sql.Composable:
    """The guard statement of ``event`` changes of ``entry``'s table (see :meth:`TrustedStatements._guard`).

    A plain table's: ``SELECT FROM ONLY t WHERE`` :func:`_guard_condition`: it returns no row and reads none. A
    partitioned table's calls ``applier.trust_check``, which is not folded: it checks every time."""
    if entry.relkind == "p":
        return sql.SQL("SELECT {}").format(_trust_call(entry, event, "trust_check"))
    return sql.SQL("SELECT FROM ONLY {} WHERE {}").format(tbl(entry.local), _guard_condition(entry, event))


def checked(entry: RelMapEntry, event: str) -> sql.Composable:
    """`` AND NOT (`` :func:`_guard_condition` ``)``: a row statement's own trust check, folded to nothing once it
    passed (:meth:`DmlStatements.embeds`)."""
    return sql.SQL(" AND NOT ({})").format(_guard_condition(entry, event))


class TrustedStatements:
    """Prepared statements of one target session, and their trust check."""

    def __init__(self, conn: psycopg.Connection[Any], pipeline: Pipeline, run_as_owner: bool) -> None:
        self.conn = conn
        self.pipeline = pipeline
        self._stmt_seq = 0
        #: the subscription's run_as_owner: trust the tables' owners, so no trust check (applier.catalog.trust)
        self.run_as_owner = run_as_owner
        #: in the open local transaction: the tables locked, and the guard statements run, so far
        self._locked: set[int] = set()
        self._guarded: set[bytes] = set()

    def _statement(self, entry: RelMapEntry, key: Any, build: Callable[[], tuple[sql.Composable, Sequence[int]]],
                   ctx: ErrorContext | None) -> bytes:  # fmt: skip
        name = entry.statements.get(key)
        if name is None:
            query, types = build()
            self._stmt_seq += 1
            name = f"applier_{self._stmt_seq}".encode()
            self.pipeline.send_prepare(name, query.as_bytes(self.conn), types, ctx)
            entry.statements[key] = name
        return name

    # --- the trust check (applier.catalog.trust, docs/security.md) -------------------------------------------
    def new_transaction(self) -> None:
        """A local transaction begins: each table is locked and checked again at its first change in it."""
        self._locked.clear()
        self._guarded.clear()

    def embeds(self, entry: RelMapEntry) -> bool:
        """Whether ``entry``'s prepared INSERT, UPDATE and DELETE carry the trust check themselves (a plain table,
        not run_as_owner): their WHERE ends with ``AND NOT (`` the guard's condition ``)``. PostgreSQL locks a
        prepared statement's tables before it looks whether its plan is still valid, and plans it again when not
        (``RevalidateCachedQuery``, ``CheckCachedPlan``): the lock-then-check order that :meth:`_guard` makes with
        two statements more per table and transaction (issue 29: 15 statements for a tpcb-like transaction
        instead of 7). The COPY, the bulk statements (unnamed, planned once) and a partitioned table (checked
        every time) keep the guard, and so does a table whose columns hold a domain: a parameter of a domain type
        runs the domain's constraints when the server reads it (``domain_in``, at Bind), before any plan exists,
        so there only a guard that runs, and fails, first keeps them from running unchecked."""
        return not self.run_as_owner and entry.relkind != "p" and not entry.local.domains

    def check(self, entry: RelMapEntry, event: str, ctx: ErrorContext | None) -> None:
        """The trust check of a change about to be sent, unless this local transaction has had it (or
        run_as_owner)."""
        if not self.run_as_owner and entry.statements.get(("guard", event)) not in self._guarded:
            self._guard(entry, event, ctx)

    def _guard(self, entry: RelMapEntry, event: str, ctx: ErrorContext | None) -> None:
        """Before the first ``event`` change (``I``, ``U``, ``D``) of ``entry``'s table in this local transaction:
        lock the table (ROW EXCLUSIVE, as the change would), then run its guard statement, which fails when the
        change would run code that the apply role does not trust.

        Why the lock first: a change to the table's triggers, rules, policies, defaults, constraints or indexes
        needs a lock that conflicts with ours, so none can commit between the check and our commit; and the guard
        is planned (and checked) with a snapshot taken after the lock, so it sees any that committed before. A
        plain table's guard is planned once (``applier.trust_ok`` is folded at plan time) and planned again, with
        the check, only after such a change invalidated it; a partitioned table's runs the check every time (a
        partition's triggers do not invalidate its parent's plans)."""
        name = entry.statements.get(("guard", event))
        if name is None:
            name = self._statement(entry, ("guard", event), lambda: (_guard_sql(entry, event), ()), ctx)
        oid = entry.local.oid
        if oid not in self._locked:
            lock = entry.statements.get("lock")
            if lock is None:
                lock = self._statement(entry, "lock", lambda: (_lock_sql(entry, "ROW EXCLUSIVE"), ()), ctx)
            self.pipeline.send_prepared(lock, (), None, ctx)
            self._locked.add(oid)
        self.pipeline.send_prepared(name, (), None, ctx)
        self._guarded.add(name)

    def _guard_truncate(self, entries: Sequence[RelMapEntry], ctx: ErrorContext | None) -> None:
        """The trust check of a TRUNCATE (rare): its tables locked as TRUNCATE will lock them, then checked now
        (``applier.trust_check``: TRUNCATE triggers, and row-level security is no matter for it)."""
        targets = sql.SQL(", ").join(sql.SQL("{}{}").format(only(e), tbl(e.local)) for e in entries)
        self.pipeline.send_query(
            sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(targets).as_bytes(self.conn), None, ctx
        )
        for e in entries:
            check = sql.SQL(
                "SELECT {}.trust_check({}::pg_catalog.oid::pg_catalog.regclass, 'T', '{{}}')"
            ).format(sql.Identifier(TRUST_SCHEMA), sql.Literal(e.local.oid))
            self.pipeline.send_query(check.as_bytes(self.conn), None, ctx)
