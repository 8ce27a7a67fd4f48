"""The integration tests' shared fixtures, for every module here, each defined beside the helpers it goes with:

- ``start_run``: ``applier run`` in the background and stopped at the end (:mod:`tests.support.cli`), for every
  module that runs the command line as a service would;
- ``procs``: the ``migrate start`` processes a test started, killed at the end, and ``pg14``, ``pg15``, ``pg16``:
  older source servers, one per module that asks (:mod:`tests.support.migrate`), for the migration tests;
- ``mallory``: the untrusted owner of a replicated table (:mod:`tests.support.trust`), for the trust tests of the
  apply and of the copy.

A module that defines a fixture of the same name (``test_pg14_publisher.py``'s ``pg14``, ``test_migrate_bench.py``'s
``pg15``) uses its own."""

from tests.support.cli import start_run
from tests.support.migrate import pg14, pg15, pg16, procs
from tests.support.trust import mallory

__all__ = ["mallory", "pg14", "pg15", "pg16", "procs", "start_run"]
