"""The integration tests' shared fixture: ``start_run``, ``applier run`` in the background and stopped at the end
(:mod:`tests.support.cli`), for every module here that runs the command line as a service would."""

from tests.support.cli import start_run

__all__ = ["start_run"]
