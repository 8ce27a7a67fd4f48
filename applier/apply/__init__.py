"""The apply side: stream a subscription's changes from the publisher and apply them to the target.

* :mod:`~applier.apply.worker` — :class:`ApplyWorker`, the loop ``applier run`` drives (the entry point);
* :mod:`~applier.apply.handlers` — one handler per pgoutput message (worker.c's ``apply_handle_*``);
* :mod:`~applier.apply.target` — the target adapter: psycopg in libpq pipeline mode, prepared statements, COPY;
* :mod:`~applier.apply.relmap` — publisher relations mapped onto local tables by name;
* :mod:`~applier.apply.spool` — streamed transactions spooled to disk;
* :mod:`~applier.apply.feedback` — write/flush/apply positions for the publisher;
* :mod:`~applier.apply.context` — error context (remote xid, finish LSN, message type, relation).
"""

from applier.apply.worker import ApplyWorker, ApplyWorkerError, WorkerThread, start_worker

__all__ = ["ApplyWorker", "ApplyWorkerError", "WorkerThread", "start_worker"]
