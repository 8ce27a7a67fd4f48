"""The differential tests' fixture: the cluster of PostgreSQL's own subscriber (:mod:`tests.support.native`), for
every module here (module-scoped: each module starts its own)."""

from tests.support.native import native_cluster

__all__ = ["native_cluster"]
