"""Which statement of the client's query string a captured DDL event is, and the text to run on the target.

The capture sends ``current_query()``: the client's whole string, which may hold several statements (``psql -c
"ALTER ...; INSERT ..."``), and ``n``, the ordinal of the event among every ``ddl_command_end`` since that string
began. PostgreSQL fires ``ddl_command_end`` once for each top-level statement of the event-trigger matrix (never for
DML, transaction control, or commands on global objects), so the n-th event is the n-th such statement of the string
— unless code ran before it (a ``DO`` block, a ``CALL``) that may have run DDL of its own, or the event came from
inside a function: then no statement of the string is the command, and :func:`replay_for` says so instead of
guessing (the apply skips it with a WARNING and the missing-column path of the apply takes over).

The string is parsed with PostgreSQL's own parser (``pglast``, libpg_query of PostgreSQL 18): splitting SQL by
hand gets dollar quotes, nested comments and ``E''`` strings wrong, and a wrong split would run an INSERT twice.

Pure: a string and an event in, a :class:`Replay` out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import pglast
from pglast import ast, parser
from pglast.enums import ObjectType
from pglast.stream import RawStream
from pglast.visitors import Visitor

from applier.ddl.payload import DdlEvent

__all__ = ["Replay", "code_names", "fires_event_trigger", "fills_rows_anew", "replay_for", "without_data"]


@dataclass(frozen=True, slots=True)
class Replay:
    """``statement`` to run on the target, or ``None`` with ``why`` it cannot be found in the client's string."""

    statement: str | None
    why: str | None = None


#: Statements on global objects (roles, databases, tablespaces) and on event triggers: no event trigger fires.
_GLOBAL_NODES = frozenset({
    "CreateRoleStmt", "AlterRoleStmt", "AlterRoleSetStmt", "DropRoleStmt", "GrantRoleStmt", "CreatedbStmt",
    "AlterDatabaseStmt", "AlterDatabaseSetStmt", "AlterDatabaseRefreshCollStmt", "DropdbStmt",
    "CreateTableSpaceStmt", "DropTableSpaceStmt", "AlterTableSpaceOptionsStmt", "AlterSystemStmt",
    "CreateEventTrigStmt", "AlterEventTrigStmt", "ReassignOwnedStmt",
})  # fmt: skip
#: The object types of those, for the statements that name an object type (DROP, RENAME, OWNER, COMMENT, GRANT).
_GLOBAL_TYPES = frozenset({
    ObjectType.OBJECT_DATABASE, ObjectType.OBJECT_ROLE, ObjectType.OBJECT_TABLESPACE,
    ObjectType.OBJECT_EVENT_TRIGGER, ObjectType.OBJECT_PARAMETER_ACL,
})  # fmt: skip
#: Node-name beginnings of the statements in the event-trigger firing matrix (docs: "Event Trigger Firing Matrix").
_DDL_HEADS = (
    "Create", "Alter", "Drop", "Define", "Comment", "Grant", "Rename", "SecLabel", "Index", "View", "Rule",
    "CompositeType", "RefreshMatView", "ImportForeignSchema",
)  # fmt: skip
#: the scanner's names of comments (a statement's own first word may be COMMENT)
_COMMENTS = frozenset({"C_COMMENT", "SQL_COMMENT"})
#: Statements that run code which may run DDL of its own (each such DDL fires an event of the same string).
_RUNS_CODE = frozenset({"DoStmt", "CallStmt"})


def _object_type(node: ast.Node) -> object:
    for attr in ("removeType", "renameType", "objectType", "objtype"):
        value = getattr(node, attr, None)
        if value is not None:
            return value
    return None


def fires_event_trigger(node: ast.Node) -> bool:
    """Whether PostgreSQL fires ``ddl_command_end`` for this top-level statement."""
    name = type(node).__name__
    if isinstance(node, ast.SelectStmt):
        return node.intoClause is not None  # SELECT INTO is CREATE TABLE AS
    if name in _GLOBAL_NODES or not name.startswith(_DDL_HEADS):
        return False
    return _object_type(node) not in _GLOBAL_TYPES


def _tag_matches(tag: str, node: ast.Node, text: str) -> bool:
    """Whether the statement is of the event's command tag: the tag's words in order among the statement's first
    words (``CREATE INDEX`` in ``CREATE UNIQUE INDEX CONCURRENTLY``); the two tags whose last word comes after a
    name or a select list, by the statement's kind."""
    if tag == "CREATE TABLE AS":
        return isinstance(node, ast.CreateTableAsStmt)
    if tag == "SELECT INTO":
        return isinstance(node, ast.SelectStmt) and node.intoClause is not None
    words = iter(text[t.start : t.end + 1].upper() for t in parser.scan(text)[:12] if t.name not in _COMMENTS)
    return all(any(w == want for w in words) for want in tag.upper().split())


def _without_concurrently(text: str) -> str:
    """CREATE/DROP INDEX CONCURRENTLY and DETACH PARTITION CONCURRENTLY cannot run inside a transaction block, and
    on the target the command runs inside the remote transaction: the plain form takes the same end state. (Parsed
    again: the cached parse of the whole string is not to be changed.)"""
    if "CONCURRENTLY" not in text.upper():
        return text
    node = pglast.parse_sql(text)[0].stmt
    changed = False
    if isinstance(node, ast.IndexStmt | ast.DropStmt) and node.concurrent:
        node.concurrent = False
        changed = True
    if isinstance(node, ast.AlterTableStmt):
        for cmd in node.cmds or ():
            part = getattr(cmd, "def_", None)
            if isinstance(part, ast.PartitionCmd) and part.concurrent:
                part.concurrent = False
                changed = True
    return RawStream()(node) if changed else text


@lru_cache(maxsize=64)
def _statements(query: str) -> tuple[tuple[ast.RawStmt, str], ...]:
    """The string's statements with their own text (offsets are characters: pglast converts libpg_query's bytes)."""
    out = []
    for raw in pglast.parse_sql(query):
        start = raw.stmt_location or 0
        end = start + raw.stmt_len if raw.stmt_len else len(query)
        out.append((raw, query[start:end].strip()))
    return tuple(out)


def replay_for(event: DdlEvent) -> Replay:
    """The statement of ``event.query`` that the n-th ``ddl_command_end`` of the string came from."""
    try:
        statements = _statements(event.query)
    except pglast.parser.ParseError as exc:
        return Replay(None, f"the source's statement does not parse here ({exc})")
    seen = 0
    for raw, text in statements:
        name = type(raw.stmt).__name__
        if name in _RUNS_CODE:
            return Replay(
                None, f"it ran inside {name.removesuffix('Stmt').upper()} code, which no statement names"
            )
        if not fires_event_trigger(raw.stmt):
            continue
        seen += 1
        if seen < event.n:
            continue
        if not _tag_matches(event.tag, raw.stmt, text):
            return Replay(None, f"it ran inside a function called by the statement ({text[:80]!r})")
        return Replay(_without_concurrently(text))
    return Replay(
        None, "it ran inside a function or a trigger, which no statement of the client's string names"
    )


def without_data(statement: str) -> str:
    """``CREATE TABLE ... AS`` / ``SELECT ... INTO`` as the same table ``WITH NO DATA``: its rows are the source's,
    copied (the stream does not carry them), not what the query would find on the target."""
    node = pglast.parse_sql(statement)[0].stmt
    if isinstance(node, ast.SelectStmt) and node.intoClause is not None:
        into = node.intoClause
        node.intoClause = None
        node = ast.CreateTableAsStmt(query=node, into=into, objtype=ObjectType.OBJECT_TABLE)
    if not isinstance(node, ast.CreateTableAsStmt):
        return statement
    node.into.skipData = True
    return RawStream()(node)


class _Names(Visitor):  # type: ignore[misc]
    def __init__(self) -> None:
        self.functions: list[tuple[str, str]] = []
        self.operators: list[tuple[str, str]] = []

    @staticmethod
    def _split(parts: tuple[ast.String, ...]) -> tuple[str, str]:
        names = [p.sval for p in parts]
        return ("", names[-1]) if len(names) == 1 else (names[-2], names[-1])

    def visit_FuncCall(self, _ancestors: object, node: ast.FuncCall) -> None:
        self.functions.append(self._split(node.funcname))

    def visit_A_Expr(self, _ancestors: object, node: ast.A_Expr) -> None:
        if node.name:
            self.operators.append(self._split(node.name))


def code_names(statement: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The (schema or "", name) of the functions and operators an ``ALTER TABLE`` evaluates on the rows already
    there, as the role running it (a new column's default, a ``USING`` expression, a ``CHECK`` it validates):
    what the trust rule must look at before the statement runs. PostgreSQL runs an index's expressions and a
    materialized view's query as the table's owner, and other statements evaluate nothing on rows: none."""
    node = pglast.parse_sql(statement)[0].stmt
    if not isinstance(node, ast.AlterTableStmt):
        return (), ()
    names = _Names()
    names(node)
    return tuple(dict.fromkeys(names.functions)), tuple(dict.fromkeys(names.operators))


#: expression nodes whose value may differ between the source's evaluation and the target's
_UNSTABLE = (ast.FuncCall, ast.SQLValueFunction)
_SERIALS = frozenset({"serial", "serial4", "bigserial", "serial8", "smallserial", "serial2"})


class _Unstable(Visitor):  # type: ignore[misc]
    found = False

    def visit(self, _ancestors: object, node: object) -> None:
        if isinstance(node, _UNSTABLE):
            self.found = True


def _unstable(expr: object) -> bool:
    if expr is None or isinstance(expr, ast.A_Const):
        return False
    seen = _Unstable()
    seen(expr)
    return seen.found or isinstance(expr, _UNSTABLE)


def _column_fills(col: ast.ColumnDef) -> bool:
    """A new column whose value for each row already there is computed: a default that calls something, a
    serial or an identity (numbered in the order each server reads its rows)."""
    names = [n.sval for n in (col.typeName.names if col.typeName else ())]
    if names and names[-1] in _SERIALS:
        return True
    for c in col.constraints or ():
        if c.contype == pglast.enums.ConstrType.CONSTR_IDENTITY:
            return True
        if c.contype == pglast.enums.ConstrType.CONSTR_DEFAULT and _unstable(c.raw_expr):
            return True
    return False


def fills_rows_anew(statement: str) -> bool:
    """Whether an ``ALTER TABLE`` fills the rows already there with values computed by the server that runs it,
    which the target cannot be trusted to compute as the source did (``random()``, ``now()``, ``nextval()``, a
    serial, a ``USING`` that calls a function): the stream carries no rewritten row, so such a table is copied
    again after the statement (applier.apply.ddl_replay). A constant default or a plain cast is computed alike."""
    node = pglast.parse_sql(statement)[0].stmt
    if not isinstance(node, ast.AlterTableStmt):
        return False
    for cmd in node.cmds or ():
        col = getattr(cmd, "def_", None)
        if cmd.subtype == pglast.enums.AlterTableType.AT_AddColumn and isinstance(col, ast.ColumnDef):
            if _column_fills(col):
                return True
        if cmd.subtype == pglast.enums.AlterTableType.AT_AlterColumnType and isinstance(col, ast.ColumnDef):
            if _unstable(col.raw_default):
                return True
    return False
