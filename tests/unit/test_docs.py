"""The documentation stays true to the code: pure checks over the repository's files, no server, well under a second.

- Every "behaviour N" / "behaviours N-M" / "behaviours N, M and K" that code, tests, benchmarks or docs cite has an
  entry in ``docs/behaviours.md`` (comments cite them to say which rule of PostgreSQL's apply worker a piece of
  code reproduces; a citation that resolves to nothing sends the reader nowhere).
- ``docs/behaviours.md`` numbers its entries once each, from 1 without gaps (the numbering is shared with the
  team's reference list, so an entry cannot be renumbered or dropped).
- Every relative link in ``README.md`` and ``docs/*.md`` points at a file that exists, and a ``#fragment`` into a
  Markdown file at one of its headings.
- The README stays the front door: at most 10 KB, and it holds the two set-up commands CI runs (``.ci/run``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def _repo_root() -> Path:
    """The directory holding pyproject.toml (so the test works wherever tests/ puts this file)."""
    here = Path(__file__).resolve().parent
    for directory in (here, *here.parents):
        if (directory / "pyproject.toml").is_file():
            return directory
    raise RuntimeError(f"no pyproject.toml above {here}")


ROOT = _repo_root()
BEHAVIOURS = ROOT / "docs" / "behaviours.md"
#: where citations are looked for (the README is checked too: it is the first page a reader follows)
CITING_DIRS = ("applier", "state", "tablesync", "tests", "bench", "docs")
#: written on other branches (issues 16, 19 and the migration work) and linked from the README ahead of their merge:
#: a link to one of these is accepted only while the file does not exist; once merged, it is checked like any other
PENDING_DOCS = frozenset(
    {"docs/failures.md", "docs/corpus.md", "docs/live-replication.md", "docs/migrate.md"}
)
README_MAX_BYTES = 10_000
#: the "Get started" block; CI (.ci/run) runs the second command, and the first is its smoke step
SETUP_COMMANDS = (
    "bash .ci/install && .venv/bin/applier demo          # the whole product on two local PostgreSQL 18 servers",
    "bash .ci/install && .venv/bin/python -m pytest      "
    "# the test suite (PostgreSQL 18; APPLIER_TEST_PG=15|16 for others)",
)

_NUMBER = r"\d+(?:\s*[-–]\s*\d+)?"
#: "behaviour 65", "behaviours 55-59", "behaviours 55–59", "behaviours 5-9, 53, 76", "behaviours 6 and 9"; a list
#: may continue on the next line of a comment ("# ")
_CITATION = re.compile(
    rf"\bbehaviou?rs?\s+({_NUMBER}(?:(?:\s*,\s*|\s+and\s+)(?:#\s*)?{_NUMBER})*)",
    re.IGNORECASE,
)
_ENTRY = re.compile(r"^### (\d+)\. \S", re.MULTILINE)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^()\s]+)\)|!\[[^\]]*\]\(([^()\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def cited_numbers(text: str) -> list[tuple[int, str]]:
    """Every behaviour number ``text`` cites, with the citation it came from (ranges expanded)."""
    found: list[tuple[int, str]] = []
    for match in _CITATION.finditer(text):
        for part in re.split(r"\s*,\s*(?:#\s*)?|\s+and\s+(?:#\s*)?", match.group(1)):
            ends = [int(n) for n in re.split(r"\s*[-–]\s*", part)]
            if ends[0] > ends[-1]:
                raise AssertionError(f"backwards range in {match.group(0)!r}")
            found.extend((n, match.group(0)) for n in range(ends[0], ends[-1] + 1))
    return found


def entry_numbers() -> list[int]:
    return [int(n) for n in _ENTRY.findall(BEHAVIOURS.read_text(encoding="utf-8"))]


def _citing_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for name in CITING_DIRS:
        files.extend(
            p for p in sorted((ROOT / name).rglob("*")) if p.suffix in (".py", ".md") and p.is_file()
        )
    return files


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_FENCE.sub("", markdown))}


def _markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# --- the citation parser itself ------------------------------------------------------------------------------------


def test_citation_parser_reads_every_form() -> None:
    word = "behaviour"  # (split so that this file cites nothing itself)
    assert [n for n, _ in cited_numbers(f"({word} 65)")] == [65]
    assert [n for n, _ in cited_numbers(f"{word}s 55-57, 75–76")] == [55, 56, 57, 75, 76]
    assert [n for n, _ in cited_numbers(f"{word}s 5-9, 53, 76, 115-116")] == [5, 6, 7, 8, 9, 53, 76, 115, 116]
    assert [n for n, _ in cited_numbers(f"{word}s 6 and 9")] == [6, 9]
    assert [n for n, _ in cited_numbers(f"{word}s 17,\n    # 41-42")] == [17, 41, 42]
    assert [n for n, _ in cited_numbers(f"{word} 80, ``fetch_remote_table_info``")] == [80]
    assert [n for n, _ in cited_numbers(f"{word} 75, the leader's rule")] == [75]
    assert cited_numbers(f"the {word} of the walsender") == []
    with pytest.raises(AssertionError, match="backwards"):
        cited_numbers(f"{word}s 9-5")


# --- behaviours ----------------------------------------------------------------------------------------------------


def test_behaviour_entries_are_numbered_once_without_gaps() -> None:
    numbers = entry_numbers()
    assert numbers, f"no '### N. Title' entries in {BEHAVIOURS}"
    assert numbers == list(range(1, len(numbers) + 1)), "entries out of order, repeated or missing"


def test_every_cited_behaviour_has_an_entry() -> None:
    entries = set(entry_numbers())
    unresolved: list[str] = []
    citations = 0
    for path in _citing_files():
        text = path.read_text(encoding="utf-8")
        for number, citation in cited_numbers(text):
            citations += 1
            if number not in entries:
                unresolved.append(f"{path.relative_to(ROOT)}: {citation!r} -> no entry {number}")
    assert citations > 100, "the scan found almost no citations: has the code moved?"
    assert not unresolved, "citations without an entry in docs/behaviours.md:\n" + "\n".join(unresolved)


# --- links ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", _markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    broken: list[str] = []
    for match in _LINK.finditer(_FENCE.sub("", text)):
        link = match.group(1) or match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", link, re.IGNORECASE):
            continue  # http:, https:, mailto:
        path_part, _, fragment = link.partition("#")
        target = (page.parent / path_part).resolve() if path_part else page
        relative = target.relative_to(ROOT).as_posix() if target.is_relative_to(ROOT) else str(target)
        if not target.exists():
            if relative in PENDING_DOCS:
                continue  # written on another branch; checked once it is merged
            broken.append(f"{link}: no file {relative}")
            continue
        if (
            fragment
            and target.suffix == ".md"
            and fragment not in _anchors(target.read_text(encoding="utf-8"))
        ):
            broken.append(f"{link}: no heading #{fragment} in {relative}")
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_pending_docs_are_the_ones_the_readme_links() -> None:
    """The exemption above covers exactly the README's links to documents of other branches, nothing else."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for doc in PENDING_DOCS:
        assert f"]({doc})" in readme, f"{doc} is exempted but the README does not link it"


# --- the README ----------------------------------------------------------------------------------------------------


def test_readme_is_the_short_front_door() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes; depth goes in docs/ (at most {README_MAX_BYTES})"
    )


def test_readme_holds_the_two_setup_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^## Get started$.*?^```sh\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert block, "no ```sh block under '## Get started'"
    assert block.group(1).splitlines() == list(SETUP_COMMANDS)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ".venv/bin/python -m pytest" in ci and ".venv/bin/applier demo" in ci, "CI no longer runs them"
