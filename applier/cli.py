"""The ``applier`` command line (docs/reference.md, "Command line": its names are a fixed interface).

Options follow CREATE / ALTER / DROP SUBSCRIPTION's names. The target comes from ``--target`` (accepted before or
after the subcommand) or, as for psql, from the ``PG*`` environment. This module only parses and prints; the work is
in :mod:`applier.subscriptions` and :mod:`applier.runner`.

Exit status: 0 success, 1 a refused or failed command (the message says what is wrong and what to do), 2 a usage
error (argparse's convention).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from applier import closed_pipe
from applier.conninfo import scrub, target_conninfo
from applier.errors import ApplierError

if TYPE_CHECKING:
    from typing import TypeAlias

    from _typeshed import SupportsWrite

    from applier.subscriptions import Console

    #: what ``add_subparsers`` returns, to which each subcommand's function adds its parser
    _Subcommands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["build_parser", "main"]

_TARGET_HELP = "target database (libpq conninfo or URI); default: the PG* environment, as for psql"


def _info(message: str) -> None:
    print(message, flush=True)


def _warn(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


class _Probe(Exception):
    """Ends the parse that only looks for unknown arguments: help, or an error, is the real parse's to print."""


class _VerbParser(argparse.ArgumentParser):
    """A subcommand's parser that names an unknown option before it complains of a missing one.

    argparse checks a subcommand's required options (alter's one action, create's --publisher) before it hands the
    unknown ones back, so ``applier alter s --bogus`` was told that an action is missing, not that ``--bogus``
    does not exist. ``migrate`` and ``demo`` parse their own options: ``forwards`` passes everything on to them."""

    def __init__(self, *args: Any, forwards: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = forwards
        self._probing = False

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on the namespace
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        if args is not None and not self.forwards:
            unknown = self._unknown(list(args))
            if unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_known_args(args, namespace)

    def _unknown(self, args: list[str]) -> list[str]:
        """The arguments this parser does not know, found by a parse that requires nothing (and prints nothing:
        its usage would show the required options as optional)."""
        required = [a for a in self._actions if a.required]
        required += [g for g in self._mutually_exclusive_groups if g.required]
        for item in required:
            item.required = False
        self._probing = True
        try:
            return super().parse_known_args(args, argparse.Namespace())[1]
        except _Probe:
            return []
        finally:
            self._probing = False
            for item in required:
                item.required = True

    def error(self, message: str) -> NoReturn:
        if self._probing:
            raise _Probe
        super().error(message)

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        if self._probing:
            raise _Probe
        super().print_help(file)


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), so that ``--version`` says what pip installed."""
    try:
        return importlib.metadata.version("applier")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each option's help is one line."""
    # --target is accepted before the subcommand (as docs/reference.md writes it) and after it (as people type it)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", metavar="CONNINFO", default=argparse.SUPPRESS, help=_TARGET_HELP)

    parser = argparse.ArgumentParser(
        prog="applier",
        description="A subscriber-side PostgreSQL logical-replication apply worker with two-phase commit.",
    )
    parser.add_argument("--target", metavar="CONNINFO", default=None, help=_TARGET_HELP)
    parser.add_argument("--version", action="version", version=f"applier {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_VerbParser)

    _add_create(sub, common)
    _add_run(sub, common)
    _add_status(sub, common)
    _add_alter(sub, common)
    _add_drop(sub, common)
    _add_verify(sub, common)
    # these parse their own options (applier demo --help, applier migrate --help)
    sub.add_parser(
        "migrate",
        add_help=False,
        forwards=True,
        help="move a live database to another server (plan, start, ...)",
    )
    sub.add_parser(
        "demo", add_help=False, forwards=True, help="the whole product on two embedded PostgreSQL 18 servers"
    )
    return parser


def _add_create(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    """``applier create``: CREATE SUBSCRIPTION's options."""
    p = sub.add_parser(
        "create", parents=[common], help="create a subscription (catalog rows, origin and slot)"
    )
    p.add_argument("name", metavar="NAME", help="subscription name (also the default slot name)")
    p.add_argument(
        "--publisher",
        required=True,
        metavar="CONNINFO",
        help="publisher connection string; a password in it is used now but never stored",
    )
    p.add_argument(
        "--publication",
        required=True,
        action="append",
        metavar="PUB",
        dest="publications",
        help="publication to subscribe to (repeat for several)",
    )
    _add_create_options(p)


def _add_create_options(p: argparse.ArgumentParser) -> None:
    """``applier create``'s WITH options, apart from where to connect: CREATE SUBSCRIPTION's names and defaults."""
    p.add_argument(
        "--two-phase",
        action="store_true",
        help="replicate prepared transactions at PREPARE (enabled once every table is ready)",
    )
    p.add_argument(
        "--streaming",
        choices=("off", "on", "parallel"),
        default="off",
        help="how large in-progress transactions are sent: off (at commit), on or parallel (streamed)",
    )
    p.add_argument(
        "--no-copy-data",
        dest="copy_data",
        action="store_false",
        help="do not copy existing rows: tables start ready (two-phase then starts enabled)",
    )
    p.add_argument("--binary", action="store_true", help="exchange column values in binary format")
    p.add_argument(
        "--origin",
        choices=("any", "none"),
        default="any",
        help="none: only changes made on the publisher itself, not ones it replicated from elsewhere",
    )
    p.add_argument(
        "--disable-on-error",
        action="store_true",
        help="disable the subscription when applying fails, instead of retrying",
    )
    p.add_argument("--slot-name", metavar="SLOT", help="replication slot on the publisher (default: NAME)")
    p.add_argument(
        "--no-create-slot",
        dest="create_slot",
        action="store_false",
        help="use an existing slot instead of creating one",
    )
    p.add_argument("--disabled", action="store_true", help="create the subscription disabled (run skips it)")
    _add_create_apply_options(p)


def _add_create_apply_options(p: argparse.ArgumentParser) -> None:
    """``applier create``'s options of what the apply does (trust, schema changes, conflicts) and of the slot's
    failover: the rest of CREATE SUBSCRIPTION's WITH options, and ours."""
    p.add_argument(
        "--run-as-owner",
        action="store_true",
        help="trust the target tables' owners: run their triggers, defaults and other code with the apply role's "
        "rights (by default such code is refused; docs/security.md)",
    )
    p.add_argument(
        "--ddl",
        action="store_true",
        help="replay schema changes (DDL) made on the publisher to the published tables, at their place in the "
        "stream; installs event triggers there, which takes a superuser (docs/security.md)",
    )
    p.add_argument(
        "--conflict-log",
        choices=("log", "table", "all"),
        default="log",
        help="where conflicts go: the log (PostgreSQL 18's lines), the table applier.conflict_log, or both",
    )
    p.add_argument(
        "--failover",
        action="store_true",
        help="make the slot a failover slot (publisher PostgreSQL 17+): a standby with sync_replication_slots "
        "keeps a copy, so the subscription goes on after the publisher fails over (docs/operations.md)",
    )


def _add_run(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    """``applier run``: which subscriptions, metrics, and the switches of the apply pipeline's speed features."""
    p = sub.add_parser(
        "run", parents=[common], help="run subscriptions until SIGTERM/Ctrl-C (initial copy, then streaming)"
    )
    p.add_argument(
        "names", nargs="*", metavar="NAME", help="subscriptions to run (default: every enabled one)"
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="wait for a subscription that another applier run holds, and take it over when that one ends "
        "(killed, its host or its target session gone, or stopped); docs/operations.md",
    )
    p.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on 127.0.0.1:PORT"
    )
    p.add_argument(
        "--wait-target",
        type=float,
        metavar="SECONDS",
        default=None,
        help="wait this long for a target that is down or starting up before failing (default 60; 0: fail at once)",
    )
    p.add_argument(
        "--no-group-commit",
        action="store_true",
        help="commit every remote transaction in a local transaction of its own, as PostgreSQL does (default: "
        "transactions that arrive back to back share one; same as APPLIER_GROUP_COMMIT=0)",
    )
    p.add_argument(
        "--no-bulk-apply",
        action="store_true",
        help="apply grouped transactions message by message (default: a batch of plain transactions is applied "
        "one statement per table and kind of change where that cannot be told apart; same as APPLIER_BULK_APPLY=0)",
    )
    p.add_argument(
        "--no-fold-prepares",
        action="store_true",
        help="prepare every prepared transaction on the target, as PostgreSQL does (default: one whose COMMIT or "
        "ROLLBACK PREPARED arrived with it is applied as a plain transaction, or not at all; same as "
        "APPLIER_FOLD_PREPARES=0)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="log lines for people (text, default) or one JSON object per line for machines (json)",
    )
    p.add_argument(
        "--max-retry-interval",
        metavar="SECONDS",
        default=None,
        help="the longest wait between attempts while the same remote transaction or table copy keeps failing "
        "(the wait doubles from 0.5 s up to this; default 5, like PostgreSQL's wal_retrieve_retry_interval; same "
        "as APPLIER_MAX_RETRY_INTERVAL)",
    )


def _add_status(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    """``applier status``."""
    p = sub.add_parser("status", parents=[common], help="show subscriptions: tables, positions, lag, errors")
    p.add_argument("name", nargs="?", metavar="NAME", help="only this subscription")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def _add_alter(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    """``applier alter``: one action at a time (a mutually exclusive group), as ALTER SUBSCRIPTION takes."""
    p = sub.add_parser(
        "alter", parents=[common], help="enable, disable, change options, skip a transaction, refresh"
    )
    p.add_argument("name", metavar="NAME", help="subscription name")
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--enable", action="store_true", help="enable the subscription (applier run runs it)")
    action.add_argument("--disable", action="store_true", help="disable it; a running worker stops")
    action.add_argument(
        "--skip-lsn", metavar="LSN", help="skip the remote transaction that finishes at LSN (NONE resets)"
    )
    action.add_argument(
        "--set",
        nargs="+",
        action="extend",
        metavar="OPTION=VALUE",
        dest="set_options",
        help="two_phase, streaming, binary, disable_on_error, origin, slot_name, gid_format, run_as_owner, "
        "failover, conflict_log or ddl",
    )
    action.add_argument(
        "--connection",
        metavar="CONNINFO",
        help="the publisher's new connection (checked first: publications and slot must be there)",
    )
    action.add_argument(
        "--reset-stats",
        action="store_true",
        help="zero the subscription's counters (status' stats) and set stats_reset, as "
        "pg_stat_reset_subscription_stats does",
    )
    action.add_argument(
        "--refresh-publication",
        action="store_true",
        help="add newly published tables and remove unpublished ones",
    )
    p.add_argument(
        "--no-copy-data",
        dest="copy_data",
        action="store_false",
        help="with --refresh-publication: new tables start ready, without copying their rows",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --set two_phase=off: roll back this subscription's prepared transactions",
    )


def _add_drop(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    """``applier drop``."""
    p = sub.add_parser(
        "drop",
        parents=[common],
        help="drop a subscription: its slot, origin and catalog rows",
        description="Drop the subscription's slot(s) on the publisher, then its origin and catalog rows on the "
        "target. Stop its applier run first. Unlike PostgreSQL's DROP SUBSCRIPTION, which leaves the "
        "subscription's prepared transactions behind on the target, drop refuses while any exist (they hold locks "
        "and nothing would ever finish them); --force rolls them back.",
    )
    p.add_argument("name", metavar="NAME", help="subscription name")
    p.add_argument(
        "--force",
        action="store_true",
        help="roll back its prepared transactions; if the publisher is unreachable, drop local state only",
    )


def _add_verify(sub: _Subcommands, common: argparse.ArgumentParser) -> None:
    """``applier verify``."""
    p = sub.add_parser(
        "verify",
        parents=[common],
        help="compare every table between publisher and target (row counts, key-range hashes, differing keys)",
        description="Compare every table of the subscription between publisher and target while replication "
        "keeps running: counts and hashes over primary-key ranges, narrowed down to the differing keys; a range "
        "that differs is read again once the target has applied past the publisher's read position. Exit status "
        "0 only when every table is equal.",
    )
    p.add_argument("name", metavar="NAME", help="subscription name")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument(
        "--publisher",
        metavar="CONNINFO",
        help="publisher connection string instead of the stored one (which never holds a password)",
    )
    p.add_argument("--ranges", type=int, default=16, metavar="N", help="key ranges per table (default 16)")
    p.add_argument(
        "--spark-rows",
        type=int,
        default=None,
        metavar="N",
        help="hash tables of at least N rows (estimated) as a Spark job (default 5000000; 0: all; SPARK_REMOTE: a cluster)",
    )
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the target to apply past the publisher's read position (default 30)",
    )


def _dispatch(args: argparse.Namespace, extra: list[str], parser: argparse.ArgumentParser) -> int:
    if args.command == "demo":
        from applier.demo import main as demo

        return demo(extra)
    if args.command == "migrate":
        from applier.migrate.cli import main as migrate

        return migrate(extra, default_target=args.target)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from applier import subscriptions as subs

    target = target_conninfo(args.target)
    console = subs.Console(_info, _warn)
    if args.command == "create":
        _create(args, target, console)
    elif args.command == "run":
        return _run(args, target)
    elif args.command == "status":
        entries = subs.status(target, args.name)
        print(json.dumps({"subscriptions": entries}, indent=2) if args.json else subs.format_status(entries))
    elif args.command == "alter":
        _alter(args, target, console, parser)
    elif args.command == "drop":
        subs.drop(target, args.name, force=args.force, console=console)
    elif args.command == "verify":
        return _verify(args, target)
    return 0


def _create(args: argparse.Namespace, target: str, console: Console) -> None:
    from applier import subscriptions as subs

    subs.create(
        target,
        subs.CreateOptions(
            name=args.name,
            publisher=args.publisher,
            publications=tuple(args.publications),
            two_phase=args.two_phase,
            streaming=args.streaming,
            copy_data=args.copy_data,
            binary=args.binary,
            origin=args.origin,
            disable_on_error=args.disable_on_error,
            slot_name=args.slot_name,
            create_slot=args.create_slot,
            enabled=not args.disabled,
            run_as_owner=args.run_as_owner,
            failover=args.failover,
            conflict_log=args.conflict_log,
            ddl=args.ddl,
        ),
        console,
    )


def _run(args: argparse.Namespace, target: str) -> int:
    """``applier run``: the switches go to the environment, which the worker processes inherit."""
    from applier import runner

    runner.configure_logging(target, log_format=args.log_format)
    wait = runner.WAIT_TARGET if args.wait_target is None else args.wait_target
    if args.no_group_commit:
        os.environ["APPLIER_GROUP_COMMIT"] = "0"  # the worker processes inherit it
    if args.no_bulk_apply:
        os.environ["APPLIER_BULK_APPLY"] = "0"
    if args.no_fold_prepares:
        os.environ["APPLIER_FOLD_PREPARES"] = "0"
    from applier.retry import MAX_RETRY_ENV, max_retry_interval_default, parse_max_retry_interval

    if args.max_retry_interval is not None:
        os.environ[MAX_RETRY_ENV] = str(parse_max_retry_interval(args.max_retry_interval))
    max_retry_interval_default()  # a bad value (option or environment) stops `run` at once
    # checked here, so that a bad value stops `run` at once rather than every worker's every connection
    from applier.replication import receive_buffer_setting

    receive_buffer_setting(os.environ.get("APPLIER_RECEIVE_BUFFER"))
    from applier.apply.target import SYNCHRONOUS_COMMIT_ENV, synchronous_commit_setting

    synchronous_commit_setting(os.environ.get(SYNCHRONOUS_COMMIT_ENV))
    return runner.run(
        target, args.names, metrics_port=args.metrics_port, wait_target=wait, standby=args.standby
    )


def _alter(args: argparse.Namespace, target: str, console: Console, parser: argparse.ArgumentParser) -> None:
    from applier import subscriptions as subs

    if not args.copy_data and not args.refresh_publication:
        parser.error("--no-copy-data only goes with --refresh-publication")
    if args.force and not args.set_options:
        parser.error("--force only goes with --set two_phase=off")
    if args.enable or args.disable:
        subs.set_enabled(target, args.name, args.enable, console)
    elif args.skip_lsn is not None:
        subs.set_skip_lsn(target, args.name, args.skip_lsn, console)
    elif args.set_options:
        subs.alter_options(target, args.name, args.set_options, force=args.force, console=console)
    elif args.connection is not None:
        subs.set_connection(target, args.name, args.connection, console)
    elif args.reset_stats:
        subs.reset_stats(target, args.name, console)
    else:
        subs.refresh_publication(target, args.name, copy_data=args.copy_data, console=console)


def _verify(args: argparse.Namespace, target: str) -> int:
    """``applier verify``: exit status 0 only when every table is equal."""
    from applier import verify

    report = verify.verify(
        target,
        args.name,
        publisher=args.publisher,
        ranges=args.ranges,
        settle_timeout=args.settle_timeout,
        spark_rows=verify.SPARK_ROWS if args.spark_rows is None else args.spark_rows,
    )
    print(report.to_json() if args.json else verify.format_report(report))
    return 0 if report.equal else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit status."""
    closed_pipe.install()  # first: a reader that goes away (| head) must not stop the command half way
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    secrets = [c for c in (args.target, getattr(args, "publisher", None)) if c]
    try:
        return _dispatch(args, extra, parser)
    except ApplierError as exc:
        message = scrub(str(exc), *secrets)
        logs = sys.modules.get("applier.logs")  # imported by the commands that log (run)
        if logs is not None and logs.logs_json():
            logging.getLogger("applier").error(message)  # stderr is a JSON log: the error is a record too
        else:
            print(f"ERROR: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
