# ruff: noqa: S608 - the model writes SQL over its own fixed table names; every value is a sql.Literal or an int
"""Hypothesis strategies for replication workloads, and the code that runs them on a publisher.

A workload is drawn as a list of *abstract actions* (begin, change a row, savepoint, roll back to it, end the
transaction by commit / rollback / prepare, resolve a prepared transaction later, truncate, a large insert) over
several sessions, and a deterministic model turns it into concrete SQL steps that are always valid on the publisher:
inserts use fresh keys, updates and deletes pick rows that exist, sessions own disjoint key ranges (so interleaved
sessions never block each other), a session with a prepared transaction waits for its resolution, and a TRUNCATE only
runs when nothing else is open. Because the model resolves actions against state, hypothesis can drop any action
while shrinking and the rest still makes sense — a failure shrinks to a short SQL script (:meth:`Workload.to_sql`).

The schema covers the replica identities that matter: a primary key with a TOASTed column (so updates send
unchanged-TOAST ``u`` values), REPLICA IDENTITY FULL without a key, and REPLICA IDENTITY USING INDEX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psycopg
from hypothesis import strategies as st
from psycopg import sql

from applier.testing.cluster import Database

TABLES = ("public.wl_pk", "public.wl_full", "public.wl_idx")

SCHEMA_SQL = """
CREATE TABLE wl_pk (id bigint PRIMARY KEY, v text, n numeric, big text);
ALTER TABLE wl_pk ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE wl_full (a bigint, b text, ts timestamptz);
ALTER TABLE wl_full REPLICA IDENTITY FULL;
CREATE TABLE wl_idx (k bigint NOT NULL, v text, extra int[]);
CREATE UNIQUE INDEX wl_idx_k ON wl_idx (k);
ALTER TABLE wl_idx REPLICA IDENTITY USING INDEX wl_idx_k;
"""

_KEY_BASE = 1_000_000_000  # session s owns keys (s+1)*_KEY_BASE + n


@dataclass(frozen=True)
class Step:
    """One statement of one session. ``kind`` marks the points where tests compare targets (``prepare``,
    ``commit_prepared``, ``rollback_prepared``) and statements that need their own connection state."""

    session: int
    sql: str
    kind: str = "sql"


KEY_COLUMNS = {"public.wl_pk": "id", "public.wl_full": "a", "public.wl_idx": "k"}


@dataclass(frozen=True)
class Workload:
    steps: tuple[Step, ...]
    sessions: int
    #: the key column values each table holds at the end, as the model predicts them
    expected_keys: dict[str, frozenset[int]] = field(default_factory=dict)

    def to_sql(self) -> str:
        """The workload as a readable script (what a failing test prints to reproduce it)."""
        return "\n".join(f"-- s{s.session}\n{s.sql};" for s in self.steps)

    @property
    def prepared_count(self) -> int:
        return sum(1 for s in self.steps if s.kind == "prepare")


# --- abstract actions ------------------------------------------------------------------------------------------

_TEXTS = st.one_of(
    st.sampled_from(
        ["", "x", "it's", 'say "hi"', "back\\slash", "tab\there", "newline\nhere", "ünïcødé ✓", "NULL"]
    ),
    st.text(
        alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters="\x00"), max_size=12
    ),
)
_NUMERICS = st.one_of(
    st.sampled_from(
        [
            "0",
            "-0.5",
            "3.14159265358979323846264338327950288",
            "1e30",
            "NaN",
            "123456789012345678901234567890",
        ]
    ),
    st.integers(-(10**20), 10**20).map(str),
)

_action = st.one_of(
    st.tuples(st.just("op"), st.integers(0, 2), st.sampled_from(["insert", "insert", "update", "rekey", "delete"]),
              st.integers(0, 2), st.integers(0, 50), _TEXTS, _NUMERICS),
    st.tuples(st.just("end"), st.integers(0, 2), st.sampled_from(["commit", "commit", "rollback", "prepare"])),
    st.tuples(st.just("resolve"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("savepoint"), st.integers(0, 2)),
    st.tuples(st.just("rollback_to"), st.integers(0, 2)),
    st.tuples(st.just("truncate"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("big"), st.integers(0, 2), st.integers(200, 3000)),
)  # fmt: skip


def workloads(*, max_actions: int = 40, sessions: int = 3, big: bool = True, truncate: bool = True,
              prepared: bool = True, min_prepared: int = 0, min_actions: int = 0) -> st.SearchStrategy[Workload]:  # fmt: skip
    """Random interleaved workloads over :data:`SCHEMA_SQL`'s tables.

    ``big`` allows multi-thousand-row transactions (they stream when the publisher's ``logical_decoding_work_mem``
    is small); ``prepared`` allows two-phase endings. ``min_prepared`` inserts that many "change a row, then
    PREPARE" pairs at drawn positions, so every example has prepared transactions (random actions alone rarely
    make one in short workloads, and filtering for them is too expensive); they shrink like the rest.
    ``min_actions``: hypothesis draws short lists most of the time (a median of a few actions); a floor makes every
    example exercise interleaving, at the cost of shrinking no further than that.
    """

    def build(actions: list[tuple]) -> Workload:
        return _Model(sessions, big=big, truncate=truncate, prepared=prepared).run(actions)

    if not min_prepared:
        return st.lists(_action, min_size=min_actions, max_size=max_actions).map(build)
    forced = st.tuples(st.integers(0, max_actions), st.integers(0, sessions - 1), st.booleans())

    def with_prepares(drawn: tuple[list[tuple], list[tuple[int, int, bool]]]) -> list[tuple]:
        actions, prepares = drawn
        for pos, sid, big_one in sorted(prepares, reverse=True):
            change = ("big", sid, 2500) if big_one else ("op", sid, "insert", 0, 0, "p", "1")
            actions[pos:pos] = [change, ("end", sid, "prepare")]
        return actions

    pairs = st.lists(forced, min_size=min_prepared, max_size=min_prepared)
    return (
        st.tuples(st.lists(_action, min_size=min_actions, max_size=max_actions), pairs)
        .map(with_prepares)
        .map(build)
    )


# --- the model -------------------------------------------------------------------------------------------------


@dataclass
class _Session:
    sid: int
    next_key: int
    in_txn: bool = False
    pending_gid: str | None = None
    # rows this session owns, per table, as committed + the open transaction's view
    committed: dict[int, list[int]] = field(default_factory=lambda: {0: [], 1: [], 2: []})
    current: dict[int, list[int]] | None = None
    savepoints: list[dict[int, list[int]]] = field(default_factory=list)
    prepared_view: dict[int, list[int]] | None = None


class _Model:
    def __init__(self, sessions: int, *, big: bool, truncate: bool, prepared: bool) -> None:
        self.sessions = [_Session(s, (s + 1) * _KEY_BASE) for s in range(sessions)]
        self.steps: list[Step] = []
        self.big, self.truncate, self.prepared = big, truncate, prepared
        self.gids = 0

    def emit(self, s: _Session, text: str, kind: str = "sql") -> None:
        self.steps.append(Step(s.sid, text, kind))

    def fresh(self, s: _Session) -> int:
        s.next_key += 1
        return s.next_key

    def begin(self, s: _Session) -> bool:
        if s.pending_gid is not None:
            return False  # its prepared transaction holds locks on its rows: wait for the resolution
        if not s.in_txn:
            self.emit(s, "BEGIN")
            s.in_txn = True
            s.current = {t: list(keys) for t, keys in s.committed.items()}
            s.savepoints = []
        return True

    def run(self, actions: Iterable[tuple]) -> Workload:
        for a in actions:
            s = self.sessions[a[1] % len(self.sessions)]
            getattr(self, f"_{a[0]}")(s, *a[2:])
        for s in self.sessions:  # finish everything so the end state is comparable
            if s.in_txn:
                self._end(s, "commit")
            if s.pending_gid is not None:
                self._resolve(s, True)
        expected = {
            name: frozenset(k for s in self.sessions for k in s.committed[t]) for t, name in enumerate(TABLES)
        }
        return Workload(tuple(self.steps), len(self.sessions), expected)

    def _op(self, s: _Session, op: str, table: int, pick: int, text: str, num: str) -> None:
        if not self.begin(s):
            return
        assert s.current is not None
        keys = s.current[table]
        lit = sql.Literal(text).as_string(None)
        if op == "insert" or not keys:
            k = self.fresh(s)
            keys.append(k)
            if table == 0:
                big = f"repeat(md5({k}::text), 300)" if k % 3 == 0 else "NULL"
                self.emit(s, f"INSERT INTO wl_pk (id, v, n, big) VALUES ({k}, {lit}, '{num}', {big})")
            elif table == 1:
                self.emit(
                    s, f"INSERT INTO wl_full (a, b, ts) VALUES ({k}, {lit}, '2024-02-29 12:00:00.123456+01')"
                )
            else:
                self.emit(s, f"INSERT INTO wl_idx (k, v, extra) VALUES ({k}, {lit}, ARRAY[{k % 7}, NULL, 3])")
            return
        k = keys[pick % len(keys)]
        if op == "update":
            col = {0: "v", 1: "b", 2: "v"}[table]
            where = {0: "id", 1: "a", 2: "k"}[table]
            extra = f", n = '{num}'" if table == 0 else ""
            self.emit(s, f"UPDATE {TABLES[table].split('.')[1]} SET {col} = {lit}{extra} WHERE {where} = {k}")
        elif op == "rekey":
            new = self.fresh(s)
            keys[keys.index(k)] = new
            where = {0: "id", 1: "a", 2: "k"}[table]
            self.emit(s, f"UPDATE {TABLES[table].split('.')[1]} SET {where} = {new} WHERE {where} = {k}")
        else:
            keys.remove(k)
            where = {0: "id", 1: "a", 2: "k"}[table]
            self.emit(s, f"DELETE FROM {TABLES[table].split('.')[1]} WHERE {where} = {k}")

    def _big(self, s: _Session, rows: int) -> None:
        if not self.big or not self.begin(s):
            return
        assert s.current is not None
        first = s.next_key + 1
        s.next_key += rows
        s.current[0].extend(range(first, first + rows))
        self.emit(
            s,
            f"INSERT INTO wl_pk (id, v, n) SELECT g, 'bulk ' || g, g * 1.5 FROM generate_series({first}, {first + rows - 1}) g",
        )

    def _savepoint(self, s: _Session) -> None:
        if not s.in_txn:
            return
        assert s.current is not None
        s.savepoints.append({t: list(k) for t, k in s.current.items()})
        self.emit(s, f"SAVEPOINT sp{len(s.savepoints)}")

    def _rollback_to(self, s: _Session) -> None:
        if not s.in_txn or not s.savepoints:
            return
        self.emit(s, f"ROLLBACK TO SAVEPOINT sp{len(s.savepoints)}")
        s.current = s.savepoints.pop()

    def _end(self, s: _Session, how: str) -> None:
        if not s.in_txn:
            return
        if how == "prepare" and not self.prepared:
            how = "commit"
        s.in_txn = False
        if how == "commit":
            self.emit(s, "COMMIT")
            assert s.current is not None
            s.committed = s.current
        elif how == "rollback":
            self.emit(s, "ROLLBACK")
        else:
            self.gids += 1
            s.pending_gid = f"wl_{s.sid}_{self.gids}"
            s.prepared_view = s.current
            self.emit(s, f"PREPARE TRANSACTION '{s.pending_gid}'", "prepare")
        s.current = None

    def _resolve(self, s: _Session, commit: bool) -> None:
        if s.pending_gid is None:
            return
        if commit:
            self.emit(s, f"COMMIT PREPARED '{s.pending_gid}'", "commit_prepared")
            assert s.prepared_view is not None
            s.committed = s.prepared_view
        else:
            self.emit(s, f"ROLLBACK PREPARED '{s.pending_gid}'", "rollback_prepared")
        s.pending_gid, s.prepared_view = None, None

    def _truncate(self, s: _Session, restart: bool) -> None:
        if not self.truncate or any(o.in_txn or o.pending_gid for o in self.sessions):
            return  # TRUNCATE takes an exclusive lock: only when nothing else is open
        self.emit(s, "TRUNCATE wl_full, wl_idx" + (" RESTART IDENTITY" if restart else ""))
        for o in self.sessions:
            o.committed = {0: o.committed[0], 1: [], 2: []}


# --- running ---------------------------------------------------------------------------------------------------


def create_schema(*dbs: Database) -> None:
    for db in dbs:
        db.execute(SCHEMA_SQL)


def run_workload(db: Database, workload: Workload, *, on_step: Callable[[Step], None] | None = None) -> None:
    """Execute the steps on ``db`` with one connection per session, in order. ``on_step`` runs after each step
    (tests use it to compare targets at the PREPARE / COMMIT PREPARED / ROLLBACK PREPARED checkpoints)."""
    conns: dict[int, psycopg.Connection] = {}
    try:
        for step in workload.steps:
            conn = conns.get(step.session)
            if conn is None:
                conn = conns[step.session] = db.connect()
            conn.execute(step.sql)  # type: ignore[arg-type]  # generated by the model, literals quoted
            if on_step is not None:
                on_step(step)
    finally:
        for conn in conns.values():
            conn.close()
