"""Benchmark ckptconv against MaxText 0.2.5's own converter; rerun with `make bench`.

    .venv/bin/python -m bench speed [--shapes 0.6b,8b] [--repeats 3] [--repeats-8b 2] ...
    .venv/bin/python -m bench speed --shapes 8b --maxtext-8b skip --results /tmp/8b.md   # the 8B wall against cp
                                                                                          # alone; no MaxText venv

What one run does (everything under the git-ignored bench/work/):
1. sets up MaxText's venv (bench/maxtext_env.sh: Python 3.12, maxtext[tpu]==0.2.5, torch; idempotent);
2. synthesises the inputs if missing: a qwen3-0.6b-shaped and a Llama-3-8B-shaped random bf16
   checkpoint (ckptconv.commands.synth; the 8B one is ~16 GB);
3. 0.6B: after one uncounted warm-up run of each tool, runs ckptconv, MaxText lazy and MaxText
   eager alternately, --repeats times each,
   every one a fresh child process reaped with os.wait4 (peak RSS = the kernel's ru_maxrss of that
   child), sampled every 50 ms from /proc/PID/status for the RSS-over-time plot; `cp` + `sync`
   of the same input bytes to the same disk gives the physical floor;
4. checks that ckptconv's and MaxText's 0.6B outputs are identical leaf by leaf, bit for bit
   (bench/compare_outputs.py, run with MaxText's venv and Orbax's public restore API);
5. 8B: cp + sync and ckptconv alternately --repeats-8b times, then MaxText lazy once under a
   timeout and an RSS cap (a watchdog kills it beyond the cap, so it cannot OOM the machine);
6. writes docs/bench/RESULTS.md (tables, targets met or missed, machine, versions, load averages)
   and docs/bench/rss_0.6b.png, docs/bench/rss_8b.png; raw numbers go to bench/work/results.json.
Outputs are deleted as soon as they are measured (the last 0.6B pair after the comparison);
the 8B input is deleted at the end unless --keep-inputs.
"""


from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/X.py` (the Makefile's) too

from bench.measure import (GB, GIB, INPUT_DIRS, SHAPES, Run, _rm, ckptconv_versions, code_state, dir_bytes,
                           ensure_input, machine_facts, measure, mem_available)
from bench import steps
from bench.steps import BENCH, DOCS, OFFLINE_ENV, WORK, ckptconv_cmd, maxtext_cmd, setup_maxtext


# MaxText log lines that mark its stages (to_maxtext.py in 0.2.5), shown on the plot.
MAXTEXT_MARKS = [
    ("Lazy loading ENABLED", "lazy loader"),
    ("Lazy loading DISABLED", "load HF weights"),
    ("HuggingFace model loaded", "HF loaded"),
    ("Initializing MaxText abstract model", "abstract model"),
    ("Starting weight transformation", "transform"),
    ("Weight transformation preparation complete", "transform done"),
    ("Starting checkpoint save", "save"),
    ("Shard weights across", "shard to devices"),
    ("'event_type': 'save'", "Orbax writes"),
    ("Conversion complete", "done"),
]


# ---------------------------------------------------------------------------------------------
# The tools

def cp_cmd(src: Path, dst: Path) -> list[str]:
    # The physical floor: read the same bytes and write them to the same disk, flushed.
    return ["sh", "-c", f'cp -r "{src}" "{dst}" && sync']


def run_ckptconv(shape: str, index: int, src: Path, env: dict, timeout: float) -> tuple[Run, list]:
    dst = WORK / "out" / f"ckptconv-{shape}-{index}"
    _rm(dst)
    run = Run(f"{shape}-ckptconv-{_label(index)}", "ckptconv", shape, index, ckptconv_cmd(src, dst), code=code_state())
    run, samples = measure(run, env, timeout=timeout, jsonl_marks=True)
    report = dst / "ckptconv-report.json"
    if report.exists():
        run.report = json.loads(report.read_text())
    return run, samples


def run_maxtext(ctx: dict, shape: str, index: int, src: Path, lazy: bool, timeout: float,
                rss_cap: int | None) -> tuple[Run, list]:
    mode = "lazy" if lazy else "eager"
    dst = WORK / "out" / f"maxtext-{mode}-{shape}-{index}"
    _rm(dst)
    cmd = maxtext_cmd(ctx["mt_python"], ctx["base_yml"], SHAPES[shape][1], src, dst, lazy)
    return measure(Run(f"{shape}-maxtext-{mode}-{_label(index)}", f"maxtext-{mode}", shape, index, cmd), ctx["mt_env"],
                   timeout=timeout, rss_cap=rss_cap, marks=MAXTEXT_MARKS)


def _label(index: int) -> str:
    return "warmup" if index < 0 else str(index)


def run_cp(shape: str, index: int, src: Path, timeout: float) -> tuple[Run, list]:
    dst = WORK / "out" / f"cp-{shape}-{index}"
    _rm(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    result = measure(Run(f"{shape}-cp-{index}", "cp", shape, index, cp_cmd(src, dst)), dict(os.environ), timeout=timeout)
    _rm(dst)
    return result


# ---------------------------------------------------------------------------------------------
# The benchmark

def bench_small(ctx: dict, args, results: dict) -> None:
    shape = "0.6b"
    src = ensure_input(shape, args.qwen_src)
    results["inputs"][shape] = {"path": str(src), "bytes": dir_bytes(src)}
    print(f"\n== {shape}: {src} ({dir_bytes(src) / GIB:.2f} GiB); {args.repeats} rounds of ckptconv, "
          "MaxText lazy, MaxText eager, cp", flush=True)
    if args.warmup:
        print("  warm-up (not counted): each tool once", flush=True)
        for tool in ("ckptconv", "maxtext-lazy", "maxtext-eager"):
            if tool == "ckptconv":
                run, _ = run_ckptconv(shape, -1, src, ctx["mt_env"], args.timeout)
            else:
                run, _ = run_maxtext(ctx, shape, -1, src, tool == "maxtext-lazy", args.timeout, None)
            run.warmup = True
            results["runs"].append(asdict(run))
            _rm(WORK / "out" / _out_name(tool, shape, -1))
    plot_samples = {}
    for i in range(args.repeats):
        keep = i == args.repeats - 1  # the last round's outputs are compared, then deleted
        for tool in ("ckptconv", "maxtext-lazy", "maxtext-eager"):
            if tool == "ckptconv":
                run, samples = run_ckptconv(shape, i, src, ctx["mt_env"], args.timeout)
            else:
                run, samples = run_maxtext(ctx, shape, i, src, tool == "maxtext-lazy", args.timeout, None)
            results["runs"].append(asdict(run))
            plot_samples.setdefault(tool, []).append((run, samples))
            if not keep:
                _rm(WORK / "out" / _out_name(tool, shape, i))
        run, _ = run_cp(shape, i, src, args.timeout)
        results["runs"].append(asdict(run))
    last = args.repeats - 1
    results["comparison"] = compare_outputs(ctx, WORK / "out" / _out_name("ckptconv", shape, last),
                                            WORK / "out" / _out_name("maxtext-lazy", shape, last),
                                            WORK / "out" / _out_name("maxtext-eager", shape, last))
    if not args.keep_outputs:
        for tool in ("ckptconv", "maxtext-lazy", "maxtext-eager"):
            _rm(WORK / "out" / _out_name(tool, shape, last))
    plot(ctx, plot_samples, results, "0.6b", "qwen3-0.6b shape")


def _out_name(tool: str, shape: str, index: int) -> str:
    return f"{tool}-{shape}-{index}" if tool == "ckptconv" else f"maxtext-{tool.split('-')[1]}-{shape}-{index}"


def compare_outputs(ctx: dict, ours: Path, lazy: Path, eager: Path) -> dict:
    """Both comparisons in MaxText's venv: ckptconv vs MaxText lazy, and MaxText lazy vs eager."""
    out = {}
    for key, (a, b) in {"ckptconv_vs_maxtext_lazy": (ours, lazy), "maxtext_lazy_vs_eager": (lazy, eager)}.items():
        if not (a / "0" / "items").exists() or not (b / "0" / "items").exists():
            out[key] = {"identical": None, "error": f"missing output: {a if not (a / '0').exists() else b}"}
            continue
        json_path = WORK / f"compare-{key}.json"
        print(f"  comparing {a.name} with {b.name} leaf by leaf ...", flush=True)
        proc, result = steps.compare_outputs(a, b, json_path, json_path.with_suffix(".log"), env=ctx["mt_env"])
        out[key] = result or {"identical": None, "error": (proc.stderr or proc.stdout).strip().splitlines()[-5:]}
        print("    " + (proc.stdout.strip().splitlines() or ["(no output)"])[-1], flush=True)
    return out


def bench_large(ctx: dict, args, results: dict) -> None:
    shape = "8b"
    # One output at a time (each deleted once measured): the cp copy (16 GB) is the largest; plus the input if missing.
    existing = (WORK / "inputs" / INPUT_DIRS[shape] / "config.json").exists() or args.llama_src
    need = (0 if existing else 16 * GB) + 16 * GB + 4 * GB
    free = shutil.disk_usage(WORK).free
    if free < need:
        results["notes"].append(f"8B skipped: {free / GB:.0f} GB free on {WORK}, about {need / GB:.0f} GB needed")
        print(results["notes"][-1], flush=True)
        return
    src = ensure_input(shape, args.llama_src)
    results["inputs"][shape] = {"path": str(src), "bytes": dir_bytes(src)}
    print(f"\n== {shape}: {src} ({dir_bytes(src) / GIB:.2f} GiB); {args.repeats_8b} rounds of cp and ckptconv",
          flush=True)
    plot_samples = {}
    for i in range(args.repeats_8b):
        run, _ = run_cp(shape, i, src, args.timeout_8b)
        results["runs"].append(asdict(run))
        run, samples = run_ckptconv(shape, i, src, ctx["mt_env"], args.timeout_8b)
        results["runs"].append(asdict(run))
        plot_samples.setdefault("ckptconv", []).append((run, samples))
        _rm(WORK / "out" / _out_name("ckptconv", shape, i))
    if args.maxtext_8b == "skip":
        results["notes"].append("MaxText 8B not run (--maxtext-8b skip)")
        plot(ctx, plot_samples, results, shape, "Llama-3-8B shape")
        return
    cap = min(int(args.maxtext_8b_cap_gib * GIB), mem_available() - 3 * GIB)
    results["maxtext_8b_cap_bytes"] = cap
    print(f"  MaxText lazy on 8B, killed if RSS > {cap / GIB:.1f} GiB or after {args.maxtext_8b_timeout:.0f} s", flush=True)
    run, samples = run_maxtext(ctx, shape, 0, src, True, args.maxtext_8b_timeout, cap)
    results["runs"].append(asdict(run))
    plot_samples["maxtext-lazy"] = [(run, samples)]
    _rm(WORK / "out" / _out_name("maxtext-lazy", shape, 0))
    plot(ctx, plot_samples, results, shape, "Llama-3-8B shape")


def plot(ctx: dict, plot_samples: dict, results: dict, shape: str, title: str) -> None:
    """RSS over time of the median-wall run of each tool, drawn by plot_rss.py in MaxText's venv."""
    colors = {"ckptconv": "tab:green", "maxtext-lazy": "tab:blue", "maxtext-eager": "tab:red"}
    series = []
    for tool, runs in plot_samples.items():
        ok = [(run, samples) for run, samples in runs if run.ok] or runs
        run, samples = sorted(ok, key=lambda rs: rs[0].wall_seconds)[len(ok) // 2]
        label = f"{tool} (run {run.index})" + ("" if run.ok else f", killed: {run.killed}" if run.killed else f", exit {run.returncode}")
        series.append({"label": label, "color": colors[tool], "t": [t for t, _ in samples],
                       "rss": [r for _, r in samples], "peak": run.peak_rss_bytes, "markers": run.marks})
    data = {"title": f"{title}, 16 simulated devices: RSS every 50 ms (/proc/PID/status VmRSS)", "series": series}
    data_path = WORK / f"rss_{shape}.json"
    data_path.write_text(json.dumps(data))
    if "mt_python" not in ctx:  # no MaxText run, no venv: matplotlib lives there
        results["notes"].append(f"plot {shape} not drawn: MaxText's venv (matplotlib) was not set up")
        return
    proc = subprocess.run([ctx["mt_python"], str(BENCH / "plot_rss.py"), str(data_path), str(DOCS / f"rss_{shape}.png")],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        results["notes"].append(f"plot {shape} failed: " + proc.stderr.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Summaries and RESULTS.md

def median_of(runs: list[dict], key) -> float | None:
    values = [key(r) for r in runs if r["returncode"] == 0 and r["killed"] is None]
    return statistics.median(values) if values else None


def summarise(results: dict) -> dict:
    rows = {}
    for shape in SHAPES:
        for tool in ("ckptconv", "maxtext-lazy", "maxtext-eager", "cp"):
            runs = [r for r in results["runs"] if r["shape"] == shape and r["tool"] == tool and not r.get("warmup")]
            if not runs:
                continue
            rows[(shape, tool)] = {
                "runs": len(runs), "ok": sum(r["returncode"] == 0 and r["killed"] is None for r in runs),
                "wall": median_of(runs, lambda r: r["wall_seconds"]),
                "rss": median_of(runs, lambda r: r["peak_rss_bytes"]),
                "cpu": median_of(runs, lambda r: r.get("cpu_seconds", 0.0)),
                "walls": [r["wall_seconds"] for r in runs], "rsss": [r["peak_rss_bytes"] for r in runs],
                "failures": [f"{r['name']}: exit {r['returncode']}" + (f", killed: {r['killed']}" if r["killed"] else "")
                             + f" after {r['wall_seconds']:.0f} s at {r['peak_rss_bytes'] / GIB:.2f} GiB"
                             + (f" (last stage: {r['marks'][-1][1]}{_last_progress(r['last_lines'])})" if r["marks"] else "")
                             for r in runs if not (r["returncode"] == 0 and r["killed"] is None)],
            }
            stage_runs = [r["report"]["stage_seconds"] for r in runs if r.get("report")]
            if stage_runs:
                rows[(shape, tool)]["stages"] = {k: statistics.median(s[k] for s in stage_runs) for k in stage_runs[0]}
                rows[(shape, tool)]["report_wall"] = statistics.median(r["report"]["wall_seconds"] for r in runs if r.get("report"))
    return rows


def _last_progress(lines: list[str]) -> str:
    """The last tqdm count a child printed (``5/12``), if any: how far a killed run got."""
    found = re.findall(r"(\d+)/(\d+) \[", "\n".join(lines))
    return f", progress bar at {found[-1][0]}/{found[-1][1]}" if found else ""


def targets(rows: dict) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, limit, met) for each target of issue 5."""
    def get(shape, tool, key):
        return rows.get((shape, tool), {}).get(key)

    out = []
    ours, lazy = get("0.6b", "ckptconv", "rss"), get("0.6b", "maxtext-lazy", "rss")
    if ours and lazy:
        out.append(("peak RSS 0.6B, ckptconv / MaxText lazy", f"{ours / lazy:.3f} ({ours / GIB:.2f} / {lazy / GIB:.2f} GiB)",
                    "<= 0.2", ours / lazy <= 0.2))
    walls = [w for w in (get("0.6b", "maxtext-lazy", "wall"), get("0.6b", "maxtext-eager", "wall")) if w]
    ours_wall = get("0.6b", "ckptconv", "wall")
    if ours_wall and walls:
        best = min(walls)
        out.append(("wall 0.6B, ckptconv / faster MaxText mode", f"{ours_wall / best:.3f} ({ours_wall:.1f} / {best:.1f} s)",
                    "<= 0.333", ours_wall / best <= 1 / 3))
    big = get("8b", "ckptconv", "rss")
    if big:
        out.append(("peak RSS Llama-3-8B, ckptconv", f"{big / GB:.3f} GB ({big / GIB:.3f} GiB)", "<= 1 GB", big <= GB))
        if ours:
            out.append(("peak RSS ckptconv 8B / 0.6B", f"{big / ours:.3f}", "<= 1.5", big / ours <= 1.5))
    big_wall, cp_wall = get("8b", "ckptconv", "wall"), get("8b", "cp", "wall")
    if big_wall and cp_wall:
        out.append(("wall 8B, ckptconv / (cp + sync)", f"{big_wall / cp_wall:.2f} ({big_wall:.1f} / {cp_wall:.1f} s)",
                    "<= 3", big_wall / cp_wall <= 3))
    elif get("8b", "ckptconv", "runs"):
        out.append(("Llama-3-8B converts", "failed: " + "; ".join(rows[("8b", "ckptconv")]["failures"]), "", False))
    return out


def write_results(results: dict, path: Path) -> None:
    rows = summarise(results)
    lines = ["# ckptconv vs MaxText 0.2.5 `to_maxtext`: benchmark results", "",
             f"Generated by `make bench` (`python -m bench speed`) on {results['started_at']} "
             f"(finished {results['finished_at']}, {results['bench_seconds'] / 60:.0f} min). "
             "Rerun it to refresh this file; raw numbers go to `bench/work/results.json`.", ""]
    m = results["machine"]
    lines += ["## Machine", "",
              f"- {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_bytes'] / GIB:.1f} GiB RAM, no swap accounting, Linux {m['kernel']}",
              f"- disk: `{m['disk']}`",
              f"- load averages (1/5/15 min) at start {results['load_start']}, at end {results['load_end']}; "
              "other work was running concurrently: see each run's load below.",
              f"- ckptconv {results['ckptconv_versions']['ckptconv']} (git {results['ckptconv_versions']['git']}), "
              f"Python {results['ckptconv_versions']['python']}, " + ", ".join(
                  f"{k} {v}" for k, v in results["ckptconv_versions"].items() if k not in ("ckptconv", "python", "git")),
              f"- MaxText venv: Python {results['mt_python_version']}, " + ", ".join(f"{k} {v}" for k, v in results["mt_versions"].items()),
              ""]
    lines += ["## Targets", "", "| target | measured (medians) | limit | |", "|---|---|---|---|"]
    for name, measured, limit, met in targets(rows):
        lines.append(f"| {name} | {measured} | {limit} | {'met' if met else 'MISSED'} |")
    ours_8b = rows.get(("8b", "ckptconv"), {}).get("rss")
    for r in results["runs"]:
        if r["shape"] == "8b" and r["tool"].startswith("maxtext"):
            if r["killed"] or r["returncode"]:
                stage = f", during its '{r['marks'][-1][1]}' stage" if r["marks"] else ""
                lines += ["", f"MaxText ({r['tool']}) on Llama-3-8B did not complete: {r['killed'] or 'exit ' + str(r['returncode'])} "
                          f"after {r['wall_seconds']:.0f} s at {r['peak_rss_bytes'] / GIB:.2f} GiB{stage}; it needs more than that"
                          + (f", over {r['peak_rss_bytes'] / ours_8b:.0f}x ckptconv's peak." if ours_8b else ".")]
            else:
                lines += ["", f"MaxText ({r['tool']}) on Llama-3-8B completed in {r['wall_seconds']:.0f} s, "
                          f"peak RSS {r['peak_rss_bytes'] / GIB:.2f} GiB."]
    lines += ["", "## Medians", "",
              "Peak RSS is the kernel's high-water mark of each child (`os.wait4` ru_maxrss); wall is measured "
              "from outside, process start to exit (Python start-up and imports included, the same for both tools). "
              "A warm-up run of each tool on 0.6B (compiling `.pyc` files, filling the page cache) is listed under All runs "
              "and not counted.",
              "CPU is the child's user + system seconds (rusage): the work done, less sensitive to other load than wall.",
              "", "| shape | tool | runs ok | median wall (s) | median peak RSS (GiB) | median CPU (s) | walls (s) | peak RSS (GiB) |",
              "|---|---|---|---|---|---|---|---|"]
    for (shape, tool), row in rows.items():
        wall = f"{row['wall']:.1f}" if row["wall"] else "-"
        rss = f"{row['rss'] / GIB:.2f}" if row["rss"] else "-"
        cpu = f"{row['cpu']:.1f}" if row["cpu"] else "-"
        lines.append(f"| {shape} | {tool} | {row['ok']}/{row['runs']} | {wall} | {rss} | {cpu} | "
                     f"{', '.join(f'{w:.1f}' for w in row['walls'])} | {', '.join(f'{r / GIB:.2f}' for r in row['rsss'])} |")
    lines += ["", "Ratios ours / theirs (medians):", ""]
    for shape in SHAPES:
        ours = rows.get((shape, "ckptconv"))
        for tool in ("maxtext-lazy", "maxtext-eager", "cp"):
            theirs = rows.get((shape, tool))
            if ours and theirs and ours["wall"] and theirs["wall"]:
                rss = f", peak RSS {ours['rss'] / theirs['rss']:.3f}" if tool != "cp" else ""
                lines.append(f"- {shape}, ckptconv / {tool}: wall {ours['wall'] / theirs['wall']:.3f}{rss}")
    failures = [f for row in rows.values() for f in row["failures"]]
    if failures:
        lines += ["", "Runs that did not complete:", ""] + [f"- {f}" for f in failures]
    lines += ["", "## Where ckptconv's time goes", "",
              "Median seconds per stage from `ckptconv-report.json`. read and transform run in a background thread, "
              "so they are busy seconds overlapping write; wall (report) excludes interpreter start-up and imports.", "",
              "| shape | plan | read | transform | write | commit | wall (report) | wall (outside) |", "|---|---|---|---|---|---|---|---|"]
    for shape in SHAPES:
        row = rows.get((shape, "ckptconv"))
        if row and row.get("stages"):
            s = row["stages"]
            lines.append(f"| {shape} | " + " | ".join(f"{s.get(k, 0):.1f}" for k in ("plan", "read", "transform", "write", "commit"))
                         + f" | {row['report_wall']:.1f} | {row['wall']:.1f} |")
    mt_stages = maxtext_stage_table(results)
    if mt_stages:
        lines += ["", "MaxText's stages, from its own log lines (median seconds since process start at each mark):", "",
                  "| shape | mode | " + " | ".join(label for label in mt_stages["labels"]) + " | exit |",
                  "|---|---|" + "---|" * (len(mt_stages["labels"]) + 1)]
        for (shape, tool), marks in mt_stages["rows"].items():
            lines.append(f"| {shape} | {tool} | " + " | ".join(f"{marks[l]:.1f}" if l in marks else "-" for l in mt_stages["labels"])
                         + f" | {marks['exit']:.1f} |")
    lines += ["", "## Outputs compared (0.6B, last round)", ""]
    for key, comp in results.get("comparison", {}).items():
        lines += comparison_lines(key, comp)
    lines += ["", "## RSS over time (0.6B)", "", "![RSS over time](rss_0.6b.png)", "",
              "Median-wall run of each tool, sampled every 50 ms; dashed: the kernel high-water mark; dotted: stage marks "
              "(ckptconv's `--progress jsonl` events, MaxText's log lines).", ""]
    if (DOCS / "rss_8b.png").exists() and "8b" in results["inputs"]:
        lines += ["## RSS over time (8B)", "", "![RSS over time, 8B](rss_8b.png)", ""]
    if results.get("maxtext_8b_cap_bytes"):
        lines += [f"MaxText on 8B ran under a watchdog: SIGKILL when RSS passed {results['maxtext_8b_cap_bytes'] / GIB:.1f} GiB "
                  "(the smaller of `--maxtext-8b-cap-gib` and MemAvailable - 3 GiB at that moment) or after the timeout, so a "
                  "killed run needed more than that: its peak is a lower bound. Every benchmarked child runs with "
                  "`oom_score_adj=1000`, so on a shared machine the kernel would pick it before anyone else's work.", ""]
    lines += ["## All runs", "", "ckptconv code: git HEAD when the run started, `+hash` when ckptconv/ had uncommitted changes.", "",
              "| run | exit | wall (s) | CPU (s) | peak RSS (GiB) | sampled peak (GiB) | load before | load after | ckptconv code |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        exit_ = str(r["returncode"]) + (f" ({r['killed']})" if r["killed"] else "")
        name = f"{r['shape']}-{r['tool']}-warmup (not counted)" if r.get("warmup") else r["name"]
        lines.append(f"| {name} | {exit_} | {r['wall_seconds']:.1f} | {r.get('cpu_seconds', 0):.1f} | {r['peak_rss_bytes'] / GIB:.2f} | "
                     f"{r['sampled_peak_bytes'] / GIB:.2f} | {' '.join(map(str, r['load_before']))} | {' '.join(map(str, r['load_after']))} | "
                     f"{r.get('code', '')} |")
    inputs = ", ".join(f"{k}: {v['bytes'] / GIB:.2f} GiB" for k, v in results["inputs"].items())
    notes = list(results["notes"])
    codes = sorted({r.get("code") for r in results["runs"] if r["tool"] == "ckptconv" and r.get("code") and not r.get("warmup")})
    if len(codes) > 1:
        notes.append(f"ckptconv's code changed between counted runs ({', '.join(codes)}): someone was editing "
                                "the work tree; see the last column of All runs.")
    lines += ["", "## Notes", "", f"- Inputs (random bf16, `ckptconv.commands.synth`): {inputs}. "
              "Both tools read the same files; the page cache was not dropped (24 GiB RAM holds the 0.6B input, "
              "not all of the 8B one), and `sync` ran before every run so no run pays for the previous one's writes.",
              "- cp: `cp -r SRC NEW && sync` on the same disk, the same bytes in and out.",
              "- MaxText runs offline (`HF_HUB_OFFLINE=1`, empty `HF_HOME`): with a local `hf_model_path` it reads only "
              "`*.safetensors` (and the index); the model's shapes come from its built-in table for `model_name`.",
              ] + (["- 8B: MaxText 0.2.5 has no Llama 3 (non-3.1) entry, so it runs as `llama3.1-8b` (same shapes; its mapping "
                    "would also permute q/k for Llama 3.1 RoPE, where ckptconv follows the checkpoint's `config.json`, which has no "
                    "`rope_scaling`). The 8B outputs are not compared."] if "8b" in results["inputs"] else []) + [f"- {n}" for n in notes]
    analysis = DOCS / "ANALYSIS.md"  # hand-written reading of the numbers, kept across reruns
    if analysis.exists():
        lines += ["", analysis.read_text().rstrip()]
    path.write_text("\n".join(lines) + "\n")


def maxtext_stage_table(results: dict) -> dict:
    labels = [label for _, label in MAXTEXT_MARKS]
    rows = {}
    for shape in SHAPES:
        for tool in ("maxtext-lazy", "maxtext-eager"):
            runs = [r for r in results["runs"] if r["shape"] == shape and r["tool"] == tool and not r.get("warmup")]
            if not runs:
                continue
            marks = {}
            for label in labels:
                ts = [t for r in runs for t, lab in r["marks"] if lab == label]
                if ts:
                    marks[label] = statistics.median(ts)
            marks["exit"] = statistics.median(r["wall_seconds"] for r in runs)
            rows[(shape, tool)] = marks
    used = [label for label in labels if any(label in m for m in rows.values())]
    return {"labels": used, "rows": rows} if rows else {}


def comparison_lines(key: str, comp: dict) -> list[str]:
    title = {"ckptconv_vs_maxtext_lazy": "ckptconv vs MaxText lazy", "maxtext_lazy_vs_eager": "MaxText lazy vs MaxText eager"}[key]
    if comp.get("identical") is None:
        return [f"- **{title}**: not compared: {comp.get('error')}"]
    verdict = "identical" if comp["identical"] else "DIFFERENT"
    out = [f"- **{title}**: values {verdict}: {comp['leaves_compared']} leaves, {comp['bytes_compared'] / 2**20:.1f} MiB "
           f"compared bit for bit (Orbax restore to NumPy, one leaf at a time, in MaxText's venv)."]
    for name in comp["only_in_a"]:
        out.append(f"  - only in the first: `{name}`")
    for name in comp["only_in_b"]:
        out.append(f"  - only in the second: `{name}`")
    for mismatch in comp["value_mismatches"]:
        out.append(f"  - values differ: `{mismatch['leaf']}`: {mismatch['why']}")
    if comp["metadata_differences"]:
        out.append("  - metadata differences (values equal unless listed above):")
        out += [f"    - `{d['leaf']}` {d['field']}: {json.dumps(d['a'])} vs {json.dumps(d['b'])}" for d in comp["metadata_differences"]]
    else:
        out.append("  - metadata (shape, dtype, sharding, chunk shape) equal for every leaf.")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.6b,8b", help="comma-separated: 0.6b, 8b")
    parser.add_argument("--repeats", type=int, default=3, help="rounds on 0.6B (each tool once per round)")
    parser.add_argument("--warmup", type=int, choices=(0, 1), default=1,
                        help="one uncounted 0.6B run of each tool first (.pyc compilation, page cache)")
    parser.add_argument("--repeats-8b", type=int, default=2, help="rounds of cp and ckptconv on 8B")
    parser.add_argument("--maxtext-8b", choices=("run", "skip"), default="run",
                        help="run MaxText on 8B under the RSS cap and timeout, or skip it")
    parser.add_argument("--maxtext-8b-cap-gib", type=float, default=20.0,
                        help="kill MaxText 8B beyond this RSS (also never above MemAvailable - 3 GiB)")
    parser.add_argument("--maxtext-8b-timeout", type=float, default=1800.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="per 0.6B run, seconds")
    parser.add_argument("--timeout-8b", type=float, default=3600.0, help="per 8B ckptconv or cp run, seconds")
    parser.add_argument("--qwen-src", help="use this qwen3-0.6b-shaped checkpoint instead of synthesising one")
    parser.add_argument("--llama-src", help="use this Llama-3-8B-shaped checkpoint instead of synthesising one")
    parser.add_argument("--keep-inputs", action="store_true", help="keep bench/work/inputs (the 8B one is 16 GB)")
    parser.add_argument("--keep-outputs", action="store_true", help="keep the compared 0.6B outputs")
    parser.add_argument("--results", default=str(DOCS / "RESULTS.md"))
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = {"started_at": _now(), "load_start": [round(x, 2) for x in os.getloadavg()], "machine": machine_facts(),
               "ckptconv_versions": ckptconv_versions(), "inputs": {}, "runs": [], "notes": []}
    print(f"machine: {results['machine']['nproc']} CPUs, {results['machine']['mem_total_bytes'] / GIB:.1f} GiB; "
          f"load {results['load_start']}; disk {results['machine']['disk']}", flush=True)
    if "0.6b" in shapes or args.maxtext_8b == "run":
        ctx = setup_maxtext()
        results["mt_versions"] = ctx["mt_versions"]
        results["mt_python_version"] = subprocess.run([ctx["mt_python"], "-c", "import platform; print(platform.python_version())"],
                                                      capture_output=True, text=True).stdout.strip()
    else:  # only ckptconv and cp run (the 8B wall against cp): no MaxText venv needed
        ctx = {"mt_env": {**os.environ, **OFFLINE_ENV, "JAX_PLATFORMS": "cpu"}}
        results["mt_versions"], results["mt_python_version"] = {}, "(not used)"
    try:
        if "0.6b" in shapes:
            bench_small(ctx, args, results)
        if "8b" in shapes:
            bench_large(ctx, args, results)
    finally:
        _rm(WORK / "out")
        if not args.keep_inputs and "8b" in shapes and not args.llama_src:
            _rm(WORK / "inputs" / INPUT_DIRS["8b"])
        results["finished_at"] = _now()
        results["load_end"] = [round(x, 2) for x in os.getloadavg()]
        results["bench_seconds"] = time.monotonic() - t0
        (WORK / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_results(results, Path(args.results))
    print(f"\nwrote {args.results}, {DOCS / 'rss_0.6b.png'} and {WORK / 'results.json'}")
    for name, measured, limit, met in targets(summarise(results)):
        print(f"  {'met   ' if met else 'MISSED'} {name}: {measured} (target {limit})")
    return 0


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


if __name__ == "__main__":
    sys.exit(main())
