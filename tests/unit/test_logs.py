"""``applier run``'s stderr is its log: with ``--log-format json`` every line is a record, including what Python
would print there by itself (a library's warning, an exception that ends a thread or that Python ignores, one that
nobody caught), and no record carries the target's password, not even in an exception's text. Run in a child
interpreter: the hooks are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = r"""
import gc, threading, warnings
from applier.logs import configure_logging

TARGET = "host=db user=u password=hunter2-secret"
configure_logging(TARGET, log_format=LOG_FORMAT)

warnings.warn("a library's warning", DeprecationWarning, stacklevel=1)

def boom():
    raise RuntimeError("a thread's end, with " + TARGET)
t = threading.Thread(target=boom, name="helper")
t.start(); t.join()

class Leaky:
    def __del__(self):
        raise ValueError("ignored in __del__")
Leaky(); gc.collect()

raise KeyError("nobody caught this")
"""


def _run(log_format: str) -> subprocess.CompletedProcess[str]:
    code = f"LOG_FORMAT = {log_format!r}\n" + _CHILD
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=60
    )


def test_with_json_logs_every_line_on_stderr_is_a_record_and_no_password_leaks() -> None:
    res = _run("json")
    assert res.returncode == 1 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines and all(line.startswith("{") for line in lines), res.stderr
    records = [json.loads(line) for line in lines]
    by_message = {r["message"]: r for r in records}
    assert "hunter2-secret" not in res.stderr
    assert any("a library's warning" in m for m in by_message), records
    helper = by_message["thread helper ended with an exception"]
    assert helper["level"] == "error" and "RuntimeError: a thread's end" in helper["exception"]
    assert "password=" in helper["exception"]  # the conninfo is there, its password scrubbed
    assert any(m.startswith("Exception ignored") and "ValueError" in r.get("exception", "")
               for m, r in by_message.items()), records  # fmt: skip
    assert "KeyError: 'nobody caught this'" in by_message["uncaught exception"]["exception"]


def test_with_text_logs_the_same_events_are_timestamped_lines() -> None:
    res = _run("text")
    assert res.returncode == 1
    assert "hunter2-secret" not in res.stderr
    assert " ERROR MainProcess[" in res.stderr and "thread helper ended with an exception" in res.stderr
    assert " CRITICAL MainProcess[" in res.stderr and "KeyError: 'nobody caught this'" in res.stderr
