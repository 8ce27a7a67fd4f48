"""Error context of the apply worker (behaviour 54) and the errors that carry it.

PostgreSQL adds to every apply error a CONTEXT line such as ``processing remote data for replication origin
"pg_16395" during message type "INSERT" for replication target relation "public.tbl" in transaction 740, finished
at 0/14C0378``; "finished at" is the LSN a user gives to ``SKIP``. We keep the same wording (with our origin name),
log it with the error and store its parts with :meth:`applier.catalog.store.Catalog.record_error`.

Statements are pipelined, so an error can come back after the handler that queued the statement has returned: each
queued statement therefore carries its own :class:`ErrorContext`.
"""

from __future__ import annotations

from typing import Any

from applier.errors import ApplierError
from applier.lsn import format_lsn


class ErrorContext:
    """Where in the remote stream an error happened.

    A plain slotted class rather than a frozen dataclass: one is made per remote transaction and relation on
    the hot path, and this constructor is three times cheaper.
    """

    __slots__ = ("finish_lsn", "gid", "message_type", "origin", "relation", "xid")

    def __init__(
        self,
        origin: str,
        message_type: str,
        relation: str | None = None,
        xid: int | None = None,
        finish_lsn: int | None = None,
        gid: str | None = None,
    ) -> None:
        self.origin = origin
        self.message_type = (
            message_type  # PostgreSQL's names: "INSERT", "BEGIN PREPARE", "STREAM COMMIT", ...
        )
        self.relation = relation  # "schema.table" of the local target
        self.xid = xid  # remote transaction id
        self.finish_lsn = finish_lsn  # commit_lsn, or prepare_lsn for two-phase: what SKIP takes
        self.gid = (
            gid  # the publisher's GID of a prepared transaction (shown by applier status, not in the text)
        )

    def __repr__(self) -> str:
        return f"ErrorContext({self.describe()!r})"

    def detail(self) -> str | None:
        """What the record of an error says besides the server's message (a replayed DDL names its statement)."""
        return None

    def describe(self) -> str:
        """PostgreSQL's ``apply_error_callback`` text."""
        text = f'processing remote data for replication origin "{self.origin}" during message type "{self.message_type}"'
        if self.relation:
            text += f' for replication target relation "{self.relation}"'
        if self.xid is not None:
            text += f" in transaction {self.xid}"
            if self.finish_lsn:
                text += f", finished at {format_lsn(self.finish_lsn)}"
        return text


class ApplyError(ApplierError):
    """Applying a remote change failed; ``context`` says where, ``sqlstate`` what the target said (if it did).

    The worker answers by rolling back, recording the error and retrying with backoff (or disabling the subscription
    when ``disable_on_error`` is set), as the native worker does (behaviours 53, 101).
    """

    def __init__(
        self, message: str, context: ErrorContext | None = None, *, sqlstate: str | None = None
    ) -> None:
        self.message = message
        self.context = context
        self.sqlstate = sqlstate
        #: a unique violation's (schema, table, index, DETAIL), and the per-row statement's (entry, search tuple,
        #: new tuple) when known: applier.apply.unique_conflicts reports the conflict from them
        self.unique: tuple[str, str, str, str] | None = None
        self.remote: Any = None
        #: the conflict kind that report found (insert_exists, update_exists, multiple_unique_conflicts)
        self.conflict_kind: str | None = None
        text = message if context is None else f"{message}\nCONTEXT:  {context.describe()}"
        super().__init__(text)
