"""The command line is a fixed interface (docs/reference.md, "Command line" and "Migration commands"): every
command's ``--help`` and every option's parser settings (flags, destination, default, choices, type, whether
required) are compared with a recorded copy, ``golden/cli_help.txt``, so that reshaping the parser code (one function per subcommand,
issue 18's limits) cannot change what users and scripts see without the test saying so.

The recording was made from the parser as it was before that reshaping. A deliberate change of the interface
regenerates it: ``PYTHONPATH=$PWD python tests/unit/test_cli_help.py > tests/unit/golden/cli_help.txt``, and the
diff goes in the same commit as the change (and docs/reference.md, if the interface moves)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

GOLDEN = Path(__file__).with_name("golden") / "cli_help.txt"
#: argparse wraps help to the terminal's width (it reads COLUMNS): fixed so that the output does not depend on it
COLUMNS = "120"
#: every command line whose ``--help`` users can ask for, the top level first
COMMANDS: list[tuple[str, ...]] = [
    (),
    ("create",),
    ("run",),
    ("status",),
    ("alter",),
    ("drop",),
    ("verify",),
    ("migrate",),
    ("migrate", "plan"),
    ("migrate", "start"),
    ("migrate", "status"),
    ("migrate", "cutover"),
    ("migrate", "abort"),
    ("demo",),
    ("demo", "migrate"),
]


def _help(words: tuple[str, ...]) -> str:
    from applier.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*words, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, f"applier {' '.join(words)} --help exited {exc.code}"
        else:
            raise AssertionError(f"applier {' '.join(words)} --help did not exit")
    return out.getvalue()


def _actions(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    """One line per option or argument, with what the help text may not show (the default, the type, ...), and
    the same for each subparser, recursively."""
    lines = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                lines += _actions(subparser, f"{prefix} {name}")
            continue
        kind = type(action).__name__
        type_name = getattr(action.type, "__name__", repr(action.type))
        lines.append(
            f"{prefix}: {action.option_strings or action.dest} {kind} dest={action.dest} default={action.default!r}"
            f" choices={action.choices!r} type={type_name} required={action.required} nargs={action.nargs!r}"
            f" metavar={action.metavar!r} const={action.const!r}"
        )
    for group in parser._mutually_exclusive_groups:
        names = [a.option_strings[0] for a in group._group_actions]
        lines.append(f"{prefix}: mutually exclusive (required={group.required}) {names}")
    return lines


def dump() -> str:
    """Every ``--help`` text, then the settings of every parser's actions."""
    from applier import cli
    from applier.demo import build_parser as demo_parser
    from applier.demo.migrate import build_parser as demo_migrate_parser
    from applier.migrate.cli import build_parser as migrate_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        parts = [f"### applier {' '.join(words)} --help\n{_help(words)}" for words in COMMANDS]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    parts.append("### parser settings")
    parts += _actions(cli.build_parser(), "applier")
    parts += _actions(migrate_parser(), "applier migrate")
    parts += _actions(demo_parser(), "applier demo")
    parts += _actions(demo_migrate_parser(), "applier demo migrate")
    return "\n".join(parts) + "\n"


def test_every_help_and_option_is_as_recorded() -> None:
    assert dump() == GOLDEN.read_text()


def test_the_dump_covers_every_command() -> None:
    text = GOLDEN.read_text()
    for words in COMMANDS:
        assert f"### applier {' '.join(words)} --help\nusage: applier" in text
    # a parser setting the help text does not show: the migrate cutover's --timeout is a float defaulting to 60
    assert "applier migrate cutover: ['--timeout'] _StoreAction dest=timeout default=60.0" in text


if __name__ == "__main__":
    sys.stdout.write(dump())
