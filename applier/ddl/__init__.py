"""Schema changes while following (issue 39): DDL run on the source, captured there and replayed on the target at
its place in the change stream.

* :mod:`applier.ddl.payload` (pure): the capture's message, as ``pg_logical_emit_message`` carries it.
* :mod:`applier.ddl.statements` (pure): which statement of the client's query string an event is.
* :mod:`applier.ddl.capture` (edge): the event triggers on the source that emit those messages.

docs/architecture.md, "Schema changes", says why the capture sends the client's statement rather than a deparsed
command or a schema snapshot.
"""
