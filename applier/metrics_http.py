"""The ``/metrics`` endpoint of ``applier run --metrics-port``: the HTTP server and the reading of the workers'
counter files, made safe for what a scrape can meet.

Two things ``prometheus_client``'s own ``start_http_server`` and ``MultiProcessCollector`` get wrong for a
long-running process whose log may be JSON:

* a worker creates its counter file empty and sizes it a moment later; a scrape that reads it in between fails
  (``struct.error``), so a scrape as the worker starts, or as it first counts a new kind of metric, answered 500;
* the server prints any error of a scrape as a bare traceback on stderr (``wsgiref``'s handler and
  ``socketserver`` both do), which breaks ``--log-format json``: every line on stderr must be a log record.
"""

from __future__ import annotations

import glob
import io
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger("applier.metrics")

#: a counter file shorter than its 8-byte header has just been created and holds no value yet
_HEADER_BYTES = 8


class ReadyFilesCollector(MultiProcessCollector):
    """``MultiProcessCollector`` that leaves out the counter files a worker is still creating.

    A file only holds values once the worker has sized it (64 KiB) and written its header, and files never shrink,
    so a file seen shorter than the header has nothing to report yet and is read at the next scrape.
    """

    def collect(self) -> Iterable[Metric]:
        return self.merge(ready_files(self._path), accumulate=True)


def ready_files(path: str) -> list[str]:
    """The ``*.db`` counter files in ``path`` that have their header (see :class:`ReadyFilesCollector`)."""
    ready = []
    for name in glob.glob(os.path.join(path, "*.db")):
        try:
            if os.stat(name).st_size >= _HEADER_BYTES:
                ready.append(name)
        except FileNotFoundError:  # a 'live' gauge's file removed since the glob
            continue
    return ready


class _LogStream(io.StringIO):
    """Stands in for stderr in ``wsgiref``'s handler: what it prints (a traceback) becomes one log record at its
    ``flush``."""

    def flush(self) -> None:
        text = self.getvalue().strip()
        if text:
            log.error("metrics: a scrape failed: %s", text)
        self.seek(0)
        self.truncate()


class _QuietHandler(WSGIRequestHandler):
    """No access log (as ``prometheus_client``'s own handler); errors go to the log, not to stderr."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it so
        pass

    def get_stderr(self) -> _LogStream:  # type: ignore[override]
        return _LogStream()


class _Server(ThreadingWSGIServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver would print the traceback to stderr
        log.warning("metrics: a request from %s failed", client_address[0], exc_info=True)


def _logged(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """The scrape application, answering 500 with a log record (the traceback in it) when collecting fails."""

    def scrape(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            return app(environ, start_response)
        except Exception:
            log.exception("metrics: collecting failed")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")], sys.exc_info())
            return [b"collecting the metrics failed; the applier's log says why\n"]

    return scrape


def start_server(registry: CollectorRegistry, port: int, addr: str) -> WSGIServer:
    """Serve ``registry`` on ``addr:port`` from a daemon thread; return the server (``shutdown()`` stops it)."""
    httpd = make_server(addr, port, _logged(make_wsgi_app(registry)), _Server, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
