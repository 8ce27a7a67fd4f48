"""``applier migrate status``: the migration as its record, both servers and its holders tell it.

Phase, tables, post-data progress, the lag and what a cutover would cost now, whether a ``start`` runs (its lock,
:mod:`applier.migrate.ownership`) and whether the source is fenced, by this migration or anyone. Also what
``start --cutover`` looks at before it cuts over (:func:`ready_for_cutover`). Reads only: it changes nothing on
either server.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg

from applier.catalog import sql as catalog_sql
from applier.catalog.store import origin_name
from applier.lsn import parse_lsn
from applier.migrate import carry as carrying
from applier.migrate import ddl_capture, ownership, publications, store
from applier.migrate.state import Phase
from applier.migrate.steps import CUTOVER_KINDS, SWITCH_KINDS
from applier.migrate.survey import database_read_only

__all__ = ["SAMPLE_OVER_BYTES", "SAMPLE_SECONDS", "dumps", "format_status", "ready_for_cutover", "status"]


def status(target_conninfo: str, name: str) -> dict[str, Any]:
    """Phase, tables, post-data progress, lag (``lag_bytes``/``lag_seconds``: None when they cannot be told),
    whether ``start`` runs and whether the source is fenced."""
    with psycopg.connect(target_conninfo, autocommit=True) as target:
        m = store.require(target, name)
        tables = [
            {"name": r[0], "state": r[1], "rows": r[2], "bytes": r[3]}
            for r in target.execute(catalog_sql.SUBSCRIPTION_TABLE_PROGRESS, (m.subname,))
        ]
        done, total = store.post_data_progress(target, name, CUTOVER_KINDS)
        sub = store.subscription_of(target, m)
        origin = _applied(target, sub[0]) if sub is not None else None
        carried = carrying.prepared_on_target(target, sub[0]) if sub is not None else []
        deferred = store.steps_to_run(target, name, SWITCH_KINDS) if m.phase is Phase.DONE else []
        pending = [s for step in deferred for s in step.statements]
        holder = ownership.start_holder(target, name)
        cutting = ownership.cutover_running(target, name)
        apply_error = _apply_error(target, sub[0]) if sub is not None else None
    doc: dict[str, Any] = {
        "name": name,
        "phase": m.phase,
        "source": m.source,
        "selection": m.selection,
        "tables": tables,
        "post_data": {"done": done, "total": total},
        "times": m.times,
        "error": m.error,
        # the follow's apply stopped at a remote transaction it retries (a missing column, a DDL the target
        # refuses): what the subscription's status says, while the worker has not got past it
        "apply_error": apply_error,
        # who holds the migration now: a live start (its target session), a cutover in progress
        "start": {"running": holder is not None, "holder": holder},
        "cutover_running": cutting,
        # the source's fence: this migration's record of it, and what the source says (None: not reachable)
        "fence": {"fenced_at": m.fenced_at, "source_read_only": None},
        # what the user should know afterwards: the cutover's fence (sessions ended, left, held off)
        "notes": m.notes,
        # schema changes on the source replayed (its DDL capture installed), or why not (applier.migrate.ddl_capture)
        "ddl": ddl_capture.captured(m),
        "ddl_why_not": ddl_capture.why_not(m),
        # keyless tables published insert-only that received UPDATE/DELETE (the cutover copies them again or refuses)
        "diverging": [],
        "lag_bytes": None,
        "lag_seconds": None,
        "cutover_estimate_seconds": None,
        # the subscription's transactions prepared on the target: after a cutover --prepared carry, the carried ones,
        # for the application to finish there; and the identity steps that wait for them
        "prepared_on_target": carried,
        "pending_statements": pending,
    }
    _add_source(doc, target_conninfo, m, sub, origin_lsn=origin)
    return doc


def _add_source(
    doc: dict[str, Any],
    target_conninfo: str,
    m: store.Migration,
    sub: tuple[int, str] | None,
    *,
    origin_lsn: str | None,
) -> None:
    """What the source says, into ``doc``: whether it is read-only (fenced), and while the migration follows, the
    lag (from the source's slot, or its current position against the origin's) and, when a ``start`` runs, what a
    cutover would cost now. A source that cannot be reached is ``source_error``, the rest staying unknown."""
    try:
        with psycopg.connect(m.source, autocommit=True, connect_timeout=5) as src:
            doc["fence"]["source_read_only"] = database_read_only(src)
            if sub is None or m.phase in (Phase.DONE, Phase.SCHEMA):
                return
            doc["diverging"] = publications.report(src, m)
            doc["lag_bytes"], seconds = _source_lag(src, sub[1], origin_lsn)
    except psycopg.Error as exc:
        doc["source_error"] = str(exc).strip()
        return
    if seconds is not None:
        doc["lag_seconds"] = seconds
    elif doc["lag_bytes"] == 0:
        doc["lag_seconds"] = 0.0
    if doc["start"]["running"]:
        doc["cutover_estimate"] = _cutover_estimate(target_conninfo, m, origin_name(sub[0]), doc)
        doc["cutover_estimate_seconds"] = (doc["cutover_estimate"] or {}).get("total")


def _apply_error(target: psycopg.Connection[Any], subid: int) -> dict[str, Any] | None:
    row = target.execute(
        catalog_sql.SUBSCRIPTION_CURRENT_ERROR, {"subid": subid, "origin": origin_name(subid)}
    ).fetchone()
    if row is None:
        return None
    message, at, retries, next_at, lsn = row
    return {"message": message, "at": at.isoformat(), "retry_count": retries,
            "next_retry_at": next_at.isoformat() if next_at else None, "finish_lsn": lsn}  # fmt: skip


def _applied(target: psycopg.Connection[Any], subid: int) -> str | None:
    """How far the subscription's stream has been applied (its replication origin's progress), if it has begun."""
    row = target.execute(
        "SELECT pg_replication_origin_progress(roname, false)::text FROM pg_replication_origin WHERE roname = %s",
        (origin_name(subid),),
    ).fetchone()
    return row[0] if row else None


def _source_lag(src: psycopg.Connection[Any], slot: str, applied: str | None) -> tuple[int, float | None]:
    """The lag in bytes and, when the walsender reports it, in seconds: the source's position against its slot's
    (the worker's reply), or against ``applied`` (the origin's) when the slot has no row."""
    current = src.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
    row = src.execute(
        "SELECT (pg_current_wal_lsn() - coalesce(r.replay_lsn, s.confirmed_flush_lsn))::bigint,"
        " extract(epoch FROM r.replay_lag)::float8"
        " FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid"
        " WHERE s.slot_name = %s",
        (slot,),
    ).fetchone()
    lag = (
        row[0]
        if row and row[0] is not None
        else parse_lsn(current) - max(parse_lsn(applied) if applied else 0, 0)
    )
    return max(int(lag), 0), (row[1] if row else None)


def ready_for_cutover(
    target: psycopg.Connection[Any], source: psycopg.Connection[Any], name: str, *, caught_up: int
) -> int | None:
    """The lag in bytes when ``start --cutover`` may cut over now: the migration follows, every table is ready
    (``r``) and the lag is at most ``caught_up``; None while not. The target is read first and the source (the
    caller's connection, kept open between looks) only once the target is ready: :func:`status` opens a new
    source connection and samples the apply rate for its estimate, which a look every second does not need."""
    m = store.load(target, name)
    if m is None or m.phase is not Phase.FOLLOWING:
        return None
    states = [r[1] for r in target.execute(catalog_sql.SUBSCRIPTION_TABLE_PROGRESS, (m.subname,))]
    sub = store.subscription_of(target, m)
    if not states or any(s != "r" for s in states) or sub is None:
        return None
    lag, _ = _source_lag(source, sub[1], _applied(target, sub[0]))
    return lag if lag <= caught_up else None


#: ``status`` samples the apply rate over this long, when the lag is over :data:`SAMPLE_OVER_BYTES`.
SAMPLE_SECONDS = 0.5
SAMPLE_OVER_BYTES = 1 << 20


def _cutover_estimate(
    target_conninfo: str, m: store.Migration, origin: str, doc: dict[str, Any]
) -> dict[str, float] | None:
    """What a cutover would cost now (:mod:`applier.migrate.estimate`): sizes read on the target, the apply rate
    sampled from the replication origin's progress when there is a real lag to catch up."""
    from applier.migrate import estimate, largeobjects

    progress = "SELECT pg_replication_origin_progress(%s, false) - '0/0'::pg_lsn FROM pg_replication_origin WHERE roname = %s"
    with psycopg.connect(target_conninfo, autocommit=True) as target:
        tables = target.execute(catalog_sql.SUBSCRIPTION_TABLES_SIZE, (m.subname,)).fetchone()[0]  # type: ignore[index]
        sequences, matviews, los = target.execute(
            "SELECT (SELECT count(*) FROM pg_sequences WHERE schemaname <> 'applier'),"
            " (SELECT coalesce(sum(pg_relation_size(oid)), 0)::int8 FROM pg_class WHERE relkind = 'm'),"
            " pg_table_size('pg_largeobject')"
        ).fetchone()  # type: ignore[misc]
        rate = None
        if (doc["lag_bytes"] or 0) > SAMPLE_OVER_BYTES:
            before = target.execute(progress, (origin, origin)).fetchone()
            time.sleep(SAMPLE_SECONDS)
            after = target.execute(progress, (origin, origin)).fetchone()
            if before and after and before[0] is not None and after[0] is not None:
                rate = float(after[0] - before[0]) / SAMPLE_SECONDS
    inputs = estimate.Inputs(
        doc["lag_bytes"],
        doc["lag_seconds"],
        rate,
        int(sequences),
        int(tables),
        int(los) if largeobjects.selected(m.selection) else 0,
        int(matviews),
    )
    return estimate.cutover_seconds(inputs)


def format_status(doc: dict[str, Any]) -> str:
    lag = "?" if doc["lag_bytes"] is None else f"{doc['lag_bytes']} bytes"
    if doc["lag_seconds"] is not None:
        lag += f", {doc['lag_seconds']:.1f} s"
    lines = [
        f"migration {doc['name']}: phase {doc['phase']}, lag {lag}",
        _start_line(doc),
        _fence_line(doc),
        f"post-data: {doc['post_data']['done']}/{doc['post_data']['total']} step(s) done",
        "times: " + (", ".join(f"{k} {v:.1f}s" for k, v in doc["times"].items()) or "-"),
    ]
    est = doc.get("cutover_estimate")
    if est:
        parts = ", ".join(
            f"{k.replace('_', ' ')} {v:.1f}s" for k, v in est.items() if k != "total" and v >= 0.05
        )
        lines.append(f"a cutover now: ~{est['total']:.1f}s of write downtime ({parts or 'all steps quick'})")
    if doc.get("ddl") is False:
        lines.append(f"schema changes: not replayed ({doc.get('ddl_why_not')})")
    if doc.get("source_error"):
        lines.append(f"source: not reachable: {doc['source_error']}")
    for d in doc.get("diverging") or []:
        then = "copied again under the fence" if d["recopy"] else "too large: the cutover refuses"
        lines.append(f"diverging: {d['table']} received UPDATE/DELETE, not migrated ({then})")
    if doc.get("error"):
        lines.append(f"error: {doc['error']}")
    if err := doc.get("apply_error"):
        tries = f", attempt {err['retry_count']}" if err["retry_count"] else ""
        lines.append(f"apply stopped at {err['finish_lsn']}{tries}, retrying: {err['message']}")
    if doc.get("prepared_on_target"):
        lines.append("prepared on the target: " + ", ".join(doc["prepared_on_target"]))
    if doc.get("pending_statements"):
        lines.append("to run on the target once they are decided: " + "; ".join(doc["pending_statements"]))
    lines += [f"  {t['name']}: {t['state']}" for t in doc["tables"]]
    return "\n".join(lines)


def _start_line(doc: dict[str, Any]) -> str:
    """Whether ``start`` holds the migration, and what that means for a cutover."""
    if doc["start"]["running"]:
        cutting = "; a cutover is running" if doc["cutover_running"] else ""
        return f"start: running ({doc['start']['holder']}){cutting}"
    if Phase(doc["phase"]).ended:
        return "start: not running"
    return "start: not running; a cutover needs it (applier migrate start again resumes where it stopped)"


def _fence_line(doc: dict[str, Any]) -> str:
    """The source's fence: this migration's, someone else's, or none."""
    fence = doc["fence"]
    read_only = fence["source_read_only"]
    if fence["fenced_at"] is not None:
        state = {True: "read-only", False: "writable (the fence is not up)", None: "not reachable"}[read_only]
        line = f"source: fenced by this migration since {fence['fenced_at']}: {state}"
        if doc["phase"] != Phase.DONE and not doc["cutover_running"]:
            line += " (no cutover runs: a following start lifts it within seconds; so do cutover and abort)"
        return line
    if read_only is None:
        return "source: ?"
    return "source: read-only, not by this migration" if read_only else "source: writable"


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, default=str)
