"""Helpers the test modules share, apart from the tests themselves: a test module imports them as
``from tests.support.cli import ok``, whichever folder it is in, rather than importing another test module.

- :mod:`.cli`: the command line in a subprocess, ``status --json``, the catalog (``tests/integration/test_cli_*.py``
  and the tests that drive ``applier`` as a user would);
- :mod:`.tap`: the ports of PostgreSQL's subscription TAP tests, the crash, property and differential tests;
- :mod:`.native`: PostgreSQL's own subscriber beside ours, for the differential tests;
- :mod:`.applier_kit`: the apply core on a recording fake target, for the unit tests;
- :mod:`.subscription_model`: the state machines composed into one subscription's life, for the property tests;
- :mod:`.migrate`: ``applier migrate`` started, waited for, cut over and compared, and its fixtures (the started
  processes, older source servers), for ``tests/integration/test_migrate_*.py``;
- :mod:`.plan_facts`: hand-made facts for the migration plan's rules, for the unit tests;
- :mod:`.trust`: an untrusted table owner's attack on the apply role, for the trust tests of the apply and the copy.

``tests/unit/test_code_shape.py`` fails when a test module imports another test module.
"""
