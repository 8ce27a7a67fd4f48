"""Skip-LSN rules: ``alter NAME --skip-lsn X`` drops the changes of the one remote transaction finishing at X
(behaviours 97-100).

The user takes X from the error of a transaction that cannot be applied (a conflict, a missing table). The worker
compares X with the finish LSN of each remote transaction as it begins (``starts_skipping``) and, when the
transaction ends, decides whether the skip-LSN is cleared (``on_transaction_end``). The finish LSN is the
Begin's final_lsn / Stream Commit's commit_lsn for a commit and the prepare_lsn for Begin Prepare / Stream Prepare.
``0`` means no skip-LSN (``NONE``).
"""

from __future__ import annotations

from enum import StrEnum

from applier.lsn import format_lsn


class SkipOutcome(StrEnum):
    """What to do with the stored skip-LSN when a remote transaction ends."""

    #: Leave it: nothing is set, or this transaction neither matched nor applied anything.
    KEEP = "keep"
    #: The skipped transaction ended: clear it (LOG ``completed_skipping_message``).
    CLEAR = "clear"
    #: A transaction that did not match applied something, so the skip-LSN was wrong (it names a transaction
    #: that is already past or never comes): clear it with ``mistaken_skip_warning``.
    CLEAR_WITH_WARNING = "clear-with-warning"

    @property
    def clears(self) -> bool:
        return self is not SkipOutcome.KEEP


def starts_skipping(skip_lsn: int, finish_lsn: int) -> bool:
    """Whether the transaction finishing at ``finish_lsn`` is the one to skip (``maybe_start_skipping_changes``).

    While it is skipped its INSERT/UPDATE/DELETE/TRUNCATE are dropped; Relation and Type messages are still
    processed, because later transactions need them. Decided once at BEGIN: a skip-LSN altered mid-transaction does
    not affect the transaction under way.
    """
    return skip_lsn != 0 and skip_lsn == finish_lsn


def on_transaction_end(skip_lsn: int, finish_lsn: int, applied_something: bool) -> SkipOutcome:
    """Whether the skip-LSN is cleared as the remote transaction finishing at ``finish_lsn`` ends
    (``clear_subscription_skip_lsn``).

    ``applied_something`` is whether the worker opened a local transaction for it, i.e. received at least one
    change (even one filtered out because its table was still syncing); an empty transaction leaves a mistaken
    skip-LSN in place, as PostgreSQL does. Commit Prepared and Rollback Prepared always count as applying
    something (they finish a local prepared transaction); PostgreSQL compares their end LSN.

    Clear the skip-LSN in the same local transaction as the commit (or right after the PREPARE, which cannot
    include it) and only if the catalog still holds the value the worker read (``UPDATE ... WHERE subskiplsn =
    <cached>``): the user may have set a new one meanwhile, and that one must survive.
    """
    if not skip_lsn:
        return SkipOutcome.KEEP
    if skip_lsn == finish_lsn:
        return SkipOutcome.CLEAR
    if applied_something:
        return SkipOutcome.CLEAR_WITH_WARNING
    return SkipOutcome.KEEP


def starts_skipping_message(finish_lsn: int) -> str:
    """PostgreSQL's LOG line when a skip begins."""
    return f"logical replication starts skipping transaction at LSN {format_lsn(finish_lsn)}"


def completed_skipping_message(finish_lsn: int) -> str:
    """PostgreSQL's LOG line when the skipped transaction ends."""
    return f"logical replication completed skipping transaction at LSN {format_lsn(finish_lsn)}"


def mistaken_skip_warning(subname: str, skip_lsn: int, finish_lsn: int) -> tuple[str, str]:
    """PostgreSQL's WARNING and DETAIL for ``SkipOutcome.CLEAR_WITH_WARNING`` (behaviour 100)."""
    return (
        f'skip-LSN of subscription "{subname}" cleared',
        f"Remote transaction's finish WAL location (LSN) {format_lsn(finish_lsn)} did not match skip-LSN "
        f"{format_lsn(skip_lsn)}.",
    )
