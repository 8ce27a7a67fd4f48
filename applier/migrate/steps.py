"""A post-data step of a migration: what it runs, which tables' copy it waits for, which steps it follows.

Its own module, with no I/O, so that the store (:mod:`applier.migrate.store`), the modules that make steps
(:mod:`applier.migrate.postdata` and its neighbours) and the scheduler share one definition without importing each
other.

A step's kind is a :class:`StepKind`; its name (unique within the migration, the key of its row, and what the
progress lines show) is made by :func:`step_name` only, from its kind and its subject (the object it makes:
``index public.a_v_idx``). A step that must follow another names it with the same function, so the two cannot
drift apart. The kinds' values and the names are stored (``applier.migration_step``) and shown (``status``), so
they never change: a resumed migration finds its steps by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["CUTOVER_KINDS", "SWITCH_KINDS", "Step", "StepKind", "step_name"]


class StepKind(StrEnum):
    """What a step does (``postdata``'s docstring and its neighbours' say how)."""

    INDEX = "index"
    KEY = "key"
    ATTACH = "attach"
    CONSTRAINT = "constraint"
    FK = "fk"
    VALIDATE = "validate"
    REPLICA_IDENTITY = "replica_identity"
    TRIGGER = "trigger"
    PARTITIONED_INDEX = "partitioned_index"
    PARTITIONED_CONSTRAINT = "partitioned_constraint"
    ATTACH_PARTITION = "attach_partition"
    PARTITIONED_FK = "partitioned_fk"
    PARTITIONED_TRIGGER = "partitioned_trigger"
    MATVIEW = "matview"
    CLUSTER = "cluster"
    COMMENT = "comment"
    RULE = "rule"
    ROW_SECURITY = "row_security"
    POLICY = "policy"
    STATISTICS = "statistics"
    #: the cutover's own: run under the fence, not by post-data
    CUTOVER_IDENTITY = "cutover_identity"
    CUTOVER_EVENT_TRIGGER = "cutover_event_trigger"
    CUTOVER_REFRESH = "cutover_refresh"

    @property
    def prefix(self) -> str:
        """The first word of its steps' names (the kind's value but for the few named shorter long ago)."""
        return _PREFIX.get(self, self.value)

    @property
    def at_cutover(self) -> bool:
        """Whether the cutover runs steps of this kind (post-data never does)."""
        return self in CUTOVER_KINDS


_PREFIX = {
    StepKind.PARTITIONED_INDEX: "pindex",
    StepKind.PARTITIONED_CONSTRAINT: "pconstraint",
    StepKind.PARTITIONED_FK: "pfk",
    StepKind.PARTITIONED_TRIGGER: "ptrigger",
    StepKind.CUTOVER_IDENTITY: "identity",
    StepKind.CUTOVER_EVENT_TRIGGER: "event_trigger",
}

#: The kinds the cutover runs; every other kind is post-data (``status``'s ``post_data`` counts those).
CUTOVER_KINDS = frozenset(
    {StepKind.CUTOVER_IDENTITY, StepKind.CUTOVER_EVENT_TRIGGER, StepKind.CUTOVER_REFRESH}
)


#: The cutover's steps that its switch runs (the refresh runs before the verification, :mod:`.matviews`); after a
#: ``--prepared carry`` cutover, ``status`` lists those left for later.
SWITCH_KINDS = (StepKind.CUTOVER_IDENTITY, StepKind.CUTOVER_EVENT_TRIGGER)


def step_name(kind: StepKind, subject: str) -> str:
    """The name of the step of ``kind`` that makes ``subject`` (``table.constraint``, a quoted index, ...): the one
    place a name is made, both for a new step and for a step that must follow it."""
    return f"{kind.prefix} {subject}"


@dataclass(frozen=True)
class Step:
    step: str  # unique within the migration, made by step_name(kind, subject)
    kind: StepKind
    relnames: tuple[str, ...]  # tables (quoted, qualified) whose copy must be finished
    after: tuple[str, ...]  # steps that must be done first
    statements: tuple[str, ...]
    ord: int = 0
    done: bool = False

    def __post_init__(self) -> None:
        """The kind as a :class:`StepKind` even when given as its text (a row read back, a test)."""
        object.__setattr__(self, "kind", StepKind(self.kind))

    @classmethod
    def of(
        cls,
        kind: StepKind,
        subject: str,
        relnames: tuple[str, ...],
        after: tuple[str, ...],
        statements: tuple[str, ...],
        ord: int = 0,
    ) -> Step:
        """A new step, named by :func:`step_name`."""
        return cls(step_name(kind, subject), kind, relnames, after, statements, ord)

    @property
    def subject(self) -> str:
        """What the step makes: its name without the kind's prefix (the inverse of :func:`step_name`)."""
        return self.step.removeprefix(f"{self.kind.prefix} ")
