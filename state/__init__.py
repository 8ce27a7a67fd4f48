"""The subscription's state: the catalog (``catalog``) and the pure state machines around it.

- ``tables``: per-table sync states ``i d f [w c] s r`` and ``should_apply_changes_for_rel``.
- ``twophase``: the two-phase tri-state ``d p e`` and the ALTER rules that touch it.
- ``skip``: the skip-LSN rules.
- ``subscription``: ``apply_event``, the event-driven machine the worker and the command line call.

Everything except ``catalog`` is free of I/O: values and events in, decisions out.
"""
