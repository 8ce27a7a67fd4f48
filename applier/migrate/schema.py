"""Pre-data at the migration's snapshot: ``pg_dump --section=pre-data --snapshot=S`` of the selected schemas (and
the extensions), applied to the target in one transaction.

The dump runs with the source's password in ``PGPASSWORD`` (never on the command line, where ``ps`` shows it). Its
plain SQL is executed by us, not by psql, so that it commits in the same target transaction as the migration's
record of it (a kill leaves either everything or nothing). Two edits make it apply to a fresh database: psql's
``\\restrict``/``\\unrestrict`` lines (meta-commands, which only psql understands and which guard psql itself) are
dropped, so is a ``SET`` of a parameter the target does not have (a newer pg_dump's, into an older target), and
``CREATE SCHEMA x;`` becomes ``CREATE SCHEMA IF NOT EXISTS x;`` (``public`` exists already).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Collection, Sequence

from psycopg.conninfo import make_conninfo

from applier.conninfo import parse
from applier.migrate.state import MigrationError
from applier.migrate.tools import DumpTools

__all__ = ["dump_pre_data", "edit_script", "pattern"]

_RESTRICT = re.compile(r"^\\(?:un)?restrict [A-Za-z0-9]+$", re.M)
_CREATE_SCHEMA = re.compile(r"^CREATE SCHEMA (.+);$", re.M)
_SET = re.compile(r"^SET ([a-z_]+) = [^;\n]*;$", re.M)


def pattern(*parts: str) -> str:
    """A pg_dump name pattern that matches exactly these identifiers (no wildcards): each part double-quoted."""
    return ".".join('"' + p.replace('"', '""') + '"' for p in parts)


def edit_script(script: str, settings: Collection[str] | None = None) -> str:
    """The dump as our own session can run it (see the module docstring). ``settings``: the target's parameter
    names; a ``SET`` of one it lacks is dropped (a newer pg_dump sets ``transaction_timeout``, unknown before 17)."""
    script = _RESTRICT.sub("", script)
    if settings is not None:
        known = set(settings)
        script = _SET.sub(lambda m: m.group(0) if m.group(1) in known else "", script)
    return _CREATE_SCHEMA.sub(r"CREATE SCHEMA IF NOT EXISTS \1;", script)


def dump_pre_data(
    tools: DumpTools,
    source: str,
    snapshot: str | None,
    schemas: Sequence[str],
    exclude: Sequence[tuple[str, str]],
    settings: Collection[str] | None = None,
) -> str:
    """The pre-data SQL of ``schemas`` without the tables in ``exclude`` (``(schema, table)``), plus extensions."""
    params = parse(source, "source")
    password = params.pop("password", None)
    env = dict(os.environ)
    if password:
        env["PGPASSWORD"] = password
    argv = [
        tools.pg_dump,
        "--section=pre-data",
        "--no-publications",
        "--no-subscriptions",
        "--extension=*",
        "--dbname",
        make_conninfo("", **params),
    ]
    if snapshot:
        argv.append(f"--snapshot={snapshot}")
    for s in schemas:
        argv += ["--schema", pattern(s)]
    for s, t in exclude:
        argv += ["--exclude-table", pattern(s, t)]
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise MigrationError(f"pg_dump of the source's schema failed: {res.stderr.strip()}")
    return edit_script(res.stdout, settings)
