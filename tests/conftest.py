"""The test suite's root: four folders by what a test needs (docs/testing.md).

- ``unit/``: no server; ``pytest tests/unit`` runs in seconds without PostgreSQL.
- ``integration/``: real publisher and target servers started by the harness (``applier.testing``).
- ``tap/``: ports of PostgreSQL's own subscription TAP tests.
- ``differential/``: our applier against PostgreSQL's native subscriber from one publisher (generated workloads,
  and the corpus of real schemas).

Test modules share helpers through the ``tests.support`` package (``from tests.support.cli import ok``), whichever
folder they live in; the repository root is on ``sys.path`` through pytest's ``pythonpath`` setting (pyproject.toml).
"""

import pytest
from hypothesis import settings

# the helpers' asserts explain a failure as a test's own do (pytest rewrites only test modules and conftests itself)
pytest.register_assert_rewrite("tests.support")

pytest_plugins = ["applier.testing.pytest_plugin"]

# `--hypothesis-profile=long` is applied before test modules are imported, so the profile must exist here; the
# modules read the profile's name and size their examples, workloads and fault schedules from it.
settings.register_profile("long", max_examples=150, deadline=None, stateful_step_count=50)
