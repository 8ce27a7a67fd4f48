"""Errors raised by the pure state machines in ``state``.

Two kinds, because they call for different reactions:

- ``AlterRefused``: a user asked for something PostgreSQL (or our rules) does not allow *now* (two-phase changed on
  an enabled subscription, a refresh that would copy while two-phase is on, a skip-LSN behind the origin...). The
  command line prints it and exits non-zero; the message says what is wrong and the hint what to do.
- ``IllegalTransition``: a caller tried to move a table or the subscription along an edge the state machine does
  not have. That is a bug in the caller or a catalog written by something else (two workers for one subscription,
  a hand-edited row); it names the edge so the log shows which.
"""

from __future__ import annotations

from applier.errors import ApplierError


class AlterRefused(ApplierError):
    """An ALTER (or CREATE) request refused by a rule; ``message`` says why, ``hint`` what to do instead.

    ``str()`` gives both, in psql's layout, so the CLI can print it as is.
    """

    def __init__(self, message: str, hint: str) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message}\nHINT: {hint}")


class IllegalTransition(ApplierError):
    """A state change the rules do not allow (a table leaving ``r``, ``f`` going back to ``d``, an event that
    makes no sense in the current state)."""
