"""``applier status`` says whether the worker got past its last recorded error
(applier.subscriptions.cmd_status._resolved), and stops showing a next attempt and a skip command for one it got past."""

from __future__ import annotations

from typing import Any

from applier.catalog.store import RelState
from applier.subscriptions.cmd_status import _error_lines, _resolved
from state.tables import SyncState


def _error(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "at": "2026-11-26T10:00:00+00:00", "message": "duplicate key", "sqlstate": "23505", "remote_xid": 7,
        "finish_lsn": None, "gid": None, "message_type": None, "relation": None, "retry_count": 3,
        "next_retry_at": "2026-11-26T10:00:04+00:00", "skip_command": None,
    }  # fmt: skip
    return base | kw


def _table(name: str, state: SyncState) -> RelState:
    return RelState(subid=1, relid=1, name=name, remote_name=name, state=state, lsn=None, rows=0, bytes=0)


def test_an_apply_error_is_resolved_once_the_origin_passed_its_finish_lsn() -> None:
    e = _error(finish_lsn=1000, message_type="INSERT", relation="public.t")
    assert _resolved(e, 999, []) is False
    assert _resolved(e, 1000, []) is True  # skipped: the origin is moved to the transaction's end
    assert _resolved(e, 1200, []) is True


def test_a_sync_error_is_resolved_once_its_table_is_synchronized() -> None:
    e = _error(message_type="COPY", relation="public.t2")
    for state, resolved in ((SyncState.DATASYNC, False), (SyncState.SYNCDONE, True), (SyncState.READY, True)):
        assert _resolved(e, 0, [_table("public.t1", SyncState.READY), _table("public.t2", state)]) is resolved


def test_an_error_without_transaction_or_table_cannot_tell() -> None:
    assert _resolved(_error(), 5000, []) is None


def test_a_resolved_error_shows_neither_next_attempt_nor_skip_command() -> None:
    skip = "applier alter s --skip-lsn 0/3E8"
    e = _error(finish_lsn="0/3E8", message_type="INSERT", relation="public.t", skip_command=skip)
    failing = "\n".join(_error_lines(e | {"resolved": False}))
    assert "next attempt at" in failing and skip in failing and "resolved" not in failing
    done = "\n".join(_error_lines(e | {"resolved": True}))
    assert "resolved since" in done and "next attempt" not in done and skip not in done
    assert "duplicate key" in done and "during INSERT on public.t" in done
