"""The CLI's entry point (``python -m ckptconv``, the ``ckptconv`` command) sets what must be set before NumPy loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Runs the entry as the console script does (``ckptconv.__main__:main``) with ``--version``, which loads the CLI and
# NumPy and exits, then says what the process holds: the OpenBLAS setting and how many threads it runs.
ENTRY_THEN_REPORT = """
import os, sys
import ckptconv.__main__ as entry
loaded_before = "numpy" in sys.modules
sys.argv = ["ckptconv", "--version"]
try:
    entry.main()
except SystemExit:
    pass
assert "numpy" in sys.modules, "the CLI did not load NumPy: this test no longer sees OpenBLAS start"
print(loaded_before, os.environ.get("OPENBLAS_NUM_THREADS"), len(os.listdir("/proc/self/task")))
"""


def _entry(blas_threads: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = blas_threads
    done = subprocess.run([sys.executable, "-c", ENTRY_THEN_REPORT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-3:]


def test_openblas_keeps_to_one_thread_unless_told():
    """OpenBLAS's own threads (one per core, each spinning about 0.1 s when NumPy loads) are not started: the
    entry sets one thread before anything imports NumPy, and the process runs no thread but its own."""
    loaded_before, setting, threads = _entry(None)
    assert loaded_before == "False", "importing the entry module loaded NumPy before main() could set OpenBLAS"
    assert setting == "1"
    assert threads == "1", f"{threads} threads after the CLI loaded NumPy: OpenBLAS started its own"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenBLAS starts no thread of its own either way")
def test_a_users_openblas_setting_is_kept():
    _, setting, threads = _entry("2")
    assert setting == "2"
    assert int(threads) >= 2, "OPENBLAS_NUM_THREADS=2 set by the user, yet OpenBLAS started no thread"
