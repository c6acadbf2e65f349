"""Restore several checkpoints of one model from gs:// in alternation and count what each restore asks the server for.

    nice -n 10 .venv/bin/python bench/restore_ab.py NAME=DIR [NAME=DIR ...] [--devices 16,1] [--repeats 3] [--latency-ms 20]

Each DIR is a converted checkpoint (holding ``0/items``), e.g. the ones bench/restore.py keeps under
bench/work/restore/ckpt/. Uses bench/restore.py's pieces: fake-gcs-server behind the counting proxy (``--latency-ms``:
every request held that long), one fresh child per restore, the checkpoints alternating within each round after one
uncounted warm-up each. Besides bench/restore.py's figures it splits the requests into data-file reads
(``.../d/<file>`` objects: the layout's part) and the rest (metadata, listings, existence probes: about the same for
any checkpoint). Prints a summary and writes every run to bench/work/restore/ab-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from bench.restore import GIB, WORK, Gcs, _now, restore_once  # noqa: E402


def data_reads(log: Path, start: int) -> list[str]:
    """The data-file reads between the restore marks after byte ``start`` of the proxy log (object and range)."""
    lines = log.read_text()[start:].splitlines()
    try:
        lines = lines[lines.index("MARK begin-restore") + 1: lines.index("MARK end-restore")]
    except ValueError:
        return []
    return [line.split(" ", 5)[5] for line in lines if line.startswith("REQ ") and "%2Fd%2F" in line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="NAME=DIR, DIR holding 0/items")
    parser.add_argument("--devices", default="16,1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--shard-of", type=int, default=0,
                        help="instead of restores, one host's reads: device 0's shard of every leaf of a checkpoint "
                             "written for this many devices (bench/restore.py's _shard child; --devices ignored)")
    parser.add_argument("--on-disk", action="store_true",
                        help="the server keeps the objects under bench/work/restore/gcs-root (GBs of checkpoints)")
    args = parser.parse_args(argv)
    named = dict(item.split("=", 1) for item in args.checkpoints)
    devices = [1] if args.shard_of else [int(d) for d in args.devices.split(",")]
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    results = {"command": "nice -n 10 .venv/bin/python bench/restore_ab.py " + " ".join(argv or sys.argv[1:]),
               "started_at": _now(), "latency_ms": args.latency_ms, "shard_of": args.shard_of, "runs": []}
    root = WORK / "gcs-root" if args.on_disk else None
    if root:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    gcs = Gcs(WORK / "logs", args.latency_ms, root)
    try:
        uris = {name: gcs.upload_tree(Path(directory) / "0" / "items", "restore-ab", f"{name}/0/items")
                for name, directory in named.items()}
        for name, uri in uris.items():
            restore_once(f"ab-{name}-warmup", uri, max(devices), gcs, shard_of=args.shard_of)
        for index in range(args.repeats):
            for n in devices:
                for name, uri in uris.items():
                    start = gcs.proxy_log.stat().st_size
                    row = restore_once(f"ab-{name}-{n}dev-{index}", uri, n, gcs, shard_of=args.shard_of)
                    reads = data_reads(gcs.proxy_log, start)
                    results["runs"].append({"checkpoint": name, "devices": n, "index": index, **row,
                                            "data_reads": len(reads), "data_files_read": len({r.split()[0] for r in reads})})
    finally:
        gcs.stop()
        if root:
            shutil.rmtree(root, ignore_errors=True)
        results["finished_at"] = _now()
        out = WORK / f"ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\n{results['command']}  (latency {args.latency_ms:g} ms per request; medians over {args.repeats} rounds"
          + (f"; device 0's shard of {args.shard_of} read by one host" if args.shard_of else "") + ")")
    print("| checkpoint | devices | requests (each run) | data-file reads (each run) | restore wall median (s) | walls (s) | peak RSS median (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for n in devices:
        for name in named:
            runs = [r for r in results["runs"] if (r["checkpoint"], r["devices"]) == (name, n) and not r["returncode"]]
            if not runs:
                continue
            reqs = [r["server"].get("requests", 0) for r in runs]
            walls = [r["restore_seconds"] for r in runs]
            print(f"| {name} | {n} | {statistics.median(reqs):.0f} ({', '.join(map(str, reqs))}) | "
                  f"{statistics.median(r['data_reads'] for r in runs):.0f} ({', '.join(str(r['data_reads']) for r in runs)}) | "
                  f"{statistics.median(walls):.2f} | {', '.join(f'{w:.2f}' for w in walls)} | "
                  f"{statistics.median(r['peak_rss_bytes'] for r in runs) / GIB:.2f} |")
    print(f"runs: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
