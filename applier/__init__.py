"""A subscriber-side PostgreSQL logical-replication apply worker.

The package is layered like psycopg or h11: pure code over bytes and events at the core (``messages``,
``decoder``, ``encoder``, ``envelope``, the state machines in the top-level ``state`` package), and thin I/O edges
(``replication`` for the publisher's walsender, the target adapter, the ``catalog``, Spark in ``tablesync``) around it.
"""

__version__ = "0.1.0"
