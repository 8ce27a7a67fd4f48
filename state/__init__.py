"""The subscription's pure state machines: values and events in, decisions out; no I/O.

- ``tables``: per-table sync states ``i d f [w c] s r`` and ``should_apply_changes_for_rel``.
- ``twophase``: the two-phase tri-state ``d p e``, the prepared transactions' GIDs and the ALTER rules that touch it.
- ``skip``: the skip-LSN rules.

The worker, the table sync and the command line call these rules directly; ``tests/support/subscription_model.py``
strings them into one subscription's life for the property tests.

The catalog that persists what they decide is the I/O package :mod:`applier.catalog`. Nothing here imports from
``applier`` but the codec's LSN helpers and its error base (``.importlinter``, contract ``state-below-applier``).
"""
