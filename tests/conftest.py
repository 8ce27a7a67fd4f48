from hypothesis import settings

pytest_plugins = ["applier.testing.pytest_plugin"]

# `--hypothesis-profile=long` is applied before test modules are imported, so the profile must exist here; the
# modules read the profile's name and size their examples, workloads and fault schedules from it.
settings.register_profile("long", max_examples=150, deadline=None, stateful_step_count=50)
