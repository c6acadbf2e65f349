"""Sizes and durations as people read them (``1.3 GiB``, ``2 min 5 s``): one place for every report and artifact."""

from __future__ import annotations

BYTE_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
TIME_UNITS = (("h", 3600), ("min", 60))


def human_bytes(nbytes: float | None) -> str:
    """``1536 -> '1.5 KiB'``; three significant figures at most; ``None`` -> ``'-'``."""
    if nbytes is None:
        return "-"
    for name, size in BYTE_UNITS:
        if abs(nbytes) >= size:
            value = nbytes / size
            return f"{value:.3g} {name}" if value < 1000 else f"{value:.0f} {name}"
    return f"{nbytes:.0f} B"


def human_seconds(seconds: float | None) -> str:
    """``0.42 -> '0.42 s'``, ``75 -> '1 min 15 s'``, ``7384 -> '2 h 3 min'``; ``None`` -> ``'-'``."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 1 else f"{seconds:.1f} s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    (big, big_size), (small, small_size) = (TIME_UNITS if seconds >= 3600 else (TIME_UNITS[1], ("s", 1)))
    whole, rest = divmod(seconds, big_size)
    return f"{whole} {big} {rest // small_size} {small}"
