"""Unit tests: the apply core driven with message values against a recording fake target. No server is started
here (no fixture of ``applier.testing.pytest_plugin`` is used), so ``pytest tests/unit`` runs in seconds without
PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.applier_kit import Core, make_core


@pytest.fixture
def core_factory(tmp_path: Path) -> Callable[..., Core]:
    """``core_factory(**options)``: a fresh :class:`Core` whose spool lives in the test's temporary directory."""

    def make(**options: Any) -> Core:
        return make_core(tmp_path / "spool", **options)

    return make
