pytest_plugins = ["applier.testing.pytest_plugin"]
