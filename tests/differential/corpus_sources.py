"""Readers of the vendored corpus under ``tests/differential/corpus/`` (see ``docs/corpus.md``): they take SQL out of the
material exactly as it was published, so that a corpus case never carries a transcription of its source.

* :func:`tap_calls`: the ``$node->safe_psql('postgres', ...)`` calls of one of PostgreSQL's subscription TAP files,
  with Perl's quoting undone (``"..."``, ``qq(...)``, ``qq{...}``, ``q{...}``, concatenation with ``.`` and the
  ``my $ddl = qq(...)`` variables those files use), each with its node and line, so a case picks its statements
  by node and line range.
* :func:`regress_statements`: the top-level statements of a regression script (``src/test/regress/sql``) that
  create or fill the named tables (psql meta-commands and every other statement left out).
* :func:`psql_script`: a dump-like script (Chinook, Northwind) as text for ``psql -f -``, without the lines that
  create, drop or connect to a database (the corpus loads it into a database of its own).

This module holds no tests; it is data plumbing for ``tests/differential/test_corpus.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).parent / "corpus"


@dataclass(frozen=True)
class TapCall:
    """One ``safe_psql`` call: which node ran it, where it starts in the file, and its SQL."""

    node: str  # "publisher", "subscriber", "subscriber1", ...
    line: int
    sql: str


_CALL = re.compile(r"\$node_(\w+)->safe_psql\(\s*'postgres'\s*,\s*", re.S)
_VAR = re.compile(r"my \$(\w+)\s*=\s*", re.S)
_PAIRS = {"(": ")", "{": "}", "[": "]", "<": ">"}


def _unescape_interpolated(text: str) -> str:
    """What Perl makes of the backslashes in a double-quoted (``"..."``/``qq``) string of these files."""
    return re.sub(r"\\([\\$@\"])", r"\1", text)


def _balanced(text: str, start: int, opening: str) -> tuple[str, int]:
    """The body of a ``q``/``qq`` literal opened by ``opening`` at ``start`` (nesting counted), and the end."""
    closing, depth, i = _PAIRS[opening], 1, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == opening:
            depth += 1
        elif ch == closing:
            depth -= 1
            if depth == 0:
                return text[start:i], i + 1
        i += 1
    raise ValueError(f"unbalanced {opening} at offset {start}")


def _perl_string(text: str, pos: int, variables: dict[str, str]) -> tuple[str, int]:
    """One Perl string expression at ``pos`` (literals and variables joined by ``.``); its value and its end."""
    parts: list[str] = []
    while True:
        while text[pos].isspace():
            pos += 1
        if text.startswith("qq", pos) and text[pos + 2] in _PAIRS:
            body, pos = _balanced(text, pos + 3, text[pos + 2])
            parts.append(_unescape_interpolated(body))
        elif text[pos] == "q" and text[pos + 1] in _PAIRS:
            body, pos = _balanced(text, pos + 2, text[pos + 1])
            parts.append(body)
        elif text[pos] in "\"'":
            quote, end = text[pos], pos + 1
            while text[end] != quote:
                end += 2 if text[end] == "\\" else 1
            body = text[pos + 1 : end]
            parts.append(_unescape_interpolated(body) if quote == '"' else body)
            pos = end + 1
        elif text[pos] == "$":
            name = re.match(r"\$(\w+)", text[pos:])
            assert name, text[pos : pos + 40]
            parts.append(variables.get(name.group(1), f"${name.group(1)}"))
            pos += name.end()
        else:
            raise ValueError(
                f"not a string at line {text.count(chr(10), 0, pos) + 1}: {text[pos : pos + 40]!r}"
            )
        rest = re.match(r"\s*\.\s*", text[pos:])
        if not rest:
            return "".join(parts), pos
        pos += rest.end()


def tap_calls(relative: str) -> list[TapCall]:
    """Every ``safe_psql('postgres', ...)`` call of the TAP file ``tests/differential/corpus/<relative>``, in file order."""
    text = (CORPUS / relative).read_text()
    variables: dict[str, str] = {}
    for m in _VAR.finditer(text):
        if text.startswith(("qq", "q{", "q(", '"', "'"), m.end()):
            variables[m.group(1)], _ = _perl_string(text, m.end(), variables)
    calls = []
    for m in _CALL.finditer(text):
        sql, _ = _perl_string(text, m.end(), variables)
        calls.append(TapCall(m.group(1), text.count("\n", 0, m.start()) + 1, sql))
    return calls


def tap_sql(relative: str, node: str, first: int, last: int, *, skip: str | None = None) -> list[str]:
    """The SQL of ``node``'s calls that start on lines ``first``..``last`` of the TAP file (1-based, inclusive),
    without those matching the regular expression ``skip`` (e.g. the TAP file's own CREATE SUBSCRIPTION)."""
    return [
        c.sql
        for c in tap_calls(relative)
        if c.node == node and first <= c.line <= last and not (skip and re.search(skip, c.sql, re.I))
    ]


def _statements(text: str) -> list[str]:
    """Top-level statements of a psql script: split at ``;`` outside quotes, comments and dollar quoting; psql
    meta-command lines (``\\...``) dropped."""
    out, buf, i, n = [], [], 0, len(text)
    at_line_start = True
    while i < n:
        ch = text[i]
        if at_line_start and ch == "\\":
            i = text.find("\n", i)
            i = n if i < 0 else i + 1
            continue
        at_line_start = ch == "\n"
        if text.startswith("--", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if text.startswith("/*", i):
            i = text.index("*/", i) + 2
            continue
        if ch == "'":
            end = i + 1
            while True:
                end = text.index("'", end)
                if text.startswith("''", end):
                    end += 2
                    continue
                break
            buf.append(text[i : end + 1])
            i = end + 1
            continue
        dollar = re.match(r"\$(\w*)\$", text[i:])
        if dollar:
            end = text.index(dollar.group(0), i + dollar.end()) + dollar.end()
            buf.append(text[i:end])
            i = end
            continue
        if ch == ";":
            if "".join(buf).strip():
                out.append("".join(buf).strip())
            buf = []
        else:
            buf.append(ch)
        i += 1
    if "".join(buf).strip():
        out.append("".join(buf).strip())
    return out


def regress_statements(relative: str, tables: list[str]) -> list[str]:
    """The ``CREATE TABLE t``/``INSERT INTO t`` statements for ``tables`` (case-insensitive, exact names) of the
    regression script ``tests/differential/corpus/<relative>``, in file order, up to the script's ``DROP TABLE t`` (a script
    may later create another table of the same name)."""
    wanted = {t.lower() for t in tables}
    pattern = re.compile(r"^(CREATE\s+TABLE|INSERT\s+INTO|DROP\s+TABLE)\s+(\w+)", re.I)
    picked = []
    for st in _statements((CORPUS / relative).read_text()):
        m = pattern.match(st)
        if not m or m.group(2).lower() not in wanted:
            continue
        if m.group(1).upper().startswith("DROP"):
            wanted.discard(m.group(2).lower())  # later statements of that name belong to another table
            continue
        picked.append(st)
    return picked


_DATABASE_LINE = re.compile(r"^\s*(?:(?:DROP|CREATE)\s+DATABASE\b|\\c(?:onnect)?\b)", re.I)


def psql_script(relative: str) -> str:
    """``tests/differential/corpus/<relative>`` for ``psql``, less its lines that drop, create or connect to a database."""
    lines = (CORPUS / relative).read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not _DATABASE_LINE.match(line))


def read(relative: str) -> str:
    return (CORPUS / relative).read_text()
