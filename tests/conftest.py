"""The test suite's root: four folders by what a test needs (docs/testing.md).

- ``unit/``: no server; ``pytest tests/unit`` runs in seconds without PostgreSQL.
- ``integration/``: real publisher and target servers started by the harness (``applier.testing``).
- ``tap/``: ports of PostgreSQL's own subscription TAP tests.
- ``differential/``: our applier against PostgreSQL's native subscriber from one publisher (generated workloads,
  and the corpus of real schemas).

Test modules share helpers by plain imports (``from test_cli_common import ...``); every folder is put on
``sys.path`` here, so such an import works whichever folder the importing test lives in.
"""

import sys
from pathlib import Path

from hypothesis import settings

_HERE = Path(__file__).resolve().parent
for _folder in ("unit", "integration", "tap", "differential"):
    if str(_HERE / _folder) not in sys.path:
        sys.path.insert(0, str(_HERE / _folder))

pytest_plugins = ["applier.testing.pytest_plugin"]

# `--hypothesis-profile=long` is applied before test modules are imported, so the profile must exist here; the
# modules read the profile's name and size their examples, workloads and fault schedules from it.
settings.register_profile("long", max_examples=150, deadline=None, stateful_step_count=50)
