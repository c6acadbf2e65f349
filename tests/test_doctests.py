"""The examples in the library's and the benchmarks' docstrings (``>>>``) are run: a docstring that shows a rule must
still follow it.

pytest collects only tests/ (pyproject's ``testpaths``), so without this the examples were never checked.
"""

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = sorted(".".join(path.relative_to(ROOT).with_suffix("").parts)
                 for folder in ("ckptconv", "bench") for path in (ROOT / folder).rglob("*.py")
                 if ">>>" in path.read_text())


def test_the_library_has_examples_to_run():
    assert "ckptconv.settings" in MODULES  # RunOptions.writes_after_stream: the writer and the estimate share it


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    results = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0 and results.failed == 0, results
