"""The steps every benchmark shares: where things live, MaxText's venv, one step in a fresh process, the two tools'
commands (ckptconv's CLI, MaxText's converter on a tiny model), a tiny model by transformers' own class, the
leaf-by-leaf comparison, and the head of a results page.

Standard library only, and nothing runs at import: the drivers (the project's venv) and the steps they start in
MaxText's venv (``bench/maxtext_env.sh``: Python 3.12, maxtext 0.2.5, torch) both import it. A MaxText-side step is
a script of bench/ run by path (``MT_PYTHON bench/X.py ...``), each in ``log``'s directory (never the repository
root, which ``python -m`` would put first on ``sys.path``, ahead of a legacy ckptconv tree on ``PYTHONPATH``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORK = BENCH / "work"  # git-ignored: inputs, outputs, logs, raw results
DOCS = REPO / "docs" / "bench"  # the results pages
# MaxText 0.2.5's venv (bench/maxtext_env.sh makes it), or the one MAXTEXT_PYTHON names
MT_PYTHON = Path(os.environ.get("MAXTEXT_PYTHON", BENCH / ".maxtext-venv" / "bin" / "python"))
# Offline and hermetic: no hub, no GCE metadata server probes (dead loopback port), no telemetry.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
    "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
    "GCE_METADATA_ROOT": "127.0.0.1:9", "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "1",
}
# What a MaxText-side step runs with: JAX on the CPU, transformers and the hub offline.
MT_ENV = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


# --- one step in a fresh process -------------------------------------------------------------------------------------

def run(cmd: list, log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` in ``log``'s directory, its output kept in ``log``; ``env`` is added to this process's environment."""
    log.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, **(env or {})},
                            cwd=log.parent)
    log.write_text(result.stdout + result.stderr)
    return result


def timed(cmd: list, log: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """:func:`run`, and its wall seconds measured from outside (start-up and imports included)."""
    start = time.monotonic()
    result = run(cmd, log, env)
    return result, round(time.monotonic() - start, 2)


def last_json(result: subprocess.CompletedProcess) -> dict:
    """The step's result: the last line of its output that is a JSON object ({} if none)."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def error_line(result: subprocess.CompletedProcess) -> str:
    """One line saying why the step failed: its last line naming an error, else its last line."""
    lines = [line for line in result.stderr.strip().splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "?")[:300]


# --- MaxText's venv --------------------------------------------------------------------------------------------------

def setup_maxtext() -> dict:
    """MaxText's venv (created once by bench/maxtext_env.sh, ~8 GB), its base.yml, versions, and the offline
    environment its converter runs in (an empty ``HF_HOME``: no cached token or model, nothing to fetch)."""
    subprocess.run(["bash", str(BENCH / "maxtext_env.sh")], check=True)
    mt_python = str(BENCH / ".maxtext-venv" / "bin" / "python")
    probe = subprocess.run([mt_python, "-c", "import json, os, maxtext; from importlib.metadata import version as v; "
                            "print(json.dumps({'base_yml': os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'), "
                            "'versions': {p: v(p) for p in ('maxtext', 'jax', 'jaxlib', 'orbax-checkpoint', 'tensorstore', "
                            "'torch', 'transformers', 'safetensors', 'numpy', 'matplotlib')}}))"],
                           capture_output=True, text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    hf_home = WORK / "hf-home"
    hf_home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **OFFLINE_ENV, "HF_HOME": str(hf_home), "JAX_PLATFORMS": "cpu"}
    return {"mt_python": mt_python, "base_yml": info["base_yml"], "mt_versions": info["versions"], "mt_env": env}


def require_maxtext(parser) -> None:
    """Stop with a clear message when MaxText's venv is not there (the drivers that do not create it)."""
    if not MT_PYTHON.exists():
        parser.error(f"no MaxText venv at {MT_PYTHON}: run bash bench/maxtext_env.sh or set MAXTEXT_PYTHON")


def mt_versions() -> tuple[str, str]:
    """(maxtext, transformers) versions of MaxText's venv, '?' where it cannot tell."""
    out = subprocess.run([str(MT_PYTHON), "-c", "import importlib.metadata as m; print(m.version('maxtext'), "
                          "m.version('transformers'))"], capture_output=True, text=True).stdout.split()
    return (out[0] if out else "?", out[1] if len(out) > 1 else "?")


def mt_step(script: str | Path, *args) -> list:
    """The command of a step run by path in MaxText's venv: ``bench/<script>`` (or a path) with ``args``."""
    return [MT_PYTHON, script if isinstance(script, Path) else BENCH / script, *args]


# --- the tools -------------------------------------------------------------------------------------------------------

def layout(scan: bool, devices: int | str, dtype: str) -> list[str]:
    """ckptconv convert's layout flags."""
    return ["--dtype", dtype, "--devices", str(devices), "--scan-layers" if scan else "--no-scan-layers"]


def ckptconv_cmd(src: Path, dst: Path) -> list[str]:
    """ckptconv on a full-size model as the speed benchmarks run it: 16 devices, progress events as JSON lines."""
    return [sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", "16", "--progress", "jsonl"]


def maxtext_cmd(mt_python: str, base_yml: str, model_name: str, src: Path, dst: Path, lazy: bool) -> list[str]:
    """MaxText 0.2.5's ``to_maxtext`` on a full-size model (its own table for ``model_name``), scanned, 16
    simulated devices, lazy or eager loading."""
    return [mt_python, "-m", "maxtext.checkpoint_conversion.to_maxtext", base_yml, f"model_name={model_name}",
            f"hf_model_path={src}", f"base_output_directory={dst}", "hardware=cpu",
            "skip_jax_distributed_system=True", "scan_layers=true", f"run_name=bench-{dst.name}",
            f"--lazy_load_tensors={str(lazy).lower()}", "--simulated_cpu_devices_count=16"]


def convert_cmd(src: Path, dst: Path, *flags) -> list:
    """``python -m ckptconv convert SRC DST FLAGS --progress none``, as a user runs it."""
    return [sys.executable, "-m", "ckptconv", "convert", src, dst, *flags, "--progress", "none"]


CONVERT_ENV = {"PYTHONPATH": str(REPO)}  # this repository's ckptconv first, whatever the step's directory


def convert(src: Path, dst: Path, log: Path, *flags, env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`convert_cmd` in a fresh process (``env`` may name another tree, e.g. an earlier revision's)."""
    return run(convert_cmd(src, dst, *flags), log, env={**CONVERT_ENV, **(env or {})})


def hf_tiny(config: Path, out: Path, log: Path, *flags, env: dict | None = None) -> subprocess.CompletedProcess:
    """A tiny random model by transformers' own class from ``config`` (bench/hf_tiny.py, MaxText's venv)."""
    return run(mt_step("hf_tiny.py", config, out, *flags), log, env={**MT_ENV, **(env or {})})


def maxtext_convert_cmd(model_name: str, hf: Path, out: Path, overrides: list[str], flags: list[str]) -> list:
    """MaxText 0.2.5's own ``to_maxtext`` on a tiny checkpoint (bench/maxtext_convert_tiny.py: the checkpoint's
    config in its ``model_name`` table, sizes as ``overrides``; ``flags`` are to_maxtext's own)."""
    return mt_step("maxtext_convert_tiny.py", model_name, hf, out, *overrides, "--", *flags)


def maxtext_convert(model_name: str, hf: Path, out: Path, overrides: list[str], flags: list[str], log: Path,
                    env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`maxtext_convert_cmd` in a fresh process of MaxText's venv."""
    return run(maxtext_convert_cmd(model_name, hf, out, overrides, flags), log, env={**MT_ENV, **(env or {})})


def dequantize(kind: str, src: Path, out: Path, log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """MaxText's own dequantiser (``fp8`` or ``mxfp4``), the first step of its route for a quantised release."""
    return run(mt_step("maxtext_dequantize.py", kind, src, out), log, env={**MT_ENV, **(env or {})})


def compare_outputs(ours: Path, theirs: Path, out_json: Path, log: Path, *flags,
                    env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Both checkpoints leaf by leaf, bit for bit (bench/compare_outputs.py, Orbax's public API in MaxText's venv):
    the step and its JSON result ({} if it wrote none)."""
    out_json.unlink(missing_ok=True)  # an earlier run's result is not this one's
    done = run(mt_step("compare_outputs.py", ours, theirs, *flags, "--json", out_json), log,
               env={**MT_ENV, **(env or {})})
    return done, (json.loads(out_json.read_text()) if out_json.exists() else {})


# --- cases and pages -------------------------------------------------------------------------------------------------

def chosen(cases: list, only: str | None, *keys: str) -> list:
    """The cases ``--only`` names (comma-separated; by ``name`` or any other attribute in ``keys``), all if none."""
    if not only:
        return list(cases)
    wanted = set(only.split(","))
    return [c for c in cases if c.name in wanted or any(getattr(c, k) in wanted for k in keys)]


def kept_rows(path: Path, names: set[str]) -> dict[str, str]:
    """The table lines of an earlier page whose first cell is one of ``names`` (``--merge`` keeps them)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return {line.split("|")[1].strip(): line for line in lines
            if line.startswith("| ") and line.split("|")[1].strip() in names}


def written_by(command: str, note: str = "") -> str:
    """The line under a page's title naming the command that wrote it and when: ``python -m bench COMMAND``."""
    return f"Written by `python -m bench {command}` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC{note}."


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines (``|`` inside a cell written as ``/``)."""
    def line(cells: list) -> str:
        return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header)] + [line(r) for r in rows]


def run_cases(cases: list, only: str | None, run_case, results: Path, kept: list[dict] = ()) -> list[dict]:
    """Every case ``--only`` names through ``run_case`` (each row printed as it comes), beside ``kept``: rows of an
    earlier run for the cases not run again (``--merge``); in the cases' order, all written to ``results``."""
    rows = []
    for case in chosen(cases, only):
        row = run_case(case)
        print(json.dumps(row), flush=True)
        rows.append(row)
    names = [case.name for case in cases]
    ran = {row["case"] for row in rows}
    rows = sorted([r for r in kept if r["case"] not in ran and r["case"] in names] + rows,
                  key=lambda r: names.index(r["case"]))
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(rows, indent=2))
    return rows
