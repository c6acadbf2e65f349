"""What the two README commands install, and what a worker image build sends as its context.

``make demo`` must stay small (no torch, transformers or test tools: they are most of a full venv's
2 GB and minutes), ``make test`` must end with everything the tests import, whichever of the two ran
first, and neither may reinstall what the other already did. The Makefile is run for real with a
stand-in interpreter in a scratch venv that records what it is asked to do, so nothing is installed.
The build context is computed with docker's own ``.dockerignore`` matcher (the docker SDK).
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TEST_ONLY = {"torch", "transformers", "pytest", "safetensors"}  # whatever the "test" extra pins, and these by name


def _name(pin: str) -> str:
    return re.split(r"[\[=<>~!; ]", pin, maxsplit=1)[0].lower().replace("_", "-")


def _make(target: str, venv: Path, *flags: str) -> str:
    done = subprocess.run(["make", "-C", str(ROOT), *flags, target, f"VENV={venv}", "PYTHON=false", "WORKERS=1",
                           f"RESULTS={venv / 'results.xml'}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _installed_extras(commands: str) -> list[set[str]]:
    """The extras of every ``pip install -e '.[...]'`` in ``commands``; other pip installs fail the test."""
    extras = []
    for line in commands.splitlines():
        if " pip install " in line and "--upgrade pip" not in line:
            found = re.search(r"-e '?\.\[([a-z,]+)\]'?\s*$", line)
            assert found, f"an install the test cannot account for: {line}"
            extras.append(set(found.group(1).split(",")))
    return extras


def test_make_demo_installs_only_the_library_and_prefect(tmp_path):
    extras = _installed_extras(_make("demo", tmp_path / "venv", "-n"))
    assert extras, "make demo on a fresh machine must install the project"
    packages = {_name(pin) for pin in PROJECT["dependencies"]}
    for chosen in extras:
        for extra in chosen:
            packages |= {_name(pin) for pin in PROJECT["optional-dependencies"][extra]}
    test_only = ({_name(pin) for pin in PROJECT["optional-dependencies"]["test"]} | TEST_ONLY) - \
        {_name(pin) for pin in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["prefect"]}
    assert not packages & test_only, sorted(packages & test_only)


@pytest.fixture
def venv(tmp_path) -> Path:
    """A scratch venv whose python only appends its arguments to ``calls`` (one line per call)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {venv / "calls"}\n')
    python.chmod(0o755)
    return venv


def _calls(venv: Path) -> list[str]:
    calls = venv / "calls"
    lines = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return [line for line in lines if "--upgrade pip" not in line]


def test_demo_then_test_adds_the_test_extra_and_then_installs_nothing(venv):
    _make("demo", venv)
    assert _calls(venv) == ["-m pip install -q --disable-pip-version-check -e .[prefect]", "-m flows.demo"]
    _make("test", venv)
    first, *rest = _calls(venv)
    # the test set is not compiled at install (the suite compiles what it imports); the demo's is
    assert first == "-m pip install -q --disable-pip-version-check --no-compile -e .[prefect,test]"
    assert [call.split()[:2] for call in rest] == [["-m", "pytest"]] * 2  # the suite, then the memory tests alone
    _make("demo", venv)
    _make("test", venv)
    assert [call.split()[1] for call in _calls(venv)] == ["flows.demo", "pytest", "pytest"]


def test_test_then_demo_installs_nothing_more(venv):
    _make("test", venv)
    assert "-e .[prefect,test]" in _calls(venv)[0]
    _make("demo", venv)
    assert _calls(venv) == ["-m flows.demo"]


def test_stamps_of_another_pyproject_are_not_trusted(venv):
    """The stamps carry pyproject.toml's checksum: after an edit the pins are installed again, and the
    old stamps (this Makefile's, or the single one of the Makefile before it) are dropped."""
    pins = subprocess.run("cksum < pyproject.toml", shell=True, cwd=ROOT, capture_output=True, text=True).stdout.split()[0]
    for stale in (".installed-demo-1", ".installed-test-1", f".installed-{pins}"):
        (venv / stale).touch()
    _make("demo", venv)
    assert _calls(venv)[0].endswith("-e .[prefect]")
    assert [p.name.split("-")[1] for p in venv.glob(".installed-*")] == ["demo"]


def test_make_test_keeps_the_failing_tests_names():
    """``-ra`` lists every failure at the end, and a JUnit file keeps the names however long the output."""
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-ra" in addopts.split()
    commands = subprocess.run(["make", "-C", str(ROOT), "-n", "test", "VENV=/nonexistent", "WORKERS=1"],
                              capture_output=True, text=True, timeout=60).stdout
    assert any("-m pytest" in line and "--junitxml=test-results.xml" in line for line in commands.splitlines())
    assert "test-results.xml" in (ROOT / ".ci" / "run").read_text()
    # the peak-RSS tests run alone after the rest, with a JUnit file of their own that .ci/run reads too
    assert any("-m memory" in line and "--junitxml=test-results-memory.xml" in line for line in commands.splitlines())
    assert "test-results-memory.xml" in (ROOT / ".ci" / "run").read_text()


# --- the worker images' build context -------------------------------------------------------------------

JUNK = [".venv/bin/python", ".git/HEAD", "demo-out/maxtext/ckptconv-report.json", ".prefect/prefect.db",
        "bench/.maxtext-venv/bin/python", "bench/work/qwen3/model.safetensors", ".pytest_cache/v/cache/lastfailed",
        "ckptconv/__pycache__/cli.cpython-311.pyc", "tasks/__pycache__/job.cpython-311.pyc", "flows/demo.pyc",
        "ckptconv.egg-info/PKG-INFO", "test-results.xml", "tests/test_convert.py", "out/x", "build/lib/x.py"]


def _copied_sources() -> set[str]:
    """Every path the Dockerfiles COPY from the context (files, or directories taken whole)."""
    sources = set()
    for dockerfile in (ROOT / "docker").glob("Dockerfile.*"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                sources |= set(line.split()[1:-1])
    return sources


def _context(root: Path) -> set[str]:
    from docker.utils.build import exclude_paths

    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    return exclude_paths(str(root), [line for line in lines if line and not line.startswith("#")],
                         dockerfile="docker/Dockerfile.cpu")


def test_the_build_context_holds_what_the_images_copy_and_nothing_else(tmp_path):
    needed = set()
    for source in _copied_sources():
        path = ROOT / source
        assert path.exists(), source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        needed |= {str(p.relative_to(ROOT)) for p in files}
    for relative in [*needed, *JUNK]:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("x")
    sent = {path for path in _context(tmp_path) if (tmp_path / path).is_file()}
    assert needed - sent == set(), "the images COPY these, .dockerignore leaves them out"
    assert sent & set(JUNK) == set()
    assert sent - needed <= {"docker/Dockerfile.cpu", ".dockerignore"}  # what docker always sends
