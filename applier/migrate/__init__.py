"""``applier migrate``: move a live database to another server (docs/reference.md, "Migration commands"; issue 17).

Small modules, pure logic apart from the I/O at their edges:

- :mod:`applier.migrate.selection` — which schemas and tables a migration covers (pure);
- :mod:`applier.migrate.plan` — the read-only dry run: pure blocker and warning rules over the facts that
  :mod:`applier.migrate.survey` reads from both servers (which also reads the tables a selection covers, for
  ``plan`` and ``start`` alike);
- :mod:`applier.migrate.tools` — finding a ``pg_dump``/``pg_restore`` new enough for the source;
- :mod:`applier.migrate.cli` — the ``applier migrate`` verbs.
"""
