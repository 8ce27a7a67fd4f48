"""``applier migrate VERB ...`` (docs/reference.md, "Migration commands": the verbs and options are a fixed interface).

:mod:`applier.cli` hands everything after ``migrate`` to :func:`main`. Exit status: 0 success, 1 a blocker, a
refused or failed command (the message says why), 2 a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Sequence

import psycopg

from applier.argtypes import positive_float, positive_int
from applier.conninfo import connection_failure, describe, failure_reason, scrub, target_conninfo
from applier.errors import ApplierError
from applier.signals import Interrupted, interrupt_once

__all__ = ["build_parser", "main"]

_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")
#: psycopg's words for a connection that could not be made (3.1: "connection is bad", 3.2: "connection failed")
_CONNECT_FAILED = re.compile(r"^\s*connection (?:is bad|failed):")
_TARGET_HELP = "target database (libpq conninfo or URI); default: the PG* environment, as for psql"


def _selection(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--source", required=True, metavar="CONNINFO", help="the database to move (libpq conninfo/URI)"
    )
    p.add_argument("--schema", action="append", metavar="S", help="only this schema (repeat; wildcards * ?)")
    p.add_argument(
        "--table", action="append", metavar="PAT", help="only tables matching [schema.]table (repeat)"
    )
    p.add_argument(
        "--exclude-table", action="append", metavar="PAT", help="leave out tables matching PAT (repeat)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="applier migrate", description="Move a live database to another server."
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser(
        "plan", help="dry run: what would move, how long, and what blocks it (changes nothing)"
    )
    _selection(p)
    p.add_argument("--target", metavar="CONNINFO", help=_TARGET_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")

    p = sub.add_parser("start", help="schema, copy, indexes, then follow the source until a cutover")
    p.add_argument("name", metavar="NAME", help="migration name (also its subscription's)")
    _selection(p)
    p.add_argument("--target", metavar="CONNINFO", help=_TARGET_HELP)
    p.add_argument(
        "--table-jobs", type=positive_int, default=2, metavar="N", help="tables copied at once (default 2)"
    )
    p.add_argument(
        "--index-jobs", type=positive_int, default=2, metavar="N", help="indexes built at once (default 2)"
    )
    p.add_argument("--cutover", action="store_true", help="cut over by itself once caught up, then exit")
    p.add_argument(
        "--no-ddl",
        action="store_true",
        help="do not capture schema changes on the source (replayed by default)",
    )

    p = sub.add_parser("status", help="phase, tables, lag")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--target", metavar="CONNINFO", help=_TARGET_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")

    p = sub.add_parser("cutover", help="fence the source, catch up, set sequences, verify, switch")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--target", metavar="CONNINFO", help=_TARGET_HELP)
    p.add_argument(
        "--timeout", type=positive_float, default=60.0, metavar="SECONDS", help="give up after (default 60)"
    )
    p.add_argument(
        "--verify", choices=("counts", "full", "none"), default="counts", help="check after (counts)"
    )
    p.add_argument("--prepared", choices=("wait", "carry"), default="wait", help="open prepared xacts (wait)")
    p.add_argument("--reverse", action="store_true", help="leave the old server following the new one")

    p = sub.add_parser("abort", help="stop, unfence the source, drop what the migration created there")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--target", metavar="CONNINFO", help=_TARGET_HELP)
    return parser


def _plan(args: argparse.Namespace, target: str) -> int:
    from applier.migrate import plan as planning
    from applier.migrate import survey
    from applier.migrate.selection import Selection
    from applier.migrate.tools import find_dump_tools

    selection = Selection.of(args.schema, args.table, args.exclude_table)
    try:
        source = survey.gather_source(args.source, selection)
    except psycopg.OperationalError as exc:
        raise ApplierError(f"cannot connect to the source ({describe(args.source)}): {exc}") from None
    try:
        tgt = survey.gather_target(target, source.tables, source.schemas)
    except psycopg.OperationalError as exc:
        raise ApplierError(f"cannot connect to the target ({describe(target)}): {exc}") from None
    tools, found = find_dump_tools(source.major)
    result = planning.assess(source, tgt, selection, tools, found)
    print(json.dumps(result.to_json(), indent=2) if args.json else planning.format_plan(result), flush=True)
    return 0 if result.ok else 1


def _say(line: str) -> None:
    print(line, flush=True)


def _start(args: argparse.Namespace, target: str) -> int:
    from applier.migrate.selection import Selection
    from applier.migrate.start import StartOptions, start

    if not _SLOT_NAME.match(args.name):
        raise ApplierError(
            f'migration name "{args.name}" is not valid: it names the slot and publication too, so it must be 1-63 '
            "lower case letters, digits and underscores"
        )
    opts = StartOptions(
        name=args.name,
        source=args.source,
        target=target,
        selection=Selection.of(args.schema, args.table, args.exclude_table),
        table_jobs=args.table_jobs,
        index_jobs=args.index_jobs,
        cutover=args.cutover,
        ddl=not args.no_ddl,
    )
    return start(opts, _say)


def main(argv: Sequence[str], default_target: str | None = None) -> int:
    """Parse and run one verb; ``default_target`` is a ``--target`` given before ``migrate``.

    Exit status (docs/reference.md, "Exit codes"): 0 done, 1 refused or failed (the message says why and what to
    do), 2 usage; ``cutover`` and ``abort`` stopped by SIGINT, SIGTERM or SIGHUP clean up first (the cutover
    unfences, :mod:`applier.migrate.ownership`) and exit 128 + the signal's number; ``start`` stopped by one exits 0
    (it resumes where it stopped), as ``applier run`` does."""
    args = build_parser().parse_args(list(argv))
    target = target_conninfo(args.target or default_target)
    secrets = [c for c in (target, getattr(args, "source", None)) if c]
    try:
        with interrupt_once() if args.verb in ("cutover", "abort") else contextlib.nullcontext():
            return _verb(args, target)
    except Interrupted as exc:
        done = "it backed out: the source is not fenced by it" if args.verb == "cutover" else "run it again"
        print(
            f"ERROR: {args.verb} interrupted by {exc.name}; {done}; see applier migrate status",
            file=sys.stderr,
        )
        return exc.exit_status
    except ApplierError as exc:
        print(f"ERROR: {scrub(str(exc), *secrets)}", file=sys.stderr)
        return 1
    except psycopg.OperationalError as exc:
        print(
            f"ERROR: {_connection_error(exc, target, getattr(args, 'source', None), secrets)}",
            file=sys.stderr,
        )
        return 1
    except psycopg.Error as exc:
        print(f"ERROR: {scrub(str(exc).strip(), *secrets)}", file=sys.stderr)
        return 1


def _connection_error(
    exc: psycopg.OperationalError, target: str, source: str | None, secrets: list[str]
) -> str:
    """A connection that failed, said as ``create`` says it: which server (the target when it cannot be reached
    now, else the source: a migration's verbs talk to those two only), libpq's reason on one line, and what to do.
    Any other operational error (a session lost mid-way) as the server said it."""
    text = str(exc).strip()
    if not _CONNECT_FAILED.match(text):
        return scrub(text, *secrets)
    try:
        psycopg.connect(target, connect_timeout=5).close()
        side, conninfo = "source", source or ""
    except psycopg.Error:
        side, conninfo = "target", target
    message, _ = (
        connection_failure(side, conninfo, exc) if conninfo else (f"cannot connect to the {side}", False)
    )
    if not conninfo:
        message += f": {failure_reason(exc, *secrets)}"
    return (
        f"{scrub(message, *secrets)}\nHINT: check that the server runs and accepts the connection string; a "
        "password goes in ~/.pgpass (the migration never records one)"
    )


def _verb(args: argparse.Namespace, target: str) -> int:
    if args.verb == "plan":
        return _plan(args, target)
    if args.verb == "start":
        return _start(args, target)
    if args.verb == "status":
        from applier.migrate import status

        doc = status.status(target, args.name)
        print(status.dumps(doc) if args.json else status.format_status(doc), flush=True)
        return 0
    if args.verb == "cutover":
        from applier.migrate import cutover as co

        opts = co.CutoverOptions(args.name, target, args.timeout, args.verify, args.prepared, args.reverse)
        return co.cutover(opts, _say)
    from applier.migrate.abort import abort

    return abort(target, args.name, _say)
