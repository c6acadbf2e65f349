"""What the MaxText benchmarks' drivers share: run a step in a fresh process with its log, and read its result.

Standard library only: the drivers and their children (in MaxText's venv) both import it, by script
directory (``python bench/X.py`` puts ``bench/`` first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def run(cmd: list, log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` in ``log``'s directory (never the repository root, which ``python -m`` would put first on
    ``sys.path`` ahead of a legacy tree on PYTHONPATH); its output kept in ``log``."""
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, **(env or {})},
                            cwd=log.parent)
    log.write_text(result.stdout + result.stderr)
    return result


def last_json(result: subprocess.CompletedProcess) -> dict:
    """The step's result: the last line of its output that is a JSON object ({} if none)."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def error_line(result: subprocess.CompletedProcess) -> str:
    """One line saying why the step failed: its last line naming an error, else its last line."""
    lines = [line for line in result.stderr.strip().splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "?")[:300]
