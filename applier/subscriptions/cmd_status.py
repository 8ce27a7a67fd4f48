"""``applier status``: the catalog's view of each subscription joined with the publisher's (the slot and the
walsender), as a JSON-ready document and as text for people."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg

from applier.catalog.store import Catalog, RelState, Subscription
from applier.conninfo import failure_reason
from applier.humanize import human_bytes
from applier.lsn import format_lsn, parse_lsn
from applier.subscriptions.common import open_catalog, origin_progress, require_subscription, target_errors
from applier.subscriptions.lock import _holder, _standbys
from state.tables import SyncState
from state.twophase import TwoPhaseState


def _lsn(value: Any) -> str | None:
    return None if value in (None, 0) else (format_lsn(value) if isinstance(value, int) else str(value))


def _when(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _skip_command(subname: str, finish_lsn: int | None) -> str | None:
    """``applier alter NAME --skip-lsn X/Y`` for a failed remote transaction (None when the error had none)."""
    if not finish_lsn:
        return None
    from applier.apply.retries import skip_command

    return skip_command(subname, finish_lsn)


def _error_lines(e: dict[str, Any]) -> list[str]:
    """The last error for people: what the target said, in which remote transaction, and what can be done."""
    message = e["message"].strip().replace("\n", "\n      ")
    resolved = e.get("resolved")
    lines = [
        f"  last error ({e['at']}{', resolved since: the worker got past it' if resolved else ''}): {message}"
    ]
    if e["sqlstate"]:
        lines.append(f"    SQLSTATE {e['sqlstate']}")
    if e["finish_lsn"]:
        where = f"    in remote transaction {e['remote_xid']}, finished at {e['finish_lsn']}"
        if e["gid"]:
            where += f" (prepared, GID {e['gid']})"
        if e["message_type"]:
            where += f", during {e['message_type']}"
        if e["relation"]:
            where += f" on {e['relation']}"
        lines.append(where)
    elif e["message_type"] or e["relation"]:  # a table sync's error (the copy, or a live sync's catch-up)
        where = f"during {e['message_type']}" if e["message_type"] else ""
        if e["relation"]:
            where = f"{where} on {e['relation']}".strip()
        lines.append(f"    {where}")
    if resolved:
        return lines
    if e["next_retry_at"]:
        lines.append(
            f"    failed {e['retry_count'] or 1} time(s) in a row; next attempt at {e['next_retry_at']}"
        )
    if e["sqlstate"] == "42710" and e["gid"]:  # duplicate_object: PREPARE TRANSACTION of a GID in use
        lines.append(
            f"    HINT: gid_format=original prepares it under the publisher's GID {e['gid']}, which another prepared "
            "transaction on the target already has (pg_prepared_xacts): finish that one (COMMIT or ROLLBACK "
            "PREPARED); the worker retries by itself"
        )
    if e["skip_command"]:
        lines.append(
            f"    to skip that transaction (its changes are lost on this target): {e['skip_command']}"
        )
    return lines


def status(target: str, name: str | None = None, *, publisher_timeout: int = 5) -> list[dict[str, Any]]:
    """Everything ``applier status`` shows, one JSON-ready dict per subscription."""
    catalog = open_catalog(target)
    with target_errors(target):
        subs = [require_subscription(catalog, name)] if name else catalog.list()
        return [_status_of(catalog, sub, publisher_timeout) for sub in subs]


def _options(sub: Subscription) -> dict[str, Any]:
    """The subscription's name and options, first in its status document (the catalog's values)."""
    return {
        "name": sub.subname,
        "subid": sub.subid,
        "enabled": sub.subenabled,
        "two_phase": sub.subtwophasestate.value,  # the document shows the catalog's letters
        "streaming": sub.substream,
        "binary": sub.subbinary,
        "disable_on_error": sub.subdisableonerr,
        "run_as_owner": sub.subrunasowner,
        "failover": sub.subfailover,
        "origin": sub.suborigin,
        "gid_format": sub.subgidformat,
        "conflict_log": sub.subconflictlog,
        "ddl": sub.subddl,
    }


def _status_of(catalog: Catalog, sub: Subscription, publisher_timeout: int) -> dict[str, Any]:
    holder, waiting = _holder(catalog, sub.subid), _standbys(catalog, sub.subid)
    origin = origin_progress(catalog, sub)
    error = catalog.last_error(sub.subid)
    tables = catalog.table_states(sub.subid)
    result: dict[str, Any] = {
        **_options(sub),
        "slot_name": sub.subslotname,
        "publications": list(sub.subpublications),
        "publisher": sub.subconninfo,
        "skip_lsn": _lsn(sub.subskiplsn),
        "worker": str(holder) if holder else None,
        "holder": holder.as_dict() if holder else None,
        "standbys": [w.as_dict() for w in waiting],
        "tables": [
            {"name": t.name, "state": t.state.value, "lsn": _lsn(t.lsn), "rows": t.rows, "bytes": t.bytes}
            for t in tables
        ],
        "prepared": [
            {"gid": gid, "prepared_at": _when(at)} for gid, at in catalog.pending_prepared(sub.subid)
        ],
        "last_error": None
        if error is None
        else {
            "at": _when(error["occurred_at"]),
            "message": error["message"],
            "remote_xid": error["remote_xid"],
            "finish_lsn": _lsn(error["finish_lsn"]),
            "message_type": error["message_type"],
            "relation": error["relation"],
            "sqlstate": error["sqlstate"],
            "gid": error["gid"],
            "retry_count": error["retry_count"],
            "next_retry_at": _when(error["next_retry_at"]),
            "skip_command": _skip_command(sub.subname, error["finish_lsn"]),
            "resolved": _resolved(error, origin, tables),
        },
    }
    lag = catalog.lag(sub.subid)
    if lag is not None:
        lag.pop("subid", None)
        lag["updated_at"] = _when(lag["updated_at"])
    result["apply_lag"] = lag
    result["stalled"] = _stall_of(catalog, sub.subid)
    stats = catalog.subscription_stats(sub.subid)
    stats["stats_reset"] = _when(stats["stats_reset"])
    result["stats"] = stats  # pg_stat_subscription_stats' columns (PostgreSQL 18)
    result["replication"] = _publisher_view(sub, origin, publisher_timeout)
    return result


def _resolved(error: dict[str, Any], origin: int, tables: list[RelState]) -> bool | None:
    """Whether the worker has got past the recorded error since: the failing remote transaction is applied (or
    skipped: the origin is at or past its finish LSN), or the failing table of a table sync is synchronized (``s``
    or ``r``). None when the record says too little to tell (e.g. the publisher refused the replication start).
    Without it, a status read after the worker recovered would still show the old error's next attempt, in the
    past, as if it were still failing."""
    if error["finish_lsn"]:
        return origin >= error["finish_lsn"]
    if error["relation"] and error["message_type"]:
        synced = {t.name for t in tables if t.state in (SyncState.SYNCDONE, SyncState.READY)}
        return error["relation"] in synced
    return None


def _publisher_view(sub: Subscription, origin: int, timeout: int) -> dict[str, Any]:
    """Positions and lag as the publisher sees them: the slot, and the walsender serving our application_name.

    ``received`` is what the worker reported as written (it reports the last received LSN there, behaviour 7),
    ``flushed`` and ``applied`` are its flush and apply positions; ``origin`` is the target's own durable record of
    what it applied. Lag is the publisher's current WAL position minus the applied position.
    """
    view: dict[str, Any] = {"origin_lsn": _lsn(origin), "publisher_reachable": False}
    try:
        conn = psycopg.connect(sub.subconninfo, autocommit=True, connect_timeout=timeout)
    except psycopg.Error as exc:
        view["publisher_error"] = failure_reason(exc, sub.subconninfo)
        return view
    with conn:
        slot = conn.execute(
            "SELECT active, active_pid, restart_lsn::text, confirmed_flush_lsn::text, two_phase"
            " FROM pg_replication_slots WHERE slot_name = %s",
            (sub.subslotname,),
        ).fetchone()
        current = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]  # type: ignore[index]
        stream = None
        if slot is not None and slot[1] is not None:
            stream = conn.execute(
                "SELECT state, write_lsn::text, flush_lsn::text, replay_lsn::text,"
                " (pg_current_wal_lsn() - replay_lsn)::bigint, extract(epoch FROM replay_lag)::float8, reply_time"
                " FROM pg_stat_replication WHERE pid = %s",
                (slot[1],),
            ).fetchone()
    view.update(publisher_reachable=True, publisher_lsn=current, slot_exists=slot is not None)
    if slot is not None:
        view.update(
            slot_active=slot[0], slot_two_phase=slot[4], restart_lsn=slot[2], confirmed_flush_lsn=slot[3]
        )
    if stream is not None and stream[0] is not None:  # NULLs unless the role has pg_read_all_stats
        state, write, flush, replay, lag_bytes, lag_seconds, reply_time = stream
        view.update(
            stream_state=state,
            received_lsn=write,
            flushed_lsn=flush,
            applied_lsn=replay,
            last_reply=_when(reply_time),
            lag_bytes=max(lag_bytes or 0, 0),
            lag_seconds=lag_seconds if lag_seconds is not None else (0.0 if not lag_bytes else None),
        )
    elif origin:
        lag = parse_lsn(current) - origin
        view.update(lag_bytes=max(lag, 0), lag_seconds=None)
    return view


_TWO_PHASE_WORDS = {s.value: s.name.lower() for s in TwoPhaseState}
_STATE_WORDS = {s.value: s.name.lower() for s in SyncState}


def _secs(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


#: a stall row not refreshed for this long is a dead worker's (the watchdog refreshes it every second)
STALL_FRESH_S = 10.0


def _stall_of(catalog: Catalog, subid: int) -> dict[str, Any] | None:
    """The worker's current stall (applier.apply.stall: behind, no progress for a while), as status shows it."""
    row = catalog.stall(subid, STALL_FRESH_S)
    if row is None:
        return None
    return {
        "since": _when(row["since"]), "waiting_on": row["waiting_on"], "received_lsn": _lsn(row["received_lsn"]),
        "applied_lsn": _lsn(row["applied_lsn"]), "unanswered": row["unanswered"],
    }  # fmt: skip


def _stall_line(st: dict[str, Any]) -> str:
    answered = f", {st['unanswered']} statements unanswered" if st["waiting_on"] == "target" else ""
    return (
        f"  STALLED since {st['since']}: behind with no progress (received {st['received_lsn']}, applied "
        f'{st["applied_lsn"]}), waiting on the {st["waiting_on"]}{answered} (docs/operations.md, "Stalls")'
    )


def _stats_line(st: dict[str, Any]) -> str:
    """The counters on one line, as ``\\dRs+`` would show them: the errors, then each conflict kind counted."""
    conflicts = ", ".join(
        f"{name.removeprefix('confl_')} {n}" for name, n in st.items() if name.startswith("confl_") and n
    )
    line = (
        f"  stats: apply errors {st['apply_error_count']}, sync errors {st['sync_error_count']}, conflicts: "
    )
    line += conflicts or "none"
    if st["stats_reset"]:
        line += f" (since reset at {st['stats_reset']})"
    return line


def _figure_lines(s: dict[str, Any]) -> list[str]:
    """The stall going on, if any, and the counters."""
    return [
        *([_stall_line(s["stalled"])] if s.get("stalled") else []),
        *([_stats_line(s["stats"])] if s.get("stats") else []),
    ]


def _worker_lines(s: dict[str, Any]) -> list[str]:
    """Who holds the subscription, and the standbys waiting for it."""
    lines = [f"  worker: {s['worker'] or 'not running'}"]
    for w in s["standbys"]:
        where = f" from {w['client']}" if w["client"] else ""
        lines.append(
            f"  standby: {w['application_name']}{where} (target backend pid {w['backend_pid']}), "
            f"waiting since {w['since']}"
        )
    return lines


def format_status(entries: list[dict[str, Any]]) -> str:
    """The human-readable form of :func:`status`."""
    if not entries:
        return "no subscriptions (applier create makes one)"
    blocks = []
    for s in entries:
        r = s["replication"]
        lines = [
            f'subscription "{s["name"]}" (subid {s["subid"]}): {"enabled" if s["enabled"] else "disabled"}, '
            f"two-phase {s['two_phase']} ({_TWO_PHASE_WORDS.get(s['two_phase'], '?')}), streaming {s['streaming']}, "
            f"binary {str(s['binary']).lower()}, origin {s['origin']}, disable_on_error "
            f"{str(s['disable_on_error']).lower()}, run_as_owner {str(s['run_as_owner']).lower()}, "
            f"ddl {str(s['ddl']).lower()}" + (f", skip-LSN {s['skip_lsn']}" if s["skip_lsn"] else ""),
            f"  publisher: {s['publisher']}; publications {', '.join(s['publications'])}; slot {s['slot_name']}"
            + (" (failover)" if s["failover"] else ""),
            *_worker_lines(s),
        ]
        if r["publisher_reachable"]:
            positions = ", ".join(
                f"{label} {r.get(key) or '-'}"
                for label, key in (
                    ("received", "received_lsn"),
                    ("flushed", "flushed_lsn"),
                    ("applied", "applied_lsn"),
                    ("origin", "origin_lsn"),
                    ("publisher", "publisher_lsn"),
                )
            )
            lag = "-" if r.get("lag_bytes") is None else f"{r['lag_bytes']} bytes"
            if r.get("lag_seconds") is not None:
                lag += f", {r['lag_seconds']:.1f} s"
            lines.append(f"  LSN: {positions}; lag {lag}")
            if not r["slot_exists"]:
                lines.append(f"  slot {s['slot_name']} does not exist on the publisher")
        else:
            lines.append(
                f"  LSN: origin {r['origin_lsn'] or '-'}; publisher unreachable: {r.get('publisher_error')}"
            )
        if s.get("apply_lag"):
            a = s["apply_lag"]
            lines.append(
                f"  apply lag (publisher commit to local commit): last {_secs(a['last_s'])} ({a['last_kind']}); "
                f"p50 {_secs(a['p50_s'])}, p99 {_secs(a['p99_s'])}, max {_secs(a['max_s'])} over {a['samples']} "
                f"local commits in the {a['window_s']:.0f} s before {a['updated_at']}"
            )
        lines.extend(_figure_lines(s))
        lines.append(f"  tables ({len(s['tables'])}):")
        for t in s["tables"]:
            lsn = f" at {t['lsn']}" if t["lsn"] else ""
            copied = (
                f", copied {t['rows']} rows / {human_bytes(t['bytes'])}" if t["rows"] or t["bytes"] else ""
            )
            lines.append(f"    {t['state']} ({_STATE_WORDS.get(t['state'], '?')}{lsn}{copied})  {t['name']}")
        if s["prepared"]:
            lines.append("  prepared on the target: " + ", ".join(p["gid"] for p in s["prepared"]))
        if s["last_error"]:
            lines.extend(_error_lines(s["last_error"]))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
