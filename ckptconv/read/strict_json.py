"""JSON as strict as the safetensors reference (Rust ``serde_json``) parses it.

Python's ``json`` is more lenient than ``serde_json`` in ways that matter for untrusted
headers and configs: it accepts ``NaN``/``Infinity``, turns ``1e400`` into ``inf``, keeps
lone UTF-16 surrogates (``"\\ud800"``), nests until the interpreter's recursion limit, and
raises a bare ``ValueError`` on integers of more than 4300 digits. Each of these is a
file the reference refuses, or a value that later breaks arithmetic or strict JSON output
far from where it came in. :func:`loads` refuses all of them up front, with one line.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# serde_json's default recursion limit: 128 levels of arrays/objects are refused, 127 parse.
MAX_DEPTH = 127
_SURROGATE = re.compile("[\ud800-\udfff]")


class JsonError(ValueError):
    """The text is not strict JSON; the message is one line saying why."""


class Pairs(list):
    """A JSON object kept as its (key, value) pairs, in order, duplicates included.

    Returned by ``loads(..., pairs=True)`` for callers that must see duplicate keys (the
    reference refuses a duplicated struct field but lets a duplicated map key overwrite).
    """


def loads(text: str, *, pairs: bool = False) -> Any:
    """Parse ``text`` as strict JSON; objects are dicts (last key wins) or :class:`Pairs`.

    Raises :class:`JsonError` on anything ``serde_json`` refuses: syntax errors, ``NaN`` and
    ``Infinity``, numbers beyond float64 range, lone surrogates, nesting deeper than 127.
    """
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int,
                           object_pairs_hook=Pairs if pairs else None)
    except RecursionError:
        raise JsonError(f"nested deeper than {MAX_DEPTH} levels") from None
    except JsonError:
        raise
    except ValueError as err:  # json.JSONDecodeError is one: its message is one line with the position
        raise JsonError(str(err).splitlines()[0][:200]) from None
    _check_tree(value)
    return value


def _constant(name: str) -> Any:
    raise JsonError(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JsonError(f"number out of range: {text[:40]}")
    return value


def _int(text: str) -> int | float:
    if math.isinf(float(text)):  # before int(): Python refuses to parse more than 4300 digits
        raise JsonError(f"number out of range: {text[:40]}...")
    if text == "-0":  # serde_json reads -0 as the float -0.0, never as an integer
        return -0.0
    return int(text)


def _check_tree(root: Any) -> None:
    """Depth and surrogates, iteratively (a deep tree must not exhaust our own stack)."""
    stack = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise JsonError(f"lone surrogate in string {value[:40]!r}")
            continue
        if isinstance(value, dict):
            value = list(value.items())
        elif not isinstance(value, list):
            continue
        if depth > MAX_DEPTH:
            raise JsonError(f"nested deeper than {MAX_DEPTH} levels")
        for item in value:
            if isinstance(item, tuple):  # an object's (key, value); JSON arrays hold no tuples
                key, item = item
                stack.append((key, depth))
            stack.append((item, depth + 1))
