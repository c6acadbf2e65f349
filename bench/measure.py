"""One tool run measured from outside, as every speed and memory benchmark measures it: a fresh child process
reaped with ``os.wait4`` (peak RSS: the kernel's ``ru_maxrss``; CPU: its rusage), sampled every 50 ms from
``/proc/PID/status`` for the RSS-over-time plot and as a watchdog (SIGKILL past a timeout or an RSS cap); the
synthetic inputs those benchmarks share, made once; and the machine and code a run was measured on.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.steps import REPO, WORK, convert_cmd

GIB = 1024**3
GB = 10**9

SHAPES = {
    # name: (synth model attribute, MaxText model_name, safetensors shard size)
    "0.6b": ("QWEN3_0_6B", "qwen3-0.6b", None),
    "8b": ("LLAMA3_8B", "llama3.1-8b", 5 * GB),
}
INPUT_DIRS = {"0.6b": "qwen3-0.6b", "8b": "llama3-8b"}


# ---------------------------------------------------------------------------------------------
# Measuring one child process

@dataclass
class Run:
    """One measured child: kernel peak RSS, wall time, exit, load averages, stage marks."""

    name: str
    tool: str  # ckptconv | maxtext-lazy | maxtext-eager | cp
    shape: str
    index: int
    cmd: list[str]
    returncode: int = 0
    wall_seconds: float = 0.0
    peak_rss_bytes: int = 0
    sampled_peak_bytes: int = 0
    own_peak_bytes: int = 0  # the child's VmHWM as last read while it ran: its own, whatever the parent holds
    cpu_seconds: float = 0.0  # user + system of the child (ru_utime + ru_stime): the work, whatever the load
    killed: str | None = None  # "timeout" / "rss cap" when the harness killed it
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    report: dict | None = None  # ckptconv's own report (stage_seconds ...)
    code: str = ""  # ckptconv's code as this run imported it: git HEAD, plus a hash of uncommitted changes
    warmup: bool = False  # not counted: compiles .pyc files and warms the page cache for both tools alike
    log: str = ""
    last_lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None


def measure(run: Run, env: dict[str, str], *, timeout: float, rss_cap: int | None = None,
            marks: list[tuple[str, str]] | None = None, jsonl_marks: bool = False) -> tuple[Run, list]:
    """Start ``run.cmd``, sample VmRSS every 50 ms, stamp output lines, reap with wait4.

    Returns the run and its RSS samples [(t, bytes)]. The watchdog kills the child (SIGKILL to its
    process group) after ``timeout`` s or once its RSS passes ``rss_cap``.
    """
    log_path = WORK / "logs" / f"{run.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    run.log = str(log_path.relative_to(REPO))
    os.sync()  # dirty pages of the previous run are flushed before this one starts, not during it
    run.load_before = [round(x, 2) for x in os.getloadavg()]
    start = time.monotonic()
    proc = subprocess.Popen(run.cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    _oom_first(proc.pid)
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def kill(why: str) -> None:
        if run.killed is None:
            run.killed = why
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def sampler() -> None:
        while not done.is_set():
            rss = _vm_rss(proc.pid)
            run.own_peak_bytes = max(run.own_peak_bytes, _vm_rss(proc.pid, "VmHWM:") or 0)
            now = time.monotonic() - start
            if rss is not None:
                samples.append((round(now, 3), rss))
                if rss_cap and rss > rss_cap:
                    kill(f"rss cap ({rss_cap / GIB:.1f} GiB)")
            if now > timeout:
                kill(f"timeout ({timeout:.0f} s)")
            done.wait(0.05)

    def reader(log) -> None:
        for raw in proc.stdout:
            t = time.monotonic() - start
            line = raw.decode("utf-8", "replace").rstrip("\n")
            log.write(f"{t:9.3f} {line}\n")
            run.last_lines = (run.last_lines + [line])[-30:]
            if jsonl_marks and line.startswith("CKPTCONV "):
                event = json.loads(line[len("CKPTCONV "):])
                if event.get("event") in ("plan", "done"):
                    run.marks.append((round(t, 3), {"plan": "planned, writing", "done": "done"}[event["event"]]))
            for needle, label in marks or ():
                if needle in line:
                    run.marks.append((round(t, 3), label))
                    break

    with open(log_path, "w", buffering=1) as log:
        log.write("$ " + " ".join(run.cmd) + "\n")
        threads = [threading.Thread(target=sampler, daemon=True), threading.Thread(target=reader, args=(log,), daemon=True)]
        for thread in threads:
            thread.start()
        _, status, usage = os.wait4(proc.pid, 0)
        run.wall_seconds = round(time.monotonic() - start, 3)
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        for thread in threads:
            thread.join(timeout=10)
    run.returncode = proc.returncode
    run.peak_rss_bytes = usage.ru_maxrss * 1024
    run.cpu_seconds = round(usage.ru_utime + usage.ru_stime, 2)
    run.sampled_peak_bytes = max((r for _, r in samples), default=0)
    run.load_after = [round(x, 2) for x in os.getloadavg()]
    status_text = "ok" if run.ok else f"FAILED (exit {run.returncode}{', ' + run.killed if run.killed else ''})"
    print(f"  {run.name:<28} wall {run.wall_seconds:7.1f} s  cpu {run.cpu_seconds:7.1f} s  "
          f"peak RSS {run.peak_rss_bytes / GIB:6.2f} GiB  "
          f"load {run.load_before[0]:.1f}->{run.load_after[0]:.1f}  {status_text}", flush=True)
    return run, samples


def _oom_first(pid: int) -> None:
    """Make the benchmarked child the kernel's first OOM victim, before anyone else's work on a shared machine."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _vm_rss(pid: int, key: str = "VmRSS:") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None



# ---------------------------------------------------------------------------------------------
# Inputs, machine facts

def ensure_input(shape: str, given: str | None) -> Path:
    """The shape's synthetic checkpoint: ``given`` if passed, else bench/work/inputs/<name>, made once."""
    if given:
        return Path(given)
    path = WORK / "inputs" / INPUT_DIRS[shape]
    if (path / "config.json").exists():
        return path
    model, _, shard = SHAPES[shape]
    partial = path.with_name(path.name + ".partial")
    _rm(partial)
    print(f"synthesising {shape} input at {path} (random bf16; the 8B one takes several minutes)", flush=True)
    code = (f"from ckptconv.commands import synth; synth.write_checkpoint(synth.{model}, {str(partial)!r}, "
            f"max_shard_bytes={shard!r})")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    partial.rename(path)
    return path


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def machine_facts() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    disk = shutil.disk_usage(WORK)
    fs = subprocess.run(["df", "-hT", str(WORK)], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return {"nproc": os.cpu_count(), "cpu": cpu, "mem_total_bytes": mem, "kernel": platform.release(),
            "disk": fs, "disk_free_bytes": disk.free}


def code_state() -> str:
    """``HEAD`` or ``HEAD+<hash of the uncommitted diff of ckptconv/>``: which code a ckptconv run imported.

    The benchmark runs the work tree as it is; if someone edits ckptconv/ during a benchmark, the runs
    say so instead of pretending to measure one version.
    """
    git = ["git", "-C", str(REPO)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    diff = subprocess.run(git + ["diff", "HEAD", "--", "ckptconv"], capture_output=True).stdout
    if not diff:
        return head
    import hashlib

    return f"{head}+{hashlib.sha256(diff).hexdigest()[:8]}"


def ckptconv_versions() -> dict:
    from importlib.metadata import version as v

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "ckptconv"], capture_output=True, text=True).stdout.strip()
    versions = {p: v(p) for p in ("ckptconv", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy")}
    versions["python"] = platform.python_version()
    versions["git"] = commit + (" (ckptconv/ has uncommitted changes)" if dirty else "")
    return versions


def mem_available() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))


def _rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)



# ---------------------------------------------------------------------------------------------
# A conversion measured against its plan (the released-widths benchmarks)

def convert(src: Path, dst: Path, devices: int, dtype: str = "bfloat16") -> dict:
    """``ckptconv convert`` in a fresh process: wall from outside, peak RSS and bytes from its report, beside the
    plan's prediction for the same run; the output deleted once measured."""
    shutil.rmtree(dst, ignore_errors=True)
    start = time.monotonic()
    done = subprocess.run([str(c) for c in convert_cmd(src, dst, "--devices", devices, "--dtype", dtype)],
                          capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode:
        return {"devices": devices, "error": done.stderr.strip().splitlines()[-1]}
    report = json.loads((dst / "ckptconv-report.json").read_text())
    plan = plan_of(src, devices, dtype)
    shutil.rmtree(dst, ignore_errors=True)
    return {"devices": devices, "wall_seconds": round(wall, 1), "peak_rss_bytes": report["peak_rss_bytes"],
            "predicted_peak_rss_bytes": plan["predicted_peak_rss_bytes"],
            "predicted_seconds": plan["predicted_seconds"],
            "source_bytes": report["source_bytes"], "output_bytes": report["output_bytes"]}


def plan_of(src: Path, devices: int, dtype: str = "bfloat16") -> dict:
    """``ckptconv plan --json`` of a conversion, and how long planning took."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ckptconv", "plan", str(src), "--devices", str(devices), "--dtype",
                           dtype, "--json"], capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout), "plan_seconds": round(time.monotonic() - start, 1)}
