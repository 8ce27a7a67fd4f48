"""Post-data: indexes, keys, constraints and triggers, built on the target as each table's copy finishes.

The definitions are read from the source *inside the migration's snapshot* (``pg_get_indexdef`` and friends, with an
empty ``search_path`` so every name comes qualified) and stored as steps in ``applier.migration_step``. Each step
names the tables whose copy it waits for and the steps it must follow:

- ``index``: a secondary index, ``CREATE INDEX`` as defined on the source;
- ``key``: the ``CREATE UNIQUE INDEX`` of a primary key or unique constraint, then ``attach``: its
  ``ADD CONSTRAINT … USING INDEX`` (instant). Two transactions: one that held the build's SHARE lock while asking
  for the attach's ACCESS EXCLUSIVE one would deadlock with a second build on the same table;
- ``constraint``: an exclusion constraint or a ``NOT VALID`` check, as on the source (a partition's copy of its
  parent's exclusion constraint too: :mod:`applier.migrate.partitions` attaches its index to the parent's);
- ``fk``: a foreign key ``NOT VALID`` (instant, no scan), once both tables are in and the referenced key is built;
- ``validate``: ``VALIDATE CONSTRAINT`` of a foreign key that is valid on the source (a scan under a lock that
  lets writes through);
- ``replica_identity``: ``REPLICA IDENTITY USING INDEX`` once that index exists;
- ``trigger``: the table's triggers (after the copy, so they never fire on copied rows).

:func:`ready` is the pure scheduling rule; :func:`run_steps` runs ready steps ``jobs`` at a time, each in one
target transaction together with its ``done`` mark (exactly once across kills). Steps on the same tables may still
deadlock (two foreign keys between two tables in opposite directions lock them in opposite orders): PostgreSQL
then cancels one, which is retried.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from applier.migrate import knobs, store
from applier.migrate.steps import Step, StepKind, step_name

__all__ = [
    "LeftOut",
    "Step",
    "definitions",
    "ready",
    "run_steps",
    "step_costs",
    "table_weights",
]


def ready(
    steps: Sequence[Step],
    copied: Collection[str],
    done: Collection[str],
    running: Collection[str],
    cost: Mapping[str, float] | None = None,
) -> list[Step]:
    """Steps that may start now: not done or running, their tables copied, the steps they follow done, and no
    running step holds a lock on one of their tables that they would queue behind. Index builds (``CREATE
    INDEX``'s SHARE lock) run together on one table; every other step (an attach's ACCESS EXCLUSIVE lock, a
    validation's SHARE UPDATE EXCLUSIVE, ...) waits until nothing runs on its tables, and nothing starts on a
    table while it runs. Otherwise an "instant" attach would wait in the lock queue for a long GIN build while
    holding one of the ``jobs`` slots, and the builds queued behind its lock request would wait too.

    Order: with ``cost`` (step -> estimated work, :func:`step_costs`), the instant steps first (they unblock
    others and take no time), then the most expensive build first: the longest build of the biggest table is the
    migration's critical path, and starting it late leaves one core building alone at the end. Ties, and without
    ``cost``: keys first (foreign keys wait for them), then source order."""
    busy: dict[str, set[bool]] = {}  # table -> whether the steps running on it share it
    for s in steps:
        if s.step in running:
            for r in s.relnames:
                busy.setdefault(r, set()).add(s.kind in _SHARED)
    out = [
        s
        for s in steps
        if s.step not in done
        and s.step not in running
        and all(r in copied for r in s.relnames)
        and all(a in done for a in s.after)
        and all(not busy.get(r) or (s.kind in _SHARED and busy[r] == {True}) for r in s.relnames)
    ]
    work = cost or {}
    return sorted(
        out,
        key=lambda s: (
            work.get(s.step, 0.0) > 0,
            -work.get(s.step, 0.0),
            s.kind not in (StepKind.KEY, StepKind.ATTACH),
            s.ord,
        ),
    )


#: Kinds of step that only take a SHARE lock on their table (CREATE INDEX): several may run on it at once.
_SHARED = (StepKind.INDEX, StepKind.KEY)

#: How much more an index build of these access methods costs than a btree build of the same table (measured
#: on the bench's jsonb GIN index: about 3-4x its table's btree builds). Only the order of builds depends on it.
_METHOD_FACTOR = {"gin": 4.0, "gist": 3.0, "spgist": 3.0, "brin": 0.2}
#: Kinds of step that scan their table (their cost grows with it); the others are catalog changes.
_SCANS = (StepKind.INDEX, StepKind.KEY, StepKind.CONSTRAINT, StepKind.VALIDATE)


def step_costs(steps: Sequence[Step], pages: Mapping[str, int]) -> dict[str, float]:
    """An estimate of each step's work from its table's size in pages (``pages``: table -> pages on the source):
    the pages for a scanning step, times the access method's factor for an index; 0 for instant steps (and so
    they go first, see :func:`ready`)."""
    costs: dict[str, float] = {}
    for s in steps:
        if s.kind not in _SCANS:
            costs[s.step] = 0.0
            continue
        size = float(sum(pages.get(r, 0) for r in s.relnames[:1]))  # a validate scans the referencing table
        method = re.search(r"\bUSING (\w+) \(", s.statements[0]) if s.statements else None
        costs[s.step] = size * _METHOD_FACTOR.get(method.group(1).lower() if method else "btree", 1.0)
    return costs


def table_weights(steps: Sequence[Step], pages: Mapping[str, int]) -> dict[str, float]:
    """The work a table's copy starts: its own pages plus the cost of every step that waits for it alone. The
    copy takes the heaviest table first, so that its builds (the critical path) overlap the copy of the others."""
    weights = {t: float(n) for t, n in pages.items()}
    for s in steps:
        if len(s.relnames) == 1 and s.relnames[0] in weights:
            weights[s.relnames[0]] += step_costs([s], pages)[s.step]
    return weights


# --- reading the definitions at the snapshot ----------------------------------------------------------------

_INDEXES = """
SELECT i.relname, x.indrelid::regclass::text, quote_ident(n.nspname) || '.' || quote_ident(i.relname),
       pg_get_indexdef(x.indexrelid), k.oid, k.contype, k.conname, k.condeferrable, k.condeferred, x.indisreplident
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_namespace n ON n.oid = i.relnamespace
LEFT JOIN pg_constraint k ON k.conindid = x.indexrelid AND k.conrelid = x.indrelid AND k.contype IN ('p', 'u', 'x')
WHERE x.indrelid = ANY(%s::regclass[])
ORDER BY x.indrelid, x.indexrelid
"""

_CONSTRAINTS = """
SELECT k.conrelid::regclass::text, k.confrelid::regclass::text, k.conname, k.contype, k.convalidated,
       pg_get_constraintdef(k.oid)
FROM pg_constraint k
WHERE k.conrelid = ANY(%s::regclass[])
  AND (k.contype IN ('f', 'x') OR (k.contype = 'c' AND NOT k.convalidated))
  AND (k.conparentid = 0 OR k.contype = 'x')
ORDER BY k.conrelid, k.oid
"""
# A partition's copy of its parent's exclusion constraint (PostgreSQL 17+; conparentid set) is built here too, as
# pg_dump does: the leaf's own ADD CONSTRAINT builds its index, which partitions.py then attaches to the parent's.
# A cloned foreign key is left out: the parent's ADD CONSTRAINT clones it onto the leaves.

_TRIGGERS = """
SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid)
FROM pg_trigger t WHERE t.tgrelid = ANY(%s::regclass[]) AND NOT t.tgisinternal AND t.tgparentid = 0
ORDER BY t.tgrelid, t.oid
"""


def _alter(table: str) -> sql.Composable:
    return sql.SQL("ALTER TABLE ONLY {} ").format(sql.SQL(table))  # already quoted by regclass::text


@dataclass(frozen=True)
class LeftOut:
    """A foreign key left out because the table it references is not migrated: a note for the user, and a value
    the caller can tell apart (a key to a partitioned table is :mod:`applier.migrate.partitions`' to make)."""

    conname: str
    table: str
    references: str

    def __str__(self) -> str:
        return f"foreign key {self.conname} of {self.table} references {self.references}, which is not migrated: left out"


def definitions(conn: psycopg.Connection[Any], tables: Sequence[str]) -> tuple[list[Step], list[LeftOut]]:
    """The post-data steps of ``tables`` (quoted, qualified names) and what is left out. ``conn`` is a source
    connection inside the migration's snapshot with ``search_path = ''``."""
    steps: list[Step] = []
    notes: list[LeftOut] = []
    keys: dict[str, list[str]] = {}  # table -> its key steps (what foreign keys to it wait for)
    replident = _index_steps(conn, tables, steps, keys)
    _constraint_steps(conn, tables, steps, notes, keys)
    for table, index_name, after in replident:
        text = (
            _alter(table) + sql.SQL("REPLICA IDENTITY USING INDEX {}").format(sql.Identifier(index_name))
        ).as_string(conn)
        steps.append(Step.of(StepKind.REPLICA_IDENTITY, table, (table,), (after,), (text,), len(steps)))
    for table, tgname, tgdef in conn.execute(_TRIGGERS, (list(tables),)):
        steps.append(Step.of(StepKind.TRIGGER, f"{table}.{tgname}", (table,), (), (tgdef,), len(steps)))
    return steps, notes


def _index_steps(
    conn: psycopg.Connection[Any], tables: Sequence[str], steps: list[Step], keys: dict[str, list[str]]
) -> list[tuple[str, str, str]]:
    """The indexes' steps, into ``steps``: an index, or a key's index then its ``ADD CONSTRAINT ... USING INDEX``
    (into ``keys`` too). Returns the replica identities to set: (table, index name, the step that makes it)."""
    replident: list[tuple[str, str, str]] = []
    for (
        index_name,
        table,
        index,
        indexdef,
        con_oid,
        contype,
        conname,
        deferrable,
        deferred,
        is_replident,
    ) in conn.execute(_INDEXES, (list(tables),)):
        if con_oid is not None and contype == "x":
            continue  # built by its ADD CONSTRAINT below
        if con_oid is None:
            steps.append(Step.of(StepKind.INDEX, index, (table,), (), (indexdef,), len(steps)))
            if is_replident:
                replident.append((table, index_name, steps[-1].step))
            continue
        if is_replident:
            replident.append((table, conname, step_name(StepKind.ATTACH, f"{table}.{conname}")))
        kind = "PRIMARY KEY" if contype == "p" else "UNIQUE"
        attach = _alter(table) + sql.SQL("ADD CONSTRAINT {} {} USING INDEX {}").format(
            sql.Identifier(conname), sql.SQL(kind), sql.Identifier(index_name)
        )
        text = attach.as_string(conn)
        if deferrable:
            text += " DEFERRABLE" + (" INITIALLY DEFERRED" if deferred else "")
        build = Step.of(StepKind.KEY, f"{table}.{conname}", (table,), (), (indexdef,), len(steps))
        steps.append(build)
        steps.append(
            Step.of(StepKind.ATTACH, f"{table}.{conname}", (table,), (build.step,), (text,), len(steps))
        )
        keys.setdefault(table, []).append(steps[-1].step)
    return replident


def _constraint_steps(
    conn: psycopg.Connection[Any],
    tables: Sequence[str],
    steps: list[Step],
    notes: list[LeftOut],
    keys: dict[str, list[str]],
) -> None:
    """The other constraints' steps, into ``steps``: a foreign key added ``NOT VALID`` once the key it references
    is attached, then validated if it was valid on the source; one to a table not migrated is left out, into
    ``notes``."""
    selected = set(tables)
    for table, reftable, conname, contype, validated, condef in conn.execute(_CONSTRAINTS, (list(tables),)):
        add = (_alter(table) + sql.SQL("ADD CONSTRAINT {} ").format(sql.Identifier(conname))).as_string(conn)
        if contype != "f":
            steps.append(
                Step.of(StepKind.CONSTRAINT, f"{table}.{conname}", (table,), (), (add + condef,), len(steps))
            )
            continue
        if reftable not in selected:
            notes.append(LeftOut(conname, table, reftable))
            continue
        not_valid = condef if condef.endswith("NOT VALID") else condef + " NOT VALID"
        fk = Step.of(
            StepKind.FK,
            f"{table}.{conname}",
            (table, reftable),
            tuple(keys.get(reftable, ())),
            (add + not_valid,),
            len(steps),
        )
        steps.append(fk)
        if validated:
            validate = (
                _alter(table) + sql.SQL("VALIDATE CONSTRAINT {}").format(sql.Identifier(conname))
            ).as_string(conn)
            steps.append(
                Step.of(
                    StepKind.VALIDATE,
                    f"{table}.{conname}",
                    (table, reftable),
                    (fk.step,),
                    (validate,),
                    len(steps),
                )
            )


#: A step cancelled by PostgreSQL's deadlock detector is run again (after the other transaction went on).
DEADLOCK_RETRIES = 5


#: ``maintenance_work_mem`` of a GIN build. Its CPU time *grows* with the memory it may use (the entries collect in
#: a tree that falls out of the CPU caches as it grows): building the bench's jsonb GIN index on 2M rows on
#: PostgreSQL 15 took 19.0 s of CPU at 4MB, 22.5 s at 16MB, 25.6 s at 64MB (the default) and more at pgcopydb's
#: 1GB (7.1 s against 5.8 s at 64MB on 500k rows). Other builds keep the server's setting: a btree build on 2M
#: rows took the same CPU (0.8-1.0 s) at 64MB and 1GB. ``APPLIER_MIGRATE_MAINTENANCE_WORK_MEM`` sets one value
#: for every build instead. Only before PostgreSQL 18: see :func:`gin_maintenance_work_mem`.
GIN_MAINTENANCE_WORK_MEM = "4MB"
#: From PostgreSQL 18 a GIN index builds in parallel, and a parallel worker needs 32MB of ``maintenance_work_mem``
#: per participant (``plan_create_index_workers``): at 4MB none runs.
GIN_PARALLEL_SINCE = 180000


def gin_maintenance_work_mem(server_version: int) -> str | None:
    """The ``maintenance_work_mem`` for a GIN build on a target of ``server_version`` (``server_version_num``), or
    None for the server's own. Before 18: :data:`GIN_MAINTENANCE_WORK_MEM`. From 18 the server's (64MB by default:
    a leader and one worker): the bench's 2M-row jsonb index took 34.3 and 33.4 s at 4MB, 22.1 and 26.6 s at 64MB,
    alternated on PostgreSQL 18 (2 cores, alone)."""
    return GIN_MAINTENANCE_WORK_MEM if server_version < GIN_PARALLEL_SINCE else None


def _is_gin(step: Step) -> bool:
    return bool(step.statements) and re.search(r"\bUSING gin \(", step.statements[0]) is not None


class _Builders:
    """One target connection per post-data thread, kept for all its steps (a connection costs a backend start
    and several round trips; there are a few steps per table)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.local = threading.local()
        self.lock = threading.Lock()
        self.conns: list[psycopg.Connection[Any]] = []

    def conn(self) -> psycopg.Connection[Any]:
        conn = getattr(self.local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(self.target, autocommit=True)
            conn.execute("SET search_path = ''")
            if mem := knobs.maintenance_work_mem():
                conn.execute("SELECT set_config('maintenance_work_mem', %s, false)", (mem,))
            # A step and its done mark commit together: a crash that loses an asynchronous commit loses both, and
            # the next start builds that step again. Nothing is half done, and each step saves a WAL flush.
            conn.execute("SET synchronous_commit = off")
            self.local.conn = conn
            with self.lock:
                self.conns.append(conn)
        return conn

    def close(self) -> None:
        with self.lock:
            for conn in self.conns:
                conn.close()
            self.conns.clear()

    def build(self, name: str, step: Step) -> float:
        """One step and its done mark in one transaction; returns its seconds."""
        started = time.monotonic()
        conn = self.conn()
        for attempt in range(DEADLOCK_RETRIES + 1):
            try:
                return _build_in(conn, name, step, started)
            except psycopg.errors.DeadlockDetected:
                if attempt == DEADLOCK_RETRIES:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover


def _build_in(conn: psycopg.Connection[Any], name: str, step: Step, started: float) -> float:
    """One attempt at ``step``: its statements and its done mark in one transaction; the seconds since
    ``started`` (the first attempt)."""
    with conn.transaction():
        mem = gin_maintenance_work_mem(conn.info.server_version)
        if mem is not None and _is_gin(step) and not knobs.maintenance_work_mem():
            conn.execute("SELECT set_config('maintenance_work_mem', %s, true)", (mem,))
        for statement in step.statements:
            conn.execute(statement)
        seconds = time.monotonic() - started
        store.mark_step_done(conn, name, step.step, seconds)
    return seconds


def run_steps(
    target: str,
    name: str,
    steps: Sequence[Step],
    copied: Callable[[], set[str]],
    *,
    jobs: int,
    copy_running: Callable[[], bool],
    stop: threading.Event,
    say: Callable[[str], None],
    poll: float = 0.1,
    cost: Mapping[str, float] | None = None,
) -> bool:
    """Run every step as soon as it is ready, ``jobs`` at a time, until all are done (True) or ``stop`` is set
    or no step can ever become ready (False). ``copied()`` reads which tables are copied; ``copy_running()`` says
    whether more may come; ``cost`` orders the ready steps (:func:`ready`)."""
    builders = _Builders(target)
    try:
        return _run(builders, name, steps, copied, jobs, copy_running, stop, say, poll, cost)
    finally:
        builders.close()


def _run(
    builders: _Builders,
    name: str,
    steps: Sequence[Step],
    copied: Callable[[], set[str]],
    jobs: int,
    copy_running: Callable[[], bool],
    stop: threading.Event,
    say: Callable[[str], None],
    poll: float,
    cost: Mapping[str, float] | None,
) -> bool:
    done = {s.step for s in steps if s.done}
    running: dict[Future[float], Step] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="postdata") as pool:
        while len(done) < len(steps) and not stop.is_set():
            in_flight = {s.step for s in running.values()}
            have = copied()
            for step in ready(steps, have, done, in_flight, cost)[: max(0, jobs - len(running))]:
                say(f"post-data: {step.kind} {step.subject} started")
                running[pool.submit(builders.build, name, step)] = step
            if not running and not copy_running() and not ready(steps, copied(), done, ()):
                return False  # nothing runs, nothing can start, no table will arrive
            if not running:
                stop.wait(poll)
                continue
            finished, _ = wait(list(running), timeout=poll, return_when=FIRST_COMPLETED)
            for fut in finished:
                step = running.pop(fut)
                seconds = fut.result()  # an error ends the run: the step stays pending for the next start
                done.add(step.step)
                say(f"post-data: {step.kind} {step.subject} done in {seconds:.1f}s")
        for fut in list(running):
            fut.result()
    return len(done) == len(steps)
