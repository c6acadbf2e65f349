"""Commands that only read and write files never open the host's accelerator; one that cannot be opened is
never called a damaged checkpoint.

No TPU is needed: ``tests/data/fake_accelerator`` is a real PJRT plugin (JAX discovers it on ``sys.path``, as it
discovers libtpu) whose backend, when JAX opens it, records the process and fails with libtpu's words for a chip
another program holds. Each command runs as a user runs it on a TPU host: a fresh process, ``JAX_PLATFORMS``
unset (or set for the training job), the plugin installed. Without the CLI's pin to the CPU, JAX opens every
backend it knows the moment Orbax asks for the process index: ``inspect`` and ``verify`` then failed with
"cannot read the checkpoint (damaged ...)" (the first test shows the plugin makes a plain JAX program fail so).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptconv.commands import synth
from tests.conftest import ROOT, run_cli

FAKE = ROOT / "tests" / "data" / "fake_accelerator"
LOG_ENV = "CKPTCONV_FAKE_ACCELERATOR_LOG"


def _env(log: Path, platforms: str | None = None) -> dict:
    """This environment as a TPU host's user has it: the plugin importable, JAX_PLATFORMS as given (unset: None)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env[LOG_ENV] = str(log)
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    return env


def _opened(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny model and its 4-device checkpoint, converted once for the module."""
    base = tmp_path_factory.mktemp("accelerator")
    synth.write_checkpoint(synth.SynthModel(), str(base / "src"))
    done = run_cli("convert", str(base / "src"), str(base / "dst"), "--devices", "4", "--progress", "none")
    assert done.returncode == 0, done.stderr
    return base


def test_the_fake_accelerator_fails_a_program_that_opens_it(tmp_path):
    """The test's instrument works: JAX left to choose opens the plugin, and fails as on a TPU host whose chip is held."""
    log = tmp_path / "opened"
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=_env(log), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert "Unable to initialize backend 'fakeaccelerator'" in done.stderr and "lockfile" in done.stderr
    assert len(_opened(log)) == 1


COMMANDS = {
    "plan": lambda b: ["plan", str(b / "src"), "--devices", "4", "--json"],
    "convert": lambda b: ["convert", str(b / "src"), str(b / "again"), "--devices", "2", "--progress", "none"],
    "inspect": lambda b: ["inspect", str(b / "dst"), "--json"],
    "inspect --deep": lambda b: ["inspect", str(b / "dst"), "--deep"],
    "verify SRC DST": lambda b: ["verify", str(b / "src"), str(b / "dst"), "--progress", "none"],
    "verify DST": lambda b: ["verify", str(b / "dst")],
    "export": lambda b: ["export", str(b / "dst"), str(b / "exported"), "--like", str(b / "src"), "--progress", "none"],
}


@pytest.mark.parametrize("platforms", [None, "fakeaccelerator"], ids=["JAX_PLATFORMS unset", "JAX_PLATFORMS set"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_file_commands_never_open_the_accelerator(converted, tmp_path, command, platforms):
    """Unset, JAX would open every backend it knows; set for the training job beside us, it names the accelerator.
    Either way the file commands run on the CPU, succeed while the accelerator is held, and never touch it."""
    log = tmp_path / "opened"
    args = COMMANDS[command](converted)
    if command in ("convert", "export"):
        args[2] = str(tmp_path / Path(args[2]).name)  # each case its own output
    done = subprocess.run([sys.executable, "-m", "ckptconv", *args], env=_env(log, platforms), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _opened(log) == [], f"{command} opened the accelerator"
    assert "damaged" not in done.stderr


LIBRARY_CALL = """
import sys
from ckptconv.commands.inspection import inspect_checkpoint
from ckptconv.read.stored import read_back
try:
    read_back(sys.argv[1], lambda: inspect_checkpoint(sys.argv[1]))
except Exception as err:
    print(type(err).__name__ + ": " + str(err))
"""


def test_a_library_caller_whose_accelerator_is_held_is_not_told_the_checkpoint_is_damaged(converted, tmp_path):
    """A program calling the library chooses its own devices (nothing pins them behind its back); when JAX cannot
    open them the error says so, and says nothing of the checkpoint."""
    log = tmp_path / "opened"
    done = subprocess.run([sys.executable, "-c", LIBRARY_CALL, str(converted / "dst")], env=_env(log),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.stdout.startswith("AcceleratorUnavailableError: the accelerator is held by another program"), \
        done.stdout + done.stderr
    assert "damaged" not in done.stdout
    assert len(_opened(log)) == 1


def test_restore_check_says_the_accelerator_is_held_in_one_line(converted, tmp_path):
    """The one command that opens the accelerator: held by another program, it says so in one line and exits 75
    (EX_TEMPFAIL: try again later), no traceback, no word of damage."""
    log = tmp_path / "opened"
    done = subprocess.run([sys.executable, "-m", "ckptconv", "restore-check", str(converted / "dst")], env=_env(log),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 75, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("ckptconv:")]
    assert len(lines) == 1 and lines[0].startswith("ckptconv: error: the accelerator is held by another program")
    assert "Traceback" not in done.stderr and "damaged" not in done.stderr
    assert len(_opened(log)) == 1
