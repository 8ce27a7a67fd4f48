"""Numbers as people read them in progress lines and reports. One formatter for sizes, so that ``migrate plan``,
the copy's progress and ``status`` print a size the same way (issue 27: there were three)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 kB``, ``3.0 GB``: powers of 1024, one decimal above bytes, up to TB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover
