"""The benchmarks' one entry point: every registered name imports and answers ``--help`` in-process, without
MaxText's venv (the benchmarks that need it only check for it once they run), and ``--list`` names them all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import __main__ as entry

ROOT = Path(__file__).resolve().parents[1]
# modules other issues' helpers are still writing (issue 38, issue 39): checked once they exist
PENDING = {name for name, b in entry.BENCHMARKS.items() if not (ROOT / "bench" / f"{b.module}.py").exists()}


@pytest.mark.parametrize("name", sorted(entry.BENCHMARKS))
def test_every_benchmark_imports_and_answers_help(name, capsys, monkeypatch):
    if name in PENDING:
        pytest.skip(f"bench/{entry.BENCHMARKS[name].module}.py is not there yet")
    monkeypatch.setattr(sys, "argv", ["python -m bench"])
    with pytest.raises(SystemExit) as stopped:
        entry.main([name, "--help"])
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: "), out[:200]
    # a preset's fixed arguments are not asked for again
    assert "the following arguments are required" not in out


def test_list_names_every_benchmark_and_its_page():
    listed = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0, listed.stderr
    for name, b in entry.BENCHMARKS.items():
        assert f"  {name} " in listed.stdout
        if b.page != "-":
            assert f"docs/bench/{b.page}" in listed.stdout
            assert (ROOT / "docs" / "bench" / b.page).exists(), b.page


def test_an_unknown_or_missing_benchmark_says_so(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="no benchmark 'nope'"):
        entry.main(["nope"])
    monkeypatch.setitem(entry.BENCHMARKS, "gone", entry.Benchmark("not_a_module_here", "-", "-"))
    with pytest.raises(SystemExit, match=r"bench/not_a_module_here\.py is not there"):
        entry.main(["gone"])


def test_underscored_names_run_the_same_benchmark(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m bench"])  # main names the benchmark in argv[0], for argparse
    with pytest.raises(SystemExit) as stopped:
        entry.main(["hybrid_memory", "--help"])
    assert stopped.value.code == 0
    assert "python -m bench hybrid-memory" in capsys.readouterr().out
