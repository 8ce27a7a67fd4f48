"""The migration's phases and its error: the pure rules (its tables are :mod:`applier.migrate.store`'s).

The phases (``status --json``'s ``phase``) are a :class:`Phase`; the moves between them are data
(:data:`TRANSITIONS`, h11's way) and one function decides (:func:`advance`): ``schema`` → ``copy`` →
``following`` → ``cutover`` → ``done``; ``failed`` from anywhere but ``done``; a failed or interrupted cutover goes
back to ``following``; ``start`` after ``failed`` resumes where it was. A phase is never compared as a bare string
(``tests/unit/test_code_shape.py`` checks it): a :class:`Phase` is a ``str``, so the stored text and the JSON stay
the same.
"""

from __future__ import annotations

from enum import StrEnum

from applier.errors import ApplierError

__all__ = ["PHASES", "TRANSITIONS", "MigrationError", "Phase", "advance"]


class Phase(StrEnum):
    SCHEMA = "schema"  # the publications, the slot and its snapshot, the pre-data
    COPY = "copy"  # the rows at the snapshot, post-data as each table lands
    FOLLOWING = "following"  # the apply loop replays the source; a cutover may begin
    CUTOVER = "cutover"  # a cutover runs (or died: the next verb undoes what it left)
    DONE = "done"  # the target has taken over; the source stays fenced
    FAILED = "failed"  # aborted

    @property
    def ended(self) -> bool:
        """Whether ``start`` stops for good in this phase (another shell's cutover or abort decided)."""
        return self in (Phase.DONE, Phase.FAILED)


PHASES = tuple(Phase)

#: From each phase, the phases it may move to (itself included: a step recorded again by a resumed run).
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.SCHEMA: frozenset({Phase.SCHEMA, Phase.COPY, Phase.FAILED}),
    Phase.COPY: frozenset({Phase.COPY, Phase.FOLLOWING, Phase.FAILED}),
    Phase.FOLLOWING: frozenset({Phase.FOLLOWING, Phase.CUTOVER, Phase.FAILED}),
    Phase.CUTOVER: frozenset({Phase.CUTOVER, Phase.FOLLOWING, Phase.DONE, Phase.FAILED}),
    Phase.DONE: frozenset({Phase.DONE}),
    Phase.FAILED: frozenset({Phase.FAILED, Phase.SCHEMA, Phase.COPY, Phase.FOLLOWING}),
}


class MigrationError(ApplierError):
    """A migration command refused or failed; the message says why and what to do."""


def advance(current: str, new: str) -> Phase:
    """The phase after moving from ``current`` to ``new``; raises if the move is not allowed."""
    try:
        here, there = Phase(current), Phase(new)
    except ValueError:
        raise MigrationError(f"a migration in phase {current!r} cannot move to {new!r}") from None
    if there not in TRANSITIONS[here]:
        raise MigrationError(f"a migration in phase {current!r} cannot move to {new!r}")
    return there
