"""The subscription catalog in the target's ``applier`` schema: its schema, all its SQL, and access to it.

* :mod:`~applier.catalog.schema` — the tables (SQLAlchemy Core), the catalog version and the migrations;
* :mod:`~applier.catalog.store` — :class:`~applier.catalog.store.Catalog`: the rows as values (letters mapped to
  the enums of :mod:`state`, once), and every read and write outside the apply pipeline;
* :mod:`~applier.catalog.sql` — the text of the statements that the apply pipeline and the Spark tasks send
  themselves (text only, importable by the pure apply core).

This is the I/O layer (docs/architecture.md, "Layer rules"); the pure state machines in :mod:`state` decide, this
package persists. The package's ``__init__`` imports nothing, so that importing :mod:`applier.catalog.sql` loads
neither SQLAlchemy nor psycopg.
"""
