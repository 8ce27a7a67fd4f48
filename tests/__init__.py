"""The test suite. A package so that test modules in every folder import the shared helpers as ``tests.support``
(the repository root is on ``sys.path`` through pytest's ``pythonpath`` setting in pyproject.toml)."""
