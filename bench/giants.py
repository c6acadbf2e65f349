"""The quantised giants at their real widths: measured conversions, and plans of the full models.

    .venv/bin/python bench/giants.py [--skip-convert] [--keep]

1. Converts synthetic checkpoints in the hub's formats at the released widths, with fewer layers
   and experts, at 1 and 16 devices, each in a fresh process (peak RSS: the conversion's own
   VmHWM; wall from outside):
   - DeepSeek-V3 widths (hidden 7168, MLA ranks 1536/512, MoE MLP 2048), 3 layers (1 dense),
     8 and 32 routed experts, FP8 with 128x128 block scales;
   - gpt-oss-120b widths (hidden 2880, 64 heads), 2 layers, 32 experts, MXFP4.
2. Plans the full DeepSeek-V3 (671B) and Kimi-K2 (1T) from their published config.json with
   header-only checkpoints (sparse files: the headers are real, the data is never written), and
   records the predicted peak and time.
Writes bench/GIANTS.md; work files under bench/work/giants/ (deleted unless --keep).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORK = BENCH / "work" / "giants"
sys.path.insert(0, str(REPO))

from ckptconv.commands import synth  # noqa: E402

GIB = 1024**3

from tests.published_configs import DEEPSEEK_V3, KIMI_K2  # noqa: E402


def published(config: dict) -> synth.SynthModel:
    """A SynthModel whose config.json is exactly ``config`` (its tensors follow from it)."""
    return synth.SynthModel(model_type=config["model_type"], quantization="fp8", config_overrides=dict(config))


def deepseek_widths(experts: int) -> synth.SynthModel:
    return synth.SynthModel(model_type="deepseek_v3", quantization="fp8", config_overrides={
        **DEEPSEEK_V3, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": experts,
        "num_nextn_predict_layers": 0})


def gpt_oss_widths() -> synth.SynthModel:
    return synth.SynthModel(model_type="gpt_oss", quantization="mxfp4", vocab_size=201088, hidden_size=2880,
                            num_layers=2, num_heads=64, num_kv_heads=8, head_dim=64, intermediate_size=2880,
                            num_experts=32, config_overrides={"rope_theta": 150000.0})


def convert(src: Path, dst: Path, devices: int, dtype: str = "bfloat16") -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", str(devices),
                           "--dtype", dtype, "--progress", "none"], capture_output=True, text=True)
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
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ckptconv", "plan", str(src), "--devices", str(devices), "--dtype",
                           dtype, "--json"], capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout), "plan_seconds": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-convert", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {}
    if not args.skip_convert:
        for name, model in (("deepseek-v3-widths-8-experts", deepseek_widths(8)),
                            ("deepseek-v3-widths-32-experts", deepseek_widths(32)),
                            ("gpt-oss-120b-widths-32-experts", gpt_oss_widths())):
            src = WORK / name
            synth.write_checkpoint(model, str(src), max_shard_bytes=5 * 10**9, fast=True)
            rows[name] = [convert(src, WORK / f"{name}-out", devices) for devices in (1, 16)]
            print(name, json.dumps(rows[name]), flush=True)
            if not args.keep:
                shutil.rmtree(src)
    plans = {}
    for name, config in (("DeepSeek-V3 (671B)", DEEPSEEK_V3), ("Kimi-K2 (1T)", KIMI_K2)):
        src = WORK / name.split()[0].lower()
        shutil.rmtree(src, ignore_errors=True)
        synth.write_checkpoint(published(config), str(src), max_shard_bytes=5 * 10**9, header_only=True)
        plans[name] = [plan_of(src, devices) for devices in (16, 1)]
        print(name, json.dumps({k: plans[name][0][k] for k in ("predicted_peak_rss_gib", "predicted_seconds",
                                                                  "source_bytes", "output_bytes", "plan_seconds")}),
              flush=True)
        shutil.rmtree(src)
    write(rows, plans, BENCH / "GIANTS.md")
    return 0


def write(rows: dict, plans: dict, path: Path) -> None:
    lines = ["# The quantised giants: measured at their widths, planned at full size", "",
             f"Written by `bench/giants.py` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{os.cpu_count()} cores. Peak RSS: the conversion process's own high-water mark (VmHWM); wall: "
             "from outside, start to exit.", ""]
    if rows:
        lines += ["| synthetic checkpoint (hub format) | source | output | devices | peak RSS | predicted | wall |",
                  "|---|---|---|---|---|---|---|"]
        for name, runs in rows.items():
            for r in runs:
                if "error" in r:
                    lines.append(f"| {name} | | | {r['devices']} | failed: {r['error']} | | |")
                    continue
                lines.append(f"| {name} | {r['source_bytes'] / GIB:.2f} GiB | {r['output_bytes'] / GIB:.2f} GiB | "
                             f"{r['devices']} | {r['peak_rss_bytes'] / GIB:.2f} GiB | "
                             f"{r['predicted_peak_rss_bytes'] / GIB:.2f} GiB | {r['wall_seconds']:.0f} s |")
        lines.append("")
    lines += ["| full model, published config.json, header-only files | source | output | devices | "
              "predicted peak RSS | predicted time (2 cores) | plan took |", "|---|---|---|---|---|---|---|"]
    for name, runs in plans.items():
        for p in runs:
            lines.append(f"| {name} | {p['source_bytes'] / GIB:.0f} GiB | {p['output_bytes'] / GIB:.0f} GiB | "
                         f"{p['devices']} | {p['predicted_peak_rss_gib']:.2f} GiB | "
                         f"{p['predicted_seconds'] / 3600:.1f} h | {p['plan_seconds']:.1f} s |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
