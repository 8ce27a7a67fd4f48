"""The apply side: stream a subscription's changes from the publisher and apply them to the target.

* :mod:`~applier.apply.worker` — :class:`ApplyWorker`, the loop ``applier run`` drives (the entry point);
* :mod:`~applier.apply.handlers` — the transaction/dispatch core, one handler per pgoutput message (worker.c's
  ``apply_handle_*``), with its state in :mod:`~applier.apply.apply_state`;
* the speed strategies it calls: :mod:`~applier.apply.commit_policy` (group commit),
  :mod:`~applier.apply.insert_sink` (insert runs, COPY lanes), :mod:`~applier.apply.bulk_exec` (plans of
  :mod:`~applier.apply.bulk`), :mod:`~applier.apply.fold`, :mod:`~applier.apply.prepared_records`; and
  :mod:`~applier.apply.skip_clear`;
* :mod:`~applier.apply.ports` — the narrow target interface the core calls (the fake of the unit tests too);
* :mod:`~applier.apply.target` — the target session, with its parts :mod:`~applier.apply.pipeline` (libpq
  pipeline mode), :mod:`~applier.apply.target_dml`, :mod:`~applier.apply.target_copy`,
  :mod:`~applier.apply.target_catalog`;
* :mod:`~applier.apply.relmap` — publisher relations mapped onto local tables by name;
* :mod:`~applier.apply.spool` — streamed transactions spooled to disk;
* :mod:`~applier.apply.feedback` — write/flush/apply positions for the publisher;
* :mod:`~applier.apply.context` — error context (remote xid, finish LSN, message type, relation).

This package's ``__init__`` imports nothing: importing a pure module (``applier.apply.fold``, ``bulk``,
``handlers`` …) must not pull in the worker and with it psycopg, SQLAlchemy and Spark (issue 18; the import-linter
contracts in ``.importlinter`` and ``tests/unit/test_layers.py`` check it). ``from applier.apply import
ApplyWorker`` still works: the worker's names are loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ApplyWorker", "ApplyWorkerError", "WorkerThread", "start_worker"]


def __getattr__(name: str) -> Any:
    """Load the worker's names lazily (PEP 562), so that ``import applier.apply.<pure module>`` stays pure."""
    if name in __all__:
        from applier.apply import worker

        return getattr(worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
