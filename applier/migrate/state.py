"""The migration's phases and its error: the pure rules (its tables are :mod:`applier.migrate.store`'s).

The phases (``status --json``'s ``phase``) move forward only (:func:`advance`, pure): ``schema`` → ``copy`` →
``following`` → ``cutover`` → ``done``; ``failed`` from anywhere but ``done``; a failed cutover goes back to
``following``.
"""

from __future__ import annotations

from applier.errors import ApplierError

__all__ = ["PHASES", "MigrationError", "advance"]

PHASES = ("schema", "copy", "following", "cutover", "done", "failed")

_ALLOWED = {
    "schema": {"schema", "copy", "failed"},
    "copy": {"copy", "following", "failed"},
    "following": {"following", "cutover", "failed"},
    "cutover": {"cutover", "following", "done", "failed"},
    "done": {"done"},
    "failed": {"failed", "schema", "copy", "following"},  # start again resumes where it was
}


class MigrationError(ApplierError):
    """A migration command refused or failed; the message says why and what to do."""


def advance(current: str, new: str) -> str:
    """The phase after moving from ``current`` to ``new``; raises if the move is not allowed."""
    if current not in _ALLOWED or new not in PHASES or new not in _ALLOWED[current]:
        raise MigrationError(f"a migration in phase {current!r} cannot move to {new!r}")
    return new
