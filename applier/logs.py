"""The log of ``applier run`` (and of ``migrate start`` while it follows): one record per line on stderr, as text
or JSON, passwords scrubbed.

stderr *is* the log of a long-running process, and a log shipper reading ``--log-format json`` fails on any line that
is not a record. So besides our own records, what Python would print there by itself goes through the log too: a
warning (``warnings.warn`` from a library), an exception that ends a thread, an exception Python ignores (in a
``__del__``), and an exception nobody caught.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from types import TracebackType
from typing import Any

from applier.conninfo import scrub
from applier.errors import ApplierError

__all__ = ["JsonFormatter", "configure_logging", "logs_json"]

log = logging.getLogger("applier")


class _ScrubPasswords(logging.Filter):
    """Last line of defence: no log line carries the target's password, whatever a library put in a message or
    an exception's text."""

    def __init__(self, *conninfos: str) -> None:
        super().__init__()
        self.conninfos = [c for c in conninfos if c]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.conninfos:
            record.msg = scrub(record.getMessage(), *self.conninfos)
            record.args = None
            if record.exc_info and not record.exc_text:
                record.exc_text = scrub(logging.Formatter().formatException(record.exc_info), *self.conninfos)
        return True


_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``--log-format json``: one JSON object per line for log shippers. Extra attributes a caller attached with
    ``extra=`` (remote xid, finish LSN, relation…) become fields of their own."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": record.processName,
            "pid": record.process,
            "message": record.getMessage(),
        }
        doc.update(
            {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and not k.startswith("_")}
        )
        if record.exc_info or record.exc_text:
            doc["exception"] = record.exc_text or self.formatException(record.exc_info)  # type: ignore[arg-type]
        return json.dumps(doc, default=str)


def configure_logging(target: str, level: str | int | None = None, log_format: str | None = None) -> None:
    """One line per event: time, level, process and subscription, message. ``APPLIER_LOG_LEVEL`` overrides INFO;
    ``log_format`` (or ``APPLIER_LOG_FORMAT``, which spawned workers inherit) is ``text`` or ``json``."""
    level = level or os.environ.get("APPLIER_LOG_LEVEL", "INFO").upper()
    log_format = log_format or os.environ.get("APPLIER_LOG_FORMAT", "text")
    if log_format not in ("text", "json"):
        raise ApplierError(
            f"unknown log format {log_format!r}\nHINT: use --log-format text or --log-format json"
        )
    os.environ["APPLIER_LOG_FORMAT"] = log_format  # the spawned workers format the same way
    handler = logging.StreamHandler(sys.stderr)
    formatter: logging.Formatter = (
        JsonFormatter()
        if log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(processName)s[%(process)d] %(message)s")
    )
    formatter.converter = time.gmtime  # type: ignore[assignment]
    handler.setFormatter(formatter)
    handler.addFilter(_ScrubPasswords(target))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("py4j", "sqlalchemy.engine"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)  # the py.warnings logger
    threading.excepthook = _thread_exception
    sys.unraisablehook = _unraisable
    sys.excepthook = _uncaught


def logs_json() -> bool:
    """Whether this process logs JSON records (then an error is one too, not a plain line on stderr)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def _thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    log.error(
        "thread %s ended with an exception",
        name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )  # type: ignore[arg-type]


def _unraisable(args: Any) -> None:
    what = args.err_msg or "Exception ignored in"
    exc = (args.exc_type, args.exc_value, args.exc_traceback)
    log.warning("%s: %r", what, args.object, exc_info=exc if args.exc_value is not None else None)


def _uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    log.critical("uncaught exception", exc_info=(exc_type, exc, tb))
