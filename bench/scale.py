"""Scale up and out on this machine: 1 vs 2 cores, and one conversion split into N partitions.

Writes ``docs/bench/SCALE.md`` (``SCALE-8b.md`` for the 8B shape; raw runs in ``bench/work/scale/scale.json``). Every run is a fresh
``python -m ckptconv`` process, timed from outside (start-up included); the peak RSS is each
process's own (its report's VmHWM).

- cores: the same conversion pinned with ``taskset`` to 1 core and to 2 cores;
- partitions: one process vs ``--partition I/N`` for N = 1, 2, 4 run as N concurrent processes
  (as N workers sharing the destination would), then ``--finalize N``; the wall is the partitions'
  (the slowest one) plus the finalize.

    .venv/bin/python -m bench scale [--shape 0.6b] [--repeats 2]
    .venv/bin/python -m bench scale --shape 8b --src bench/work/inputs/llama3-8b --cores-only
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.steps import DOCS, REPO as ROOT, WORK as BENCH_WORK

WORK = BENCH_WORK / "scale"


def shapes():
    from ckptconv.commands import synth
    return {"0.6b": synth.QWEN3_0_6B, "8b": synth.LLAMA3_8B}


def run(args: list[str], pin: str | None = None) -> tuple[float, dict]:
    """(wall seconds, report) of one ``ckptconv`` process."""
    report = WORK / "report.json"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "ckptconv", *args, "--progress", "none", "--report", str(report)]
    if pin:
        command = ["taskset", "-c", pin, *command]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(args)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return wall, json.loads(report.read_text())


def partitioned(src: Path, dst: Path, count: int, devices: int) -> tuple[float, list[dict], dict]:
    """N concurrent partition processes, then the finalize: (wall, partition reports, finalize report)."""
    start = time.perf_counter()
    procs = []
    for index in range(count):
        report = WORK / f"part{index}.json"
        report.unlink(missing_ok=True)
        procs.append((report, subprocess.Popen(
            [sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", str(devices),
             "--partition", f"{index}/{count}", "--progress", "none", "--report", str(report)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
    reports = []
    for report, proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"partition: exit {proc.returncode}: {err[-2000:]}")
        reports.append(json.loads(report.read_text()))
    _, final = run(["convert", str(src), str(dst), "--devices", str(devices), "--finalize", str(count)])
    return time.perf_counter() - start, reports, final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6b", choices=sorted(shapes()))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--devices", type=int, default=16)
    parser.add_argument("--src", help="an existing checkpoint of the shape (e.g. bench/work/inputs/llama3-8b)")
    parser.add_argument("--cores-only", action="store_true", help="skip the partition runs")
    parser.add_argument("--out", help="the page (default: docs/bench/SCALE.md, SCALE-<shape>.md but for 0.6b)")
    opts = parser.parse_args(argv)
    from ckptconv.commands import synth

    WORK.mkdir(parents=True, exist_ok=True)
    src = Path(opts.src) if opts.src else WORK / f"src-{opts.shape}"
    if not src.exists():
        synth.write_checkpoint(shapes()[opts.shape], str(src))
    dst = WORK / "dst"
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results: dict[str, list[dict]] = {}

    def record(label: str, wall: float, peak: int, extra: dict | None = None) -> None:
        results.setdefault(label, []).append({"wall": round(wall, 2), "peak_mib": round(peak / 2**20), **(extra or {})})
        print(f"{label}: {wall:.1f} s, peak {peak / 2**20:.0f} MiB", flush=True)

    run(["convert", str(src), str(dst), "--devices", str(opts.devices)])  # warm-up: page cache, .pyc
    for _ in range(opts.repeats):
        for pin, label in (("0", "1 core"), ("0,1", "2 cores")):
            shutil.rmtree(dst, ignore_errors=True)
            wall, report = run(["convert", str(src), str(dst), "--devices", str(opts.devices)], pin)
            record(label, wall, report["peak_rss_bytes"])
        for count in () if opts.cores_only else (1, 2, 4):
            shutil.rmtree(dst, ignore_errors=True)
            wall, parts, final = partitioned(src, dst, count, opts.devices)
            record(f"{count} partition(s) + finalize", wall, max(p["peak_rss_bytes"] for p in parts + [final]),
                   {"finalize_s": final["wall_seconds"], "partition_s": [p["wall_seconds"] for p in parts]})
    shutil.rmtree(dst, ignore_errors=True)
    medians = {label: statistics.median(r["wall"] for r in runs) for label, runs in results.items()}
    (WORK / "scale.json").write_text(json.dumps(results, indent=2))
    out = [f"# Scaling on this machine ({opts.shape} shape, {opts.devices} devices)", "",
           f"`python -m bench scale --shape {opts.shape}` on {started}, {os.cpu_count()} CPUs, "
           f"load at end {os.getloadavg()[0]:.2f}. Walls are medians of {opts.repeats} runs, from outside "
           "(process start-up included); peak RSS is the largest process's own VmHWM.", "",
           "| run | median wall (s) | walls (s) | peak RSS (MiB) |", "|---|---|---|---|"]
    for label, runs in results.items():
        out.append(f"| {label} | {medians[label]:.1f} | {', '.join(str(r['wall']) for r in runs)} | "
                   f"{max(r['peak_mib'] for r in runs)} |")
    out += ["", f"- 1 -> 2 cores speed-up: {medians['1 core'] / medians['2 cores']:.2f}x"]
    if not opts.cores_only:
        out.append("- partitions vs one process (2 cores): " + ", ".join(
            f"N={n}: {medians['2 cores'] / medians[f'{n} partition(s) + finalize']:.2f}x" for n in (1, 2, 4)))
    name = "SCALE.md" if opts.shape == "0.6b" else f"SCALE-{opts.shape}.md"
    (Path(opts.out) if opts.out else DOCS / name).write_text("\n".join(out + [""]))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
