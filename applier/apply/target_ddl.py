"""The apply session's schema changes (applier.ddl): a captured DDL statement run on the target inside the remote
transaction that carried it, and the catalog rows of the tables it creates or drops, in that same local
transaction, so that a crash anywhere leaves both applied or neither (the origin advances with them).

The statement runs with the source's ``search_path`` for its own length only (``set_config(..., true)`` before and
the apply session's empty path after): the statement was written for the source's path, the apply's own statements
rely on an empty one (every name they use is schema-qualified).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg import sql

from applier.apply.context import ApplyError, ErrorContext
from applier.catalog import sql as catalog_sql
from applier.ddl.statements import code_names
from applier.lsn import format_lsn
from state.tables import SyncState

if TYPE_CHECKING:  # (the session creates its DdlWrites; typing only)
    from applier.apply.target import Target

_SET_PATH = b"SELECT pg_catalog.set_config('search_path', $1, true)"
_JOIN, _LEAVE = catalog_sql.JOIN_CREATED_TABLE, catalog_sql.LEAVE_DROPPED_TABLES
#: GRANT and REVOKE name roles, which are global: one the target lacks is a WARNING, not a stop (privileges are
#: no rows; the capture sends them whatever object they are on)
_TOLERANT = (
    "DO $applier_ddl$ BEGIN EXECUTE {}; EXCEPTION WHEN undefined_object OR undefined_table OR undefined_function"
    " OR invalid_schema_name THEN RAISE WARNING 'applier: % not replayed: %', {}, SQLERRM; END $applier_ddl$"
)
_ROLE_TAGS = frozenset({"GRANT", "REVOKE", "ALTER DEFAULT PRIVILEGES"})


def _array(values: list[str]) -> bytes:
    """A text[] literal of ``values`` (each quoted: names may hold commas, quotes and braces)."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return ("{" + ",".join(quoted) + "}").encode()


class DdlWrites:
    """The DDL statements of one target session (``session``: its transaction and pipeline)."""

    def __init__(self, session: Target) -> None:
        self.session = session
        self.pipeline = session.pipeline

    def run(self, statement: str, tag: str, search_path: str, ctx: ErrorContext | None) -> None:
        """Queue ``statement`` in the open local transaction; its error surfaces with ``ctx`` like a row's."""
        pipeline = self.pipeline
        pipeline.send_query(_SET_PATH, [search_path.encode()], ctx)
        if not self.session.dml.run_as_owner:
            self._check_trust(statement, ctx)
        if tag in _ROLE_TAGS:
            conn = self.session.conn
            text = _TOLERANT.format(sql.Literal(statement).as_string(conn), sql.Literal(tag).as_string(conn))
            pipeline.send_query(text.encode(), None, ctx)
        else:
            pipeline.send_query(statement.encode(), None, ctx)
        pipeline.send_query(_SET_PATH, [b""], ctx)

    def _check_trust(self, statement: str, ctx: ErrorContext | None) -> None:
        """The trust rule for the code the statement runs on the rows already there (applier.ddl.statements.
        code_names): any function or operator it names, as the target resolves it with the source's path, owned
        by a role other than the apply role or a superuser stops the apply before the statement runs, as a row
        change that would run such code does (applier.catalog.trust)."""
        functions, operators = code_names(statement)
        if not functions and not operators:
            return
        found: list[tuple[str, str]] = []

        def done(res: Any) -> None:
            found.extend(
                (res.get_value(i, 0).decode(), res.get_value(i, 1).decode()) for i in range(res.ntuples)
            )

        params = [_array([n for n, _ in functions]), _array([f for _, f in functions]),
                  _array([n for n, _ in operators]), _array([o for _, o in operators])]  # fmt: skip
        self.pipeline.send_query(catalog_sql.UNTRUSTED_DDL_CODE, params, ctx, done)
        self.pipeline.drain()
        if found:
            what, owner = found[0]
            raise ApplyError(
                f'replaying the source\'s DDL would run {what}, owned by "{owner}": the apply role runs no code that a'
                " role other than itself or a superuser controls; make the apply role (or a superuser) own it, or"
                " trust the tables' owners: applier alter SUBSCRIPTION --set run_as_owner=true (docs/security.md)",
                ctx, sqlstate="42501",
            )  # fmt: skip

    def recopy(self, subid: int, name: str, lsn: int, ctx: ErrorContext | None) -> int | None:
        """Table ``name`` (the source's identity) is to be copied again (``f`` at ``lsn``, in the open local
        transaction); its OID, or None when it is not the subscription's."""
        params: list[bytes | None] = [str(subid).encode(), name.encode(), format_lsn(lsn).encode()]
        return self._returning_oid(catalog_sql.RECOPY_TABLE, params, ctx)

    def _returning_oid(
        self, statement: bytes, params: list[bytes | None], ctx: ErrorContext | None
    ) -> int | None:
        got: list[int] = []

        def done(res: Any) -> None:
            if res.ntuples and res.get_value(0, 0) is not None:
                got.append(int(res.get_value(0, 0)))

        self.pipeline.send_query(statement, params, ctx, done)
        self.pipeline.drain()
        return got[0] if got else None

    def join(self, subid: int, name: str, state: SyncState, ctx: ErrorContext | None) -> int | None:
        """The table ``name`` (the source's identity; the replayed CREATE made it here) becomes the subscription's,
        in state ``state``; its OID, or None when no such table is here (the CREATE did not make it)."""
        params: list[bytes | None] = [str(subid).encode(), name.encode(), name.encode(), state.encode()]
        return self._returning_oid(_JOIN, params, ctx)

    def leave_dropped(self, subid: int, ctx: ErrorContext | None) -> None:
        self.pipeline.send_query(_LEAVE, [str(subid).encode()], ctx)

    def forget_tables(self) -> None:
        """Nothing read of the local tables before the statement may be used after it."""
        self.session.forget_local_tables()
