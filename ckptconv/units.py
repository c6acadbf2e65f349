"""Sizes and durations as people read them (``1.3 GiB``, ``2 min 5 s``): one place for every report and artifact."""

from __future__ import annotations

from ckptconv.errors import BadInputError

BYTE_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
TIME_UNITS = (("h", 3600), ("min", 60))
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str, option: str, zero: bool = False) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes (HF's ``max_shard_size`` units); ``option`` names the
    flag in the error (``--shard-size``, ``--data-file-size``); ``zero``: 0 is a size too."""
    value = text.strip().upper().replace(" ", "")
    number = value.rstrip("KMGIB")
    unit = value[len(number):]
    try:
        size = int(float(number) * SIZE_UNITS[unit])
    except (KeyError, ValueError, OverflowError):  # OverflowError: inf, 1e400
        raise BadInputError(f"{option} {text!r}: expected a size like 5GB, 500MB or 2GiB") from None
    if size < 0 or (size == 0 and not zero):
        raise BadInputError(f"{option} {text!r} must be {'zero or more' if zero else 'positive'}")
    return size


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
