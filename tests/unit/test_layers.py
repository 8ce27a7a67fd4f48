"""The pure layers stay pure at run time, as Python really imports them (a submodule runs its packages'
``__init__`` first, which import-linter's static graph does not follow): importing the codec, the state machines
or the apply core loads no database driver, SQLAlchemy, Spark or tenacity. The static rules are the import-linter
contracts in ``.importlinter`` (``lint-imports``, in CI's lint step)."""

from __future__ import annotations

import subprocess
import sys

PURE = (
    "applier.messages", "applier.decoder", "applier.encoder", "applier.lsn", "applier.errors",
    "state.tables", "state.twophase", "state.skip", "state.errors",
    "applier.apply.handlers", "applier.apply.commit_policy", "applier.apply.ports", "applier.apply.bulk", "applier.apply.fold",
    "applier.apply.copytext", "applier.apply.relmap", "applier.apply.feedback", "applier.apply.spool",
    "applier.apply.context", "applier.apply.apply_state", "applier.apply.insert_sink", "applier.apply.bulk_exec",
    "applier.apply.prepared_records", "applier.apply.skip_clear", "applier.apply.loop", "applier.apply.route",
    "applier.apply.pacing", "applier.apply.coordinator", "applier.catalog.sql", "applier.privileges",
)  # fmt: skip
# (applier.testing.fake_target is pure too, statically; its package's __init__ brings the server harness, psycopg)
FORBIDDEN = (
    "psycopg",
    "sqlalchemy",
    "pyspark",
    "tenacity",
    "applier.apply.worker",
    "applier.apply.target",
    "applier.apply.pipeline",
    "applier.catalog.store",
    "applier.catalog.schema",
)  # (the target_* modules start with applier.apply.target)


def test_importing_the_pure_layers_loads_no_io():
    code = (
        "import importlib, sys\n"
        f"for m in {PURE!r}: importlib.import_module(m)\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == []


def test_the_worker_is_still_reachable_from_the_package():
    from applier.apply import ApplyWorker
    from applier.apply.worker import ApplyWorker as Direct

    assert ApplyWorker is Direct


def test_the_state_machines_load_nothing_of_applier_but_the_codec_base():
    """``state`` sits below ``applier``: importing every state machine loads ``applier.lsn`` and
    ``applier.errors`` (the codec's LSN helpers and error base) and nothing else of the package."""
    code = (
        "import importlib, pkgutil, sys, state\n"
        "for m in pkgutil.iter_modules(state.__path__): importlib.import_module('state.' + m.name)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('applier'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["applier", "applier.errors", "applier.lsn"]
