"""Row changes as statements on the target session: prepared INSERT/UPDATE/DELETE per relation and shape,
TRUNCATE, and the bulk statements of :mod:`applier.apply.bulk_exec` (one ``unnest`` statement per table stretch).

Values are passed through untouched: text values as text parameters and binary values as binary parameters, each
typed with the OID of the *local* column, so that the target runs the local type's input (or receive) function, as
the native worker does (behaviour 42). Every identifier is composed with :mod:`psycopg.sql`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from applier.apply.context import ApplyError, ErrorContext
from applier.apply.origin_probe import OriginProbe
from applier.apply.pipeline import CHECK_ROWS, Pipeline
from applier.apply.relmap import RelMapEntry
from applier.apply.target_copy import CopyIn
from applier.apply.target_trust import TrustedStatements
from applier.apply.target_trust import checked as _checked
from applier.apply.target_trust import only as _only
from applier.apply.target_trust import tbl as _tbl
from applier.messages import KIND_BINARY, KIND_UNCHANGED_TOAST, TupleData


def _param(n: int) -> sql.Composable:
    return sql.SQL("$" + str(n))


class DmlStatements(TrustedStatements):
    """The row-change statements of one target session (prepared once per relation and shape, cached on the
    relation's :class:`~applier.apply.relmap.RelMapEntry`), each with the trust check of its base class."""

    def __init__(self, conn: psycopg.Connection[Any], pipeline: Pipeline, copy: CopyIn, binary: bool,
                 run_as_owner: bool = False) -> None:  # fmt: skip
        super().__init__(conn, pipeline, run_as_owner)
        self.copy = copy
        self.binary = binary
        #: the origin-differs check before each UPDATE/DELETE, when track_commit_timestamp is on (applier.apply.origin_probe)
        self.origin_probe: OriginProbe | None = None

    def watch_origins(self, roident: int | None) -> None:
        """Check the origin of each row an UPDATE/DELETE changes (``roident``: ours), or not (None)."""
        self.origin_probe = None if roident is None else OriginProbe(self, roident)

    # --- row changes -----------------------------------------------------------------------------------------
    def _formats(self, kinds: bytes) -> list[int] | None:
        if not self.binary or KIND_BINARY not in kinds:
            return None
        return [1 if k == KIND_BINARY else 0 for k in kinds]

    def insert(self, entry: RelMapEntry, new: TupleData, ctx: ErrorContext | None) -> None:
        copy = self.copy.run
        if copy is not None:
            if copy.entry is entry and copy.accepts(new):
                copy.add(new)
                return
            self.copy.end()
        if not self.embeds(entry):  # else the statement checks itself
            self.check(entry, "I", ctx)
        name = entry.statements.get("I")
        if name is None:
            name = self._statement(entry, "I", lambda: self._insert_sql(entry), ctx)
        self.pipeline.send_prepared(name, new.values, self._formats(new.kinds), ctx, None, (entry, None, new))

    def _insert_sql(self, entry: RelMapEntry) -> tuple[sql.Composable, Sequence[int]]:
        cols = sql.SQL(", ").join(sql.Identifier(n) for n in entry.names)
        vals = sql.SQL(", ").join(_param(i + 1) for i in range(len(entry.names)))
        if self.embeds(entry):  # INSERT ... SELECT, for a WHERE to hold the check
            q = sql.SQL("INSERT INTO {} ({}){} SELECT {} WHERE true{}").format(
                _tbl(entry.local), cols, _overriding(entry), vals, _checked(entry, "I")
            )
        else:
            q = sql.SQL("INSERT INTO {} ({}){} VALUES ({})").format(
                _tbl(entry.local), cols, _overriding(entry), vals
            )
        return q, entry.types

    @staticmethod
    def _search_shape(entry: RelMapEntry, search: TupleData) -> bytes:
        """Per searched column: ``v`` value, ``n`` NULL, ``u`` unchanged TOAST: the part of a statement-cache key
        that decides the WHERE clause."""
        kinds = search.kinds
        if entry.key_positions is None:
            return kinds.translate(_SHAPE)
        if _N not in kinds and _U not in kinds:  # the usual case: every key column has a value
            return _ALL_VALUES[len(entry.key_positions)]
        return bytes([kinds[i] for i in entry.key_positions]).translate(_SHAPE)

    @staticmethod
    def _search_values(
        entry: RelMapEntry, search: TupleData, shape: bytes
    ) -> tuple[list[bytes | None], bytes]:
        """Parameter values (and their kinds) of the row-identifying condition for ``shape``."""
        positions = entry.key_positions if entry.key_positions is not None else range(len(entry.names))
        values = search.values
        if b"n" not in shape and b"u" not in shape:
            used: Sequence[int] = positions
        else:
            used = [i for i, c in zip(positions, shape, strict=True) if c == _V]
        if len(used) == 1:
            i = used[0]
            return [values[i]], search.kinds[i : i + 1]
        kinds = search.kinds
        return [values[i] for i in used], bytes([kinds[i] for i in used])

    @staticmethod
    def _search_condition(
        entry: RelMapEntry, shape: bytes, first_param: int
    ) -> tuple[sql.Composable, list[int]]:
        """The row-identifying condition: local key columns, or every sent column for a FULL publisher.

        NULLs become ``IS NULL`` (so the condition equals ``IS NOT DISTINCT FROM`` but stays indexable);
        unchanged-TOAST markers are left out. Returns (condition, parameter types).
        """
        positions = entry.key_positions if entry.key_positions is not None else range(len(entry.names))
        conds: list[sql.Composable] = []
        types: list[int] = []
        n = first_param
        for i, c in zip(positions, shape, strict=True):
            col = sql.Identifier(entry.names[i])
            if c == _N:
                conds.append(sql.SQL("{} IS NULL").format(col))
            elif c == _V:
                conds.append(sql.SQL("{} = {}").format(col, _param(n)))
                types.append(entry.types[i])
                n += 1
        cond = sql.SQL(" AND ").join(conds) if conds else sql.SQL("true")
        if entry.key_positions is None:
            # no key: the first matching row, as RelationFindReplTupleSeq does (duplicates stay duplicates)
            sub = sql.SQL("SELECT {cols} FROM {only}{tbl} WHERE {cond} LIMIT 1 FOR UPDATE").format(
                cols=sql.SQL("ctid" if entry.relkind == "r" else "tableoid, ctid"),
                only=_only(entry), tbl=_tbl(entry.local), cond=cond,
            )  # fmt: skip
            lhs = sql.SQL("ctid" if entry.relkind == "r" else "(tableoid, ctid)")
            cond = sql.SQL("{} = ({})").format(lhs, sub)
        return cond, types

    @staticmethod
    def _shape(t: TupleData) -> bytes:
        """A statement-cache key part: which columns are NULL / unchanged (text vs binary does not matter)."""
        return t.kinds.translate(_SHAPE)

    def update(
        self, entry: RelMapEntry, old: TupleData | None, new: TupleData, ctx: ErrorContext | None
    ) -> None:
        """UPDATE the row found by the old key (or the new tuple's key when the key did not change, behaviour
        45); unchanged-TOAST columns are left out of SET, so they keep the target's value (behaviour 46). No row
        found: :attr:`Pipeline.on_missing_row` hears of it.

        A GENERATED ALWAYS identity column can only be assigned DEFAULT by an UPDATE, so it is left out of SET when
        its value is known not to change (a key column without an old tuple, or an old tuple with the same value:
        nearly always, since the publisher itself can only change it with ``SET col = DEFAULT``); when it may
        change, :meth:`_update_identity` applies the row as the native worker does. When nothing is left to assign
        (every column unchanged TOAST), the row is still updated, with a no-op assignment, as the native worker
        updates it with its old values: update triggers enabled for replica fire."""
        if self.copy.run is not None:
            self.copy.end()
        if not self.embeds(entry):  # else the statement checks itself
            self.check(entry, "U", ctx)
        search = old if old is not None else new
        if self.origin_probe is not None:
            self.origin_probe.before(entry, "U", search, new, self._search_shape(entry, search), ctx)
        kinds = new.kinds
        unchanged = KIND_UNCHANGED_TOAST in kinds
        omitted: tuple[int, ...] = ()
        if entry.always_identity:
            omitted, changing = _identity_split(entry, old, new)
            if changing:
                self.check(entry, "U", ctx)
                self._update_identity(entry, search, new, changing, ctx)
                return
        shape = self._search_shape(entry, search)
        key = ("U", self._shape(new) if unchanged else None, shape, omitted)
        name = entry.statements.get(key)
        set_pos: Sequence[int] = (
            [i for i, k in enumerate(kinds) if k != KIND_UNCHANGED_TOAST and i not in omitted]
            if unchanged or omitted
            else range(len(new))
        )
        if name is None:

            def build() -> tuple[sql.Composable, Sequence[int]]:
                return self._update_sql(entry, shape, set_pos, self.embeds(entry))

            name = self._statement(entry, key, build, ctx)
        wparams, wkinds = self._search_values(entry, search, shape)
        values = new.values
        params = ([values[i] for i in set_pos] if unchanged or omitted else list(values)) + wparams
        formats = None
        if self.binary:
            pkinds = bytes([kinds[i] for i in set_pos]) + wkinds
            if KIND_BINARY in pkinds:
                formats = [1 if k == KIND_BINARY else 0 for k in pkinds]
        self.pipeline.send_prepared(name, params, formats, ctx, CHECK_ROWS, (entry, search, new))

    def _update_sql(
        self, entry: RelMapEntry, shape: bytes, set_pos: Sequence[int], embed: bool
    ) -> tuple[sql.Composable, list[int]]:
        """The UPDATE assigning the columns at ``set_pos`` (parameters 1..n) of the row ``shape`` finds (with its
        own trust check when ``embed``)."""
        cond, wtypes = self._search_condition(entry, shape, len(set_pos) + 1)
        if set_pos:
            sets = sql.SQL(", ").join(
                sql.SQL("{} = {}").format(sql.Identifier(entry.names[i]), _param(j + 1))
                for j, i in enumerate(set_pos)
            )
        else:
            sets = _noop_assignment(entry, "")
        q = sql.SQL("UPDATE {only}{tbl} SET {sets} WHERE {where}{checked}").format(
            only=_only(entry), tbl=_tbl(entry.local), sets=sets, where=cond,
            checked=_checked(entry, "U") if embed else sql.SQL(""),
        )  # fmt: skip
        return q, [entry.types[i] for i in set_pos] + wtypes

    def _update_identity(self, entry: RelMapEntry, search: TupleData, new: TupleData, changing: tuple[int, ...],
                         ctx: ErrorContext | None) -> None:  # fmt: skip
        """The rare UPDATE that may give a GENERATED ALWAYS identity column a new value (the publisher ran ``SET
        col = DEFAULT``, or the column is outside the key and the message has no old tuple to compare with).

        PostgreSQL lets nothing but DEFAULT be assigned to such a column, and ``OVERRIDING`` does not exist for
        UPDATE; so, within the apply transaction, the column is made BY DEFAULT for this one statement and ALWAYS
        again right after (both undone with the transaction should it fail). The cost is an ACCESS EXCLUSIVE lock
        on the target table until the local commit. The statement is unnamed: a prepared statement would be
        checked (and refused) while the column is ALWAYS."""
        kinds = new.kinds
        set_pos = [i for i, k in enumerate(kinds) if k != KIND_UNCHANGED_TOAST]
        shape = self._search_shape(entry, search)
        query, types = self._update_sql(entry, shape, set_pos, False)
        wparams, wkinds = self._search_values(entry, search, shape)
        params = [new.values[i] for i in set_pos] + wparams
        pkinds = bytes([kinds[i] for i in set_pos]) + wkinds
        formats = [1 if k == KIND_BINARY else 0 for k in pkinds] if KIND_BINARY in pkinds else None

        def alter(generated: str) -> bytes:
            return sql.SQL("ALTER TABLE {} {}").format(_tbl(entry.local), sql.SQL(", ").join(
                sql.SQL("ALTER COLUMN {} SET GENERATED " + generated).format(sql.Identifier(entry.names[i]))
                for i in changing
            )).as_bytes(self.conn)  # fmt: skip

        self.pipeline.send_query(alter("BY DEFAULT"), None, ctx)
        self.pipeline.send_query(query.as_bytes(self.conn), params, ctx, CHECK_ROWS, types, formats)
        self.pipeline.send_query(alter("ALWAYS"), None, ctx)

    def delete(self, entry: RelMapEntry, old: TupleData, ctx: ErrorContext | None) -> None:
        """DELETE the row found by the old key or, for a FULL publisher without a local key, the first match; no
        row found as for :meth:`update`."""
        if self.copy.run is not None:
            self.copy.end()
        if not self.embeds(entry):  # else the statement checks itself
            self.check(entry, "D", ctx)
        shape = self._search_shape(entry, old)
        if self.origin_probe is not None:
            self.origin_probe.before(entry, "D", old, None, shape, ctx)
        key = ("D", shape)
        name = entry.statements.get(key)
        if name is None:

            def build() -> tuple[sql.Composable, Sequence[int]]:
                cond, wtypes = self._search_condition(entry, shape, 1)
                q = sql.SQL("DELETE FROM {only}{tbl} WHERE {where}{checked}").format(
                    only=_only(entry), tbl=_tbl(entry.local), where=cond,
                    checked=_checked(entry, "D") if self.embeds(entry) else sql.SQL(""),
                )  # fmt: skip
                return q, wtypes

            name = self._statement(entry, key, build, ctx)
        wparams, wkinds = self._search_values(entry, old, shape)
        formats = (
            [1 if k == KIND_BINARY else 0 for k in wkinds] if self.binary and KIND_BINARY in wkinds else None
        )
        self.pipeline.send_prepared(name, wparams, formats, ctx, CHECK_ROWS, (entry, old, None))

    def truncate(
        self, entries: Sequence[RelMapEntry], restart_identity: bool, ctx: ErrorContext | None
    ) -> None:
        """One TRUNCATE over the applicable relations, never CASCADE (behaviour 49)."""
        self.copy.end()
        if not self.run_as_owner:
            self._guard_truncate(entries, ctx)
        targets = sql.SQL(", ").join(sql.SQL("{}{}").format(_only(e), _tbl(e.local)) for e in entries)
        q = sql.SQL("TRUNCATE {}{} RESTRICT").format(
            targets, sql.SQL(" RESTART IDENTITY" if restart_identity else ""))  # fmt: skip
        self.pipeline.send_query(q.as_bytes(self.conn), None, ctx)

    # --- a table's stretch of changes as one statement (applier.apply.bulk) -----------------------------------
    def bulk_insert(self, entry: RelMapEntry, columns: Sequence[bytes], ctx: ErrorContext | None) -> None:
        """INSERT rows given as one array literal per column (in the publisher's column order)."""
        query = entry.statements.get(("bulk", "I"))
        if query is None:
            q = sql.SQL("INSERT INTO {} ({}){} SELECT * FROM {}").format(
                _tbl(entry.local), sql.SQL(", ").join(map(sql.Identifier, entry.names)), _overriding(entry),
                _unnest(len(entry.names)),
            )  # fmt: skip
            query = entry.statements[("bulk", "I")] = q.as_bytes(self.conn)
        self.copy.end()
        self.check(entry, "I", ctx)
        self.pipeline.send_query(query, columns, ctx, None, entry.array_types)

    def bulk_update(self, entry: RelMapEntry, columns: Sequence[bytes], ctx: ErrorContext | None,
                    on_missing: Callable[[list[int]], None]) -> None:  # fmt: skip
        """UPDATE from new tuples given as one array literal per column: each key's row takes the last of its
        tuples. ``on_missing`` hears the (1-based) positions of the tuples whose row does not exist."""
        query = entry.statements.get(("bulk", "U"))
        if query is None:
            query = entry.statements[("bulk", "U")] = self._bulk_update_sql(entry).as_bytes(self.conn)
        self.copy.end()
        self.check(entry, "U", ctx)
        self.pipeline.send_query(query, columns, ctx, _missing_positions(on_missing), entry.array_types)

    def bulk_delete(self, entry: RelMapEntry, keys: Sequence[bytes], ctx: ErrorContext | None,
                    on_missing: Callable[[list[int]], None]) -> None:  # fmt: skip
        """DELETE the rows of keys given as one array literal per key column; ``on_missing`` as for
        :meth:`bulk_update`."""
        query = entry.statements.get(("bulk", "D"))
        if query is None:
            query = entry.statements[("bulk", "D")] = self._bulk_delete_sql(entry).as_bytes(self.conn)
        self.copy.end()
        self.check(entry, "D", ctx)
        self.pipeline.send_query(query, keys, ctx, _missing_positions(on_missing),
                                 [entry.array_types[i] for i in entry.key_positions or ()])  # fmt: skip

    def bulk_origins(self, entry: RelMapEntry, keys: Sequence[bytes], ctx: ErrorContext | None,
                     on_found: Callable[[int, Any], None]) -> None:  # fmt: skip
        """Before a bulk UPDATE/DELETE, with origin checks on: ``on_found(position, local row)`` for each of its
        rows last written by another origin (``keys``: one array literal per key column; applier.apply.origin_probe)."""
        probe = self.origin_probe
        assert probe is not None
        query = entry.statements.get(("bulk", "origin"))
        if query is None:
            q = probe.bulk_sql(entry, _unnest(len(keys)), _ord_name(entry))
            query = entry.statements[("bulk", "origin")] = q.as_bytes(self.conn)
        types = [entry.array_types[i] for i in entry.key_positions or ()]
        self.pipeline.send_query(query, keys, ctx, probe.bulk_found(on_found), types)

    @staticmethod
    def _bulk_delete_sql(entry: RelMapEntry) -> sql.Composable:
        """s: the keys with their position; d: the DELETE, returning the keys it found; what it returns: the
        positions of keys that found no row."""
        keys = [sql.Identifier(entry.names[i]) for i in entry.key_positions or ()]
        ordc = sql.Identifier(_ord_name(entry))
        return sql.SQL(
            "WITH s AS (SELECT * FROM {unnest} WITH ORDINALITY AS s({keys}, {ordc})),"
            " d AS (DELETE FROM {only}{tbl} AS t USING s WHERE {match} RETURNING {returning})"
            " SELECT s.{ordc} FROM s LEFT JOIN d ON {join} WHERE d.{first} IS NULL ORDER BY s.{ordc}"
        ).format(
            unnest=_unnest(len(keys)), keys=sql.SQL(", ").join(keys), ordc=ordc, only=_only(entry),
            tbl=_tbl(entry.local), first=keys[0],
            match=sql.SQL(" AND ").join(sql.SQL("t.{} = s.{}").format(k, k) for k in keys),
            returning=sql.SQL(", ").join(sql.SQL("t.{}").format(k) for k in keys),
            join=sql.SQL(" AND ").join(sql.SQL("d.{} = s.{}").format(k, k) for k in keys),
        )  # fmt: skip

    @staticmethod
    def _bulk_update_sql(entry: RelMapEntry) -> sql.Composable:
        """s: the tuples with their position; l: the last tuple of each key; u: the UPDATE; what it returns: the
        positions of tuples whose key matched no row (the UPDATE sees the table as before the statement, like the
        other parts do, so those are exactly the rows that were missing)."""
        names = entry.names
        ordc = sql.Identifier(_ord_name(entry))
        keys = [sql.Identifier(names[i]) for i in entry.key_positions or ()]
        key_list = sql.SQL(", ").join(keys)
        return sql.SQL(
            "WITH s AS (SELECT * FROM {unnest} WITH ORDINALITY AS s({cols}, {ordc})),"
            " l AS (SELECT DISTINCT ON ({keys}) * FROM s ORDER BY {keys}, {ordc} DESC),"
            " u AS (UPDATE {only}{tbl} AS t SET {sets} FROM l WHERE {match} RETURNING l.{ordc})"
            " SELECT s.{ordc} FROM s JOIN l ON {join} WHERE l.{ordc} NOT IN (SELECT u.{ordc} FROM u)"
            " ORDER BY s.{ordc}"
        ).format(
            unnest=_unnest(len(names)),
            cols=sql.SQL(", ").join(map(sql.Identifier, names)), ordc=ordc, keys=key_list,
            only=_only(entry), tbl=_tbl(entry.local),
            sets=sql.SQL(", ").join(
                [sql.SQL("{} = l.{}").format(sql.Identifier(n), sql.Identifier(n))
                 for i, n in enumerate(names) if i not in entry.always_identity]
                or [_noop_assignment(entry, "t.")]
            ),
            match=sql.SQL(" AND ").join(sql.SQL("t.{} = l.{}").format(k, k) for k in keys),
            join=sql.SQL(" AND ").join(sql.SQL("s.{} = l.{}").format(k, k) for k in keys),
        )  # fmt: skip


def _overriding(entry: RelMapEntry) -> sql.Composable:
    """``OVERRIDING SYSTEM VALUE`` when a published column is GENERATED ALWAYS AS IDENTITY locally: the row keeps
    the publisher's value, as the native worker's does (BY DEFAULT columns take given values anyway)."""
    return sql.SQL(" OVERRIDING SYSTEM VALUE" if entry.always_identity else "")


def _noop_assignment(entry: RelMapEntry, qualifier: str) -> sql.Composable:
    """``col = col`` for an UPDATE with nothing to assign (every value unchanged TOAST, or only ALWAYS identity
    columns that keep their value): the row is still updated, as the native worker updates it with its old values,
    so update triggers enabled for replica fire. ``col`` is one the UPDATE may assign: not generated, not ALWAYS
    identity (``qualifier`` names the table in the right-hand side, e.g. ``t.``)."""
    for c in entry.local.columns:
        if not c.generated and c.identity != "a":
            return sql.SQL("{} = " + qualifier + "{}").format(sql.Identifier(c.name), sql.Identifier(c.name))
    # only ALWAYS identity and generated columns: assign DEFAULT to nothing; a generated column recomputes
    raise ApplyError(
        f'cannot update a row of "{entry.display}": it has no column an UPDATE may assign'
        " (every column is generated or GENERATED ALWAYS AS IDENTITY)"
    )


def _identity_split(
    entry: RelMapEntry, old: TupleData | None, new: TupleData
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split the ALWAYS identity columns an UPDATE carries into those known to keep their value (left out of SET)
    and those that may change (see :meth:`Target.update`). A key column keeps its value when the message has no
    old tuple (the publisher sends one when the key changes); any column keeps it when the old tuple shows the same
    value (same kind and bytes)."""
    keep: list[int] = []
    change: list[int] = []
    key = entry.key_positions or ()
    for i in entry.always_identity:
        if new.kinds[i] == KIND_UNCHANGED_TOAST:
            continue
        if old is None:
            (keep if i in key else change).append(i)
        elif old.kinds[i] == new.kinds[i] and old.values[i] == new.values[i]:
            keep.append(i)
        else:
            change.append(i)
    return tuple(keep), tuple(change)


def _unnest(n: int) -> sql.Composable:
    """The rows of ``n`` array parameters side by side (what ``unnest($1, $2)`` means, schema-qualified)."""
    return sql.SQL("ROWS FROM ({})").format(
        sql.SQL(", ").join(sql.SQL("pg_catalog.unnest({})").format(_param(i + 1)) for i in range(n))
    )


def _ord_name(entry: RelMapEntry) -> str:
    """A name for the position column of a bulk statement that no column of the table has."""
    name = "applier ord"
    while name in entry.names:
        name += "_"
    return name


def _missing_positions(on_missing: Callable[[list[int]], None]) -> Callable[[Any], None]:
    """The result callback of a bulk UPDATE/DELETE: its rows are the positions of changes that found no row."""

    def done(res: Any) -> None:
        if res is not None and res.ntuples:
            on_missing([int(res.get_value(i, 0)) for i in range(res.ntuples)])

    return done


_SHAPE = bytes.maketrans(b"tb", b"vv")
_V = ord("v")
_N = ord("n")
_U = ord("u")
#: the search shape when every key column has a value, by key width
_ALL_VALUES = [b"v" * n for n in range(33)]
