"""Conversion throughput on this host against ``cp`` of the same bytes (issue 38).

``python -m bench throughput [--layers 8] [--work DIR] [--run "LABEL=FLAGS"]...`` synthesises Llama-3-8B's widths
(``synth.LLAMA3_8B``, ``--layers`` layers; any other shape with ``--model``), times ``cp -r SRC X && sync`` (the
floor: the same bytes read and written), then each conversion in a fresh process started from here (a small parent:
no NumPy, no JAX), and prints one row per run: wall seconds, GiB/s of output, cores used (the child's CPU seconds /
wall), its peak RSS against the prediction the report records (and where the peak came from: ``VmHWM``, or sampled
``VmRSS`` on hosts without it), and the ratio to the ``cp``. ``--tree DIR`` runs another checkout's ckptconv (an
older commit's ``git worktree``, to compare the same way). ``--json FILE`` keeps the rows.

Default runs: the defaults (both data-file layouts) and ``--workers 1`` (one stream, as before issue 38).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

GIB = 1024**3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RUNS = ("default=", "workers-1=--workers 1", "source-order=--no-data-files-by-device",
                "source-order-workers-1=--no-data-files-by-device --workers 1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="LLAMA3_8B", help="a SynthModel preset of ckptconv.commands.synth")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ckptconv-throughput"),
                        help="where the source, the cp and the outputs go (kept: a second call reuses the source)")
    parser.add_argument("--run", action="append", metavar="LABEL=FLAGS",
                        help=f"a conversion to time (repeatable); default: {'; '.join(DEFAULT_RUNS)}")
    parser.add_argument("--repeat", type=int, default=1, help="times each run is made (rows for each)")
    parser.add_argument("--tree", default=ROOT, help="the checkout whose ckptconv converts (default: this one)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--fast", action="store_true", help="synthesise from a pool of random values (~10x faster)")
    parser.add_argument("--no-cp", action="store_true", help="skip the cp floor (ratios then left out)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--profile", metavar="DIR",
                        help="run each conversion under bench/threadprof.py, its thread profile in DIR/LABEL-N.json "
                             "(CPU by thread group, what each Python thread waits in)")
    return parser


def synthesise(python: str, model: str, layers: int, directory: str, fast: bool = False) -> float:
    """The source, made in a child (NumPy stays out of this process); seconds taken (0 when already there).
    ``fast``: big tensors cut from one pool of random values (``synth.write_checkpoint``'s ``fast``: the same
    statistics and compressibility, ~10x faster to make; on the TPU host 4 s against 69)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return 0.0
    code = ("import dataclasses, sys; from ckptconv.commands import synth; "
            f"synth.write_checkpoint(dataclasses.replace(synth.{model}, num_layers={layers}), sys.argv[1], "
            f"max_shard_bytes=5 * 10**9, fast={fast})")
    start = time.perf_counter()
    subprocess.run([python, "-c", code, directory], check=True, cwd=ROOT, env=_env(ROOT))
    return time.perf_counter() - start


def _env(tree: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH", "")) if p)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _timed(argv: list[str], cwd: str, env: dict[str, str] | None = None) -> tuple[float, dict, int, str]:
    """(wall, the child's rusage figures, exit status, its last output lines) of one command started from here."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    figures = {"cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1), "user_seconds": round(usage.ru_utime, 1),
               "system_seconds": round(usage.ru_stime, 1), "minor_faults": usage.ru_minflt,
               "major_faults": usage.ru_majflt, "voluntary_switches": usage.ru_nvcsw,
               "involuntary_switches": usage.ru_nivcsw}
    return wall, figures, proc.returncode, "\n".join(output.splitlines()[-5:])


def cp_floor(src: str, work: str) -> float:
    copy = os.path.join(work, "cp")
    shutil.rmtree(copy, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    wall, _, code, out = _timed(["bash", "-c", f"cp -r {shlex.quote(src)} {shlex.quote(copy)} && sync"], work)
    shutil.rmtree(copy, ignore_errors=True)
    if code:
        raise RuntimeError(f"cp failed: {out}")
    return wall


def convert(python: str, tree: str, src: str, dst: str, flags: list[str], profile: str | None = None) -> dict:
    """One conversion in a fresh process; its row (from the report it writes and the child's rusage). ``profile``:
    a file for its thread profile (``bench/threadprof.py``)."""
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    runner = ["-m", "ckptconv"] if profile is None else [os.path.join(ROOT, "bench", "threadprof.py"), profile]
    wall, usage, code, out = _timed([python, *runner, "convert", src, dst, "--progress", "none", *flags],
                                    tree, _env(tree))
    cpu = usage["cpu_seconds"]
    if code:
        return {"error": out, "wall_seconds": round(wall, 2)}
    with open(os.path.join(dst, "ckptconv-report.json")) as f:
        report = json.load(f)
    shutil.rmtree(dst, ignore_errors=True)
    output = report["output_bytes"]
    return {"wall_seconds": round(wall, 2), "report_wall_seconds": report["wall_seconds"],
            "gib_per_s": round(output / GIB / wall, 3), "cpu_seconds": round(cpu, 1),
            "cores_used": round(cpu / wall, 2), **usage, "peak_rss_bytes": report["peak_rss_bytes"],
            "peak_rss_source": report.get("peak_rss_source", "VmHWM (older ckptconv)"),
            "predicted_peak_rss_bytes": report.get("predicted_peak_rss_bytes"),
            "workers": (report.get("run") or {}).get("workers"), "why": (report.get("run") or {}).get("why"),
            "data_files_by_device": report.get("data_files_by_device"), "compression": report.get("compression"),
            "output_bytes": output, "stage_seconds": report["stage_seconds"],
            "commit_lanes": (report.get("run") or {}).get("commit_lanes")}


def table(rows: list[dict], cp: float | None) -> str:
    head = ("run", "wall s", "GiB/s", "cores used", "peak GiB", "predicted GiB", "peak/pred", "x cp", "workers")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['label']} | failed: {row['error'].splitlines()[-1][:80]} |")
            continue
        predicted = row["predicted_peak_rss_bytes"]
        cells = (row["label"], f"{row['wall_seconds']:.1f}", f"{row['gib_per_s']:.2f}", f"{row['cores_used']:.1f}",
                 f"{row['peak_rss_bytes'] / GIB:.2f}", "-" if predicted is None else f"{predicted / GIB:.2f}",
                 "-" if predicted is None else f"{row['peak_rss_bytes'] / predicted:.2f}",
                 "-" if not cp else f"{row['wall_seconds'] / cp:.1f}", str(row["workers"] or "-"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    src = os.path.join(args.work, f"{args.model.lower()}-{args.layers}l")
    made = synthesise(args.python, args.model, args.layers, src, args.fast)
    cp = None if args.no_cp else cp_floor(src, args.work)
    host = {"cores": len(os.sched_getaffinity(0)), "python": args.python, "tree": args.tree,
            "synthesised_seconds": round(made, 1), "cp_seconds": None if cp is None else round(cp, 2)}
    print(f"# {args.model} with {args.layers} layers at {src}; {host['cores']} cores; cp -r && sync: "
          f"{'-' if cp is None else f'{cp:.1f} s'}", flush=True)
    rows = []
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    for spec in args.run or DEFAULT_RUNS:
        label, _, flags = spec.partition("=")
        for round_ in range(args.repeat):
            profile = None if not args.profile else os.path.join(args.profile, f"{label}-{round_}.json")
            row = {"label": label, "flags": flags, **convert(args.python, args.tree, src,
                                                              os.path.join(args.work, "out"), shlex.split(flags),
                                                              profile)}
            rows.append(row)
            print(table([row], cp).splitlines()[-1], flush=True)
    print(table(rows, cp))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host, "rows": rows}, f, indent=2)
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
