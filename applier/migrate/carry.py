"""``applier migrate cutover --prepared carry``: prepared transactions open on the source at the fence stay prepared on
the target, under their original GIDs, for the application's transaction manager to finish on the new server.

The migration's subscription is created with ``gid_format=original`` (``applier migrate start``), so every
transaction the source prepares while the stream has two-phase on is prepared on the target under the source's GID
(:func:`state.twophase.gid_for`). At the cutover nothing has to be renamed: once the target has applied the end
position, the set of GIDs prepared on the target for the subscription must equal the set still prepared on the
source (:func:`settle`). Those are the carried transactions.

What happens to the source's copies: after the migration is ``done`` and the slot is gone (nothing decodes the
source any more, so the apply can never see it), the cutover rolls them back on the source
(:func:`finish_on_source`). A demanding user wants exactly one place where the transaction can be decided: left
prepared on the retired server, each copy would hold its row locks and the server's xmin horizon (no vacuum) until
someone remembered it, and a transaction manager still configured for the old server could commit it there too, and
the two servers would then disagree. The rollback on the old server never reaches the new one (no slot), so the
target's copy is the only one left, which is what carrying means.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from applier.catalog import sql as catalog_sql
from applier.migrate.state import MigrationError
from applier.replication import TWO_PHASE_VERSION

__all__ = [
    "after_cutover_lines",
    "carried_message",
    "check_gid_format",
    "finish_on_source",
    "locked_by_prepared",
    "prepared_on_target",
    "settle",
    "source_prepared",
]


def check_two_phase(target: psycopg.Connection[Any], subid: int, source: str) -> None:
    """Refuse a carry when the subscription does not decode prepared transactions: from a PostgreSQL 14 source
    (pgoutput decodes them from 15 on) they arrive only at COMMIT PREPARED, so there is nothing prepared on the
    target to carry. Checked before the fence, so the source stays writable and the migration goes on."""
    row = target.execute(catalog_sql.SUBSCRIPTION_TWO_PHASE_STATE, (subid,)).fetchone()
    if row is not None and row[0] != "d":
        return
    with psycopg.connect(source, autocommit=True, connect_timeout=10) as src:
        version = int(src.execute("SHOW server_version_num").fetchone()[0])  # type: ignore[index]
    why = (
        f"the source runs PostgreSQL {version // 10000}, whose pgoutput cannot decode prepared transactions (two-phase "
        "decoding needs 15 or later)"
        if version < TWO_PHASE_VERSION
        else "the migration's subscription does not decode prepared transactions (two-phase is off)"
    )
    raise MigrationError(
        f"--prepared carry cannot be done: {why}, so none is prepared on the target to carry; use --prepared wait "
        "(the cutover waits, after the fence, for the source's prepared transactions to be committed or rolled back)"
    )


def check_gid_format(target: psycopg.Connection[Any], subid: int) -> None:
    """Refuse a carry for a subscription that names its prepared transactions ``pg_gid_<subid>_<xid>``: the cutover
    cannot rename a prepared transaction."""
    row = target.execute(catalog_sql.SUBSCRIPTION_GID_FORMAT, (subid,)).fetchone()
    if row is None or row[0] != "original":
        raise MigrationError(
            "--prepared carry needs the migration's subscription to keep the source's GIDs (gid_format=original, "
            "what applier migrate start sets since this release unless the source and the target are one "
            "cluster), but it names them pg_gid_<subid>_<xid> and a prepared transaction cannot be renamed; use "
            "--prepared wait"
        )


def prepared_on_target(target: psycopg.Connection[Any], subid: int) -> list[str]:
    """The subscription's transactions prepared on the target (its ``prepared_xact`` records that exist)."""
    return [r[0] for r in target.execute(catalog_sql.PREPARED_ON_TARGET, (subid,))]


def source_prepared(src: psycopg.Connection[Any]) -> list[str]:
    return [
        r[0]
        for r in src.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared, gid"
        )
    ]


def settle(
    target: psycopg.Connection[Any],
    src: psycopg.Connection[Any],
    subid: int,
    left: Callable[[], float],
    wait_applied: Callable[[str], None],
) -> list[str]:
    """The GIDs carried: prepared on the source and on the target alike, once the target has applied the end position.

    Fenced, the source prepares nothing new (its sessions were ended), so a GID prepared there but not on the target
    was prepared while the migration's stream had two-phase off (before every table was ready): it reaches the
    target only whole, at COMMIT PREPARED, and cannot be carried. A GID prepared on the target but no longer on the
    source was decided on the source since the end position: its decision is in the stream, so wait for the target
    to apply up to a newer position and look again."""
    while True:
        on_target = prepared_on_target(target, subid)
        on_source = source_prepared(src)
        missing = [g for g in on_source if g not in on_target]
        if missing:
            raise MigrationError(
                f"{len(missing)} prepared transaction(s) on the source cannot be carried: "
                f"{', '.join(missing[:5])} were prepared before the migration's stream had two-phase on (every "
                "table ready), so the target receives them only when they are committed; decide them on the source "
                "and cut over again, or use --prepared wait"
            )
        if set(on_target) == set(on_source):
            return on_source
        if not left():
            decided = [g for g in on_target if g not in on_source]
            raise MigrationError(
                f"prepared transaction(s) {', '.join(decided[:5])} were decided on the source during the cutover and "
                "the target has not applied that decision in time"
            )
        wait_applied(src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]


def carried_message(carried: list[str]) -> str:
    if not carried:
        return "prepared: no prepared transaction open on the source, nothing to carry"
    return f"prepared: {len(carried)} transaction(s) carried, prepared on the target as on the source"


def locked_by_prepared(target: psycopg.Connection[Any], relnames: list[str]) -> bool:
    """Whether a prepared transaction holds a lock on one of these tables (an ``ALTER TABLE`` would wait for it)."""
    row = target.execute(
        "SELECT EXISTS (SELECT FROM pg_locks l WHERE l.pid IS NULL AND l.locktype = 'relation'"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND l.relation IN (SELECT to_regclass(r)::oid FROM unnest(%s::text[]) r))",
        (relnames,),
    ).fetchone()
    return bool(row and row[0])


def finish_on_source(
    src: psycopg.Connection[Any], carried: list[str], slot_gone: bool, say: Callable[[str], None]
) -> None:
    """Roll back the source's copies of the carried transactions (see the module's docstring), only once the slot is
    gone: while something may still decode the source, its ROLLBACK PREPARED would reach the target too."""
    commands = [sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(g)).as_string(src) for g in carried]
    if not slot_gone:
        say(
            "WARNING: the source's copies of the carried transactions were left prepared because its slot is still "
            "in use; once it is dropped, run on the source: " + "; ".join(commands)
        )
        return
    for gid, command in zip(carried, commands, strict=True):
        try:
            src.execute(command)
        except psycopg.errors.UndefinedObject:
            say(
                f"WARNING: prepared transaction {gid} was decided on the source after the end position; its copy on "
                "the target is still prepared: decide it on the target the same way"
            )
        except psycopg.Error as exc:
            say(
                f"WARNING: could not roll back the source's copy of {gid} ({str(exc).strip()}); run on the source: "
                f"{command}"
            )
    say(f"prepared: the source's copies of {len(carried)} carried transaction(s) rolled back there")


def after_cutover_lines(carried: list[str], deferred: list[str]) -> list[str]:
    """What the user does next: finish the carried transactions on the target, then the deferred identity steps."""
    lines = [
        f"carried prepared transaction: {g} (finish it on the target: COMMIT PREPARED or ROLLBACK PREPARED "
        f"{sql.Literal(g).as_string(None)})"
        for g in carried
    ]
    if deferred:
        lines.append(
            "identity columns stay BY DEFAULT on tables the carried transactions lock; once they are "
            "decided run on the target (applier migrate status --json lists them): " + "; ".join(deferred)
        )
    return lines
