"""Pure planning of the initial copy: which columns, which rows, and how each table is split into partitions.

Nothing here does I/O, so every rule can be unit-tested: :mod:`tablesync.remote` reads the facts (columns, column
lists, row filters, sizes) from the publisher and the target, and this module turns them into
:class:`PartitionTask` descriptors whose SQL is already composed. The Spark tasks only execute that SQL.

The rules follow native tablesync (behaviour 80, ``fetch_remote_table_info`` / ``copy_table``):

* columns are the publisher's attributes that are not dropped, limited to the publication's column list; two
  publications with different column lists for the same table are an error. Generated columns are left out up to
  PostgreSQL 17; from 18 the column list decides (``pg_get_publication_tables``: a stored generated column is in it
  when a column list names it or the publication has ``publish_generated_columns = stored``), and a published one
  is copied into the target's ordinary column of that name;
* row filters from all subscribed publications are OR-ed, but are ignored altogether when any publication
  publishes the table without one (FOR ALL TABLES, TABLES IN SCHEMA, or a plain ``TABLE t``);
* ordinary tables are read with ``ONLY`` so inheritance children are not copied twice.

What we add is the partitioning: the table's heap is cut into ctid page ranges
(``ctid >= '(p,0)' AND ctid < '(q,0)'``), which PostgreSQL ≥ 14 executes as TID range scans, each reading only its
own pages. The last range is open-ended, so rows on pages added after the size was read are still copied.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from psycopg import sql

from applier.catalog.trust import SCHEMA as TRUST_SCHEMA

#: PostgreSQL's default block size; the real one is read from the publisher (``block_size``).
DEFAULT_BLOCK_SIZE = 8192
#: What one partition should read: big enough that per-task overhead (a Python task, two connections, a snapshot
#: import) is small, small enough that a retried task repeats little and progress moves visibly.
DEFAULT_PARTITION_BYTES = 32 * 1024 * 1024

#: Objects with OIDs below this are built in, so they are the same on every cluster.
FIRST_NORMAL_OBJECT_ID = 16384


class PlanError(ValueError):
    """The publication cannot be copied as asked (e.g. conflicting column lists); the message says why."""


@dataclass(frozen=True)
class ColumnType:
    """A column's type as one side sees it, enough to decide whether binary COPY is safe between the two.

    ``embeds_oid`` is true when the type's binary representation carries type OIDs that ``*_recv`` checks against
    the receiving side's: arrays (element type OID) and composites (each field's type OID), after resolving domains.
    Such values can only travel in binary form if the OIDs are the same on both sides.
    """

    name: str  # format_type(atttypid, NULL): qualified where needed, e.g. "public.mood", "numeric", "mood[]"
    oid: int
    embeds_oid: bool = False
    embedded_oids: tuple[int, ...] = ()  # the OIDs the binary form carries (element type / field types)
    #: the type (and every type its values are built from) has binary send and receive functions; contrib's
    #: ``isbn`` has neither, so ``COPY ... (FORMAT binary)`` of it fails on either side
    binary_io: bool = True


@dataclass(frozen=True)
class PublishedRow:
    """One row of ``pg_publication_tables`` (or the equivalent) for the table, per subscribed publication.

    ``attnames`` is None when the publication has no column list (older minor releases of 15 show NULL, newer
    ones list every column); ``rowfilter`` is ``pg_get_expr`` of the filter, None when there is none.
    """

    pubname: str
    attnames: tuple[str, ...] | None
    rowfilter: str | None


@dataclass(frozen=True)
class RemoteTable:
    """What the publisher says about one table, at the copy's snapshot."""

    schema: str
    name: str
    relkind: str  # 'r' ordinary, 'p' partitioned (publish_via_partition_root)
    #: not dropped, in attnum order; generated ones only from PostgreSQL 18 (the column lists then pick those that
    #: are published)
    columns: tuple[str, ...]
    types: dict[str, ColumnType]
    published: tuple[PublishedRow, ...]
    pages: int  # heap pages now (max of relpages and the file's size)
    block_size: int = DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class TablePlan:
    """How one table is copied: its columns, its combined row filter, its page ranges and the COPY format."""

    relid: int  # target OID (subscription_rel.srrelid)
    target_schema: str
    target_name: str
    relname: str  # the key of its partition markers: the target's quoted schema.table
    remote: RemoteTable
    columns: tuple[str, ...]
    rowfilter: str | None
    binary: bool
    ranges: tuple[tuple[int, int | None], ...]
    text_reason: str | None = None  # why binary was not used

    @property
    def estimated_bytes(self) -> int:
        return self.remote.pages * self.remote.block_size


@dataclass(frozen=True)
class PartitionTask:
    """Everything a Spark task needs to copy one partition, as plain strings and numbers (cheap to pickle).

    ``task_id`` orders the tasks: the biggest partitions come first so the longest work starts earliest.
    """

    task_id: int
    subid: int
    snapshot: str
    relname: str
    part: int
    nparts: int
    copy_out: str  # COPY (SELECT ...) TO STDOUT (FORMAT ...)
    copy_in: str  # COPY t (cols) FROM STDIN (FORMAT ...)
    lock_target: str  # LOCK TABLE t IN ROW EXCLUSIVE MODE
    pages: int  # pages this range covers as planned (the last range may find more)
    extra: dict[str, str] = field(default_factory=dict)
    #: run after ``lock_target``, before the COPY: fails when the COPY would run code the apply role does not
    #: trust (applier.catalog.trust); empty with run_as_owner
    trust_check: str = ""


# --- columns, filters, format -----------------------------------------------------------------------------------


def effective_columns(table: RemoteTable) -> tuple[str, ...]:
    """The columns copied: the table's columns limited by the column lists of the subscribed publications.

    A list naming every column is the same as no list (PostgreSQL 16+ shows it that way). Publications that
    disagree are an error, as natively ("cannot use different column lists for table ... in different
    publications").
    """
    if not table.published:
        raise PlanError(
            f'table "{table.schema}.{table.name}" is not in any of the subscribed publications on the publisher'
        )
    choices: set[tuple[str, ...]] = set()
    for row in table.published:
        if row.attnames is None:
            choices.add(table.columns)
        else:
            listed = set(row.attnames)
            choices.add(tuple(c for c in table.columns if c in listed))
    if len(choices) > 1:
        raise PlanError(
            f'cannot use different column lists for table "{table.schema}.{table.name}" in different publications'
        )
    (cols,) = choices
    if not cols:
        raise PlanError(f'table "{table.schema}.{table.name}" has no published columns to copy')
    return cols


def combined_row_filter(published: Iterable[PublishedRow]) -> str | None:
    """OR the publications' row filters; None (copy every row) if any publication has none.

    Each of several filters is parenthesised, so ``a OR b AND c`` from one publication cannot bind to another's
    (and :func:`copy_out_sql` parenthesises the whole before AND-ing the page range).
    Identical filters are used once, as natively (``SELECT DISTINCT``).
    """
    filters: list[str] = []
    for row in published:
        if row.rowfilter is None or not row.rowfilter.strip():
            return None
        if row.rowfilter not in filters:
            filters.append(row.rowfilter)
    if not filters:
        return None
    if len(filters) == 1:
        return filters[0]
    return " OR ".join(f"({f})" for f in filters)


def binary_compatible(
    columns: Sequence[str], source: dict[str, ColumnType], target: dict[str, ColumnType]
) -> str | None:
    """None when every column can travel in binary COPY format; else the reason to use text.

    Binary input is type-specific: the same type name on both sides is required, and types whose binary form
    embeds OIDs (arrays, composites) need the same OIDs as well — an enum array's element OID differs between
    clusters and ``array_recv`` rejects it. Text format only needs the same input/output syntax.
    """
    for col in columns:
        if col not in target:
            raise PlanError(f'column "{col}" is missing on the target')
        s, t = source[col], target[col]
        if s.name != t.name:
            return f'column "{col}" is {s.name} on the publisher but {t.name} on the target'
        if (s.embeds_oid or t.embeds_oid) and s.embedded_oids != t.embedded_oids:
            return f'column "{col}" ({s.name}) embeds type OIDs that differ between the servers'
        if not (s.binary_io and t.binary_io):
            side = "publisher" if not s.binary_io else "target"
            return f'column "{col}" ({s.name}) has no binary send/receive function on the {side}'
    return None


# --- page ranges -----------------------------------------------------------------------------------------------


def page_ranges(
    pages: int, *, block_size: int = DEFAULT_BLOCK_SIZE, partition_bytes: int = DEFAULT_PARTITION_BYTES
) -> tuple[tuple[int, int | None], ...]:
    """Split ``pages`` heap pages into ranges of about ``partition_bytes``; the last range is open (``None``).

    An empty or small table is one open range ``(0, None)``: it reads everything, including pages that appear
    after we looked.
    """
    per = max(1, partition_bytes // max(1, block_size))
    if pages <= per:
        return ((0, None),)
    n = -(-pages // per)  # ceil
    # Spread evenly so the last range is not a sliver.
    step = -(-pages // n)
    bounds = list(range(0, pages, step))
    ranges: list[tuple[int, int | None]] = [(lo, lo + step) for lo in bounds[:-1]]
    ranges.append((bounds[-1], None))
    return tuple(ranges)


def range_condition(lo: int, hi: int | None) -> sql.Composable | None:
    """``ctid >= '(lo,0)' AND ctid < '(hi,0)'`` — None for the whole table, so a one-partition copy is a plain scan."""
    parts: list[sql.Composable] = []
    if lo > 0:
        parts.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({lo},0)")))
    if hi is not None:
        parts.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({hi},0)")))
    if not parts:
        return None
    return sql.SQL(" AND ").join(parts)


# --- SQL -------------------------------------------------------------------------------------------------------


def _fmt(binary: bool) -> sql.Composable:
    return sql.SQL("(FORMAT binary)" if binary else "(FORMAT text)")


def copy_out_sql(plan: TablePlan, lo: int, hi: int | None) -> sql.Composed:
    """``COPY (SELECT cols FROM [ONLY] s.t WHERE <range> AND (<filter>)) TO STDOUT (FORMAT ...)``.

    The filter text comes from the publisher's own ``pg_get_expr`` (already valid SQL over the table's columns),
    so it is embedded as SQL, not quoted.
    """
    r = plan.remote
    conds: list[sql.Composable] = []
    rc = range_condition(lo, hi) if r.relkind != "p" else None
    if rc is not None:
        conds.append(rc)
    if plan.rowfilter is not None:
        conds.append(sql.SQL("({})").format(sql.SQL(plan.rowfilter)))
    where = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conds) if conds else sql.SQL("")
    return sql.SQL("COPY (SELECT {cols} FROM {only}{tbl}{where}) TO STDOUT {fmt}").format(
        cols=sql.SQL(", ").join(sql.Identifier(c) for c in plan.columns),
        only=sql.SQL("ONLY " if r.relkind == "r" else ""),
        tbl=sql.Identifier(r.schema, r.name),
        where=where,
        fmt=_fmt(plan.binary),
    )


def copy_in_sql(plan: TablePlan) -> sql.Composed:
    return sql.SQL("COPY {tbl} ({cols}) FROM STDIN {fmt}").format(
        tbl=sql.Identifier(plan.target_schema, plan.target_name),
        cols=sql.SQL(", ").join(sql.Identifier(c) for c in plan.columns),
        fmt=_fmt(plan.binary),
    )


def lock_target_sql(plan: TablePlan) -> sql.Composed:
    return sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(
        sql.Identifier(plan.target_schema, plan.target_name)
    )


def trust_check_sql(plan: TablePlan) -> sql.Composed:
    """The trust check of the COPY into ``plan``'s table (its INSERT triggers, the defaults of the columns it
    does not copy, ...), after the lock: see applier.catalog.trust."""
    return sql.SQL(
        "SELECT {}.trust_check({}::pg_catalog.oid::pg_catalog.regclass, 'I', {}::pg_catalog.text[])"
    ).format(sql.Identifier(TRUST_SCHEMA), sql.Literal(plan.relid), sql.Literal(list(plan.columns)))


# --- the plan --------------------------------------------------------------------------------------------------


def plan_table(
    *,
    relid: int,
    target_schema: str,
    target_name: str,
    relname: str,
    remote: RemoteTable,
    target_types: dict[str, ColumnType],
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
) -> TablePlan:
    """Decide columns, filter, format and page ranges for one table."""
    cols = effective_columns(remote)
    reason = binary_compatible(cols, remote.types, target_types)
    if remote.relkind == "p":
        # A partitioned parent has no heap of its own; its leaves are read through it in one scan.
        ranges: tuple[tuple[int, int | None], ...] = ((0, None),)
    else:
        ranges = page_ranges(remote.pages, block_size=remote.block_size, partition_bytes=partition_bytes)
    return TablePlan(
        relid=relid,
        target_schema=target_schema,
        target_name=target_name,
        relname=relname,
        remote=remote,
        columns=cols,
        rowfilter=combined_row_filter(remote.published),
        binary=reason is None,
        ranges=ranges,
        text_reason=reason,
    )


def partition_tasks(
    plans: Sequence[TablePlan],
    *,
    subid: int,
    snapshot: str,
    render: object = None,
    run_as_owner: bool = False,
) -> list[PartitionTask]:
    """One task per page range of every table, biggest first (longest-processing-time-first scheduling keeps
    both cores busy until the end instead of finishing on one large straggler).

    ``render`` turns a composed statement into a string (``Composable.as_string``'s context: a connection or None).
    Unless ``run_as_owner``, each task checks its table for code the apply role does not trust first.
    """
    items: list[tuple[int, TablePlan, int, int, int | None]] = []
    for plan in plans:
        for i, (lo, hi) in enumerate(plan.ranges):
            pages = (hi if hi is not None else max(plan.remote.pages, lo + 1)) - lo
            items.append((pages, plan, i, lo, hi))
    items.sort(key=lambda it: (-it[0], it[1].relname, it[2]))
    tasks = []
    for task_id, (pages, plan, i, lo, hi) in enumerate(items):
        tasks.append(
            PartitionTask(
                task_id=task_id,
                subid=subid,
                snapshot=snapshot,
                relname=plan.relname,
                part=i,
                nparts=len(plan.ranges),
                copy_out=copy_out_sql(plan, lo, hi).as_string(render),  # type: ignore[arg-type]
                copy_in=copy_in_sql(plan).as_string(render),  # type: ignore[arg-type]
                lock_target=lock_target_sql(plan).as_string(render),  # type: ignore[arg-type]
                pages=pages,
                trust_check="" if run_as_owner else trust_check_sql(plan).as_string(render),  # type: ignore[arg-type]
            )
        )
    return tasks


def pack_tasks(
    tasks: Sequence[PartitionTask],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    target_bytes: int = DEFAULT_PARTITION_BYTES,
    min_bins: int = 8,
) -> list[list[int]]:
    """Group partitions into Spark tasks ("bins") of about ``target_bytes`` each; return their task ids.

    A partition of a big table is a bin of its own; small tables are packed together, so a hundred small tables
    do not cost a hundred Spark tasks, each with its own connections and snapshot import. At least ``min_bins``
    bins (when there are that many partitions) keep every executor busy. Bins are filled largest partition
    first into the emptiest bin (longest-processing-time first), and the biggest bin comes first.
    """
    if not tasks:
        return []
    target_pages = max(1, target_bytes // max(1, block_size))
    total = sum(max(1, t.pages) for t in tasks)
    nbins = min(len(tasks), max(min_bins, -(-total // target_pages)))
    bins: list[list[int]] = [[] for _ in range(nbins)]
    loads = [0] * nbins
    for t in sorted(tasks, key=lambda t: (-t.pages, t.task_id)):
        i = min(range(nbins), key=lambda b: (loads[b], b))
        bins[i].append(t.task_id)
        loads[i] += max(1, t.pages)
    order = sorted(range(nbins), key=lambda b: -loads[b])
    return [bins[b] for b in order if bins[b]]
