"""Qwen3-Next and Qwen3.5 at their released widths: measured conversions, and plans of the full models.

    .venv/bin/python bench/hybrid_memory.py [--keep]

1. Converts synthetic checkpoints (the hub's names: Qwen3.5's projections apart and experts fused)
   at the released widths with one period of layers and fewer experts, at 1 and 16 devices, each in
   a fresh process (peak RSS: the conversion's own VmHWM, from its report; wall from outside), and
   compares the plan's predicted peak with it;
2. plans the full Qwen3-Next-80B-A3B, Qwen3.5-35B-A3B and Qwen3.5-397B-A17B (512 experts a layer)
   from their published config.json with header-only checkpoints (sparse files).
Writes bench/HYBRID-MEMORY.md; work files under bench/work/hybrid-memory/ (deleted unless --keep).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORK = BENCH / "work" / "hybrid-memory"
sys.path.insert(0, str(REPO))

from bench.giants import convert, plan_of  # noqa: E402
from ckptconv.commands import synth  # noqa: E402
from tests.published_configs import QWEN3_5_35B, QWEN3_5_397B, QWEN3_5_397B_FP8, QWEN3_NEXT_80B  # noqa: E402

GIB = 1024**3


def at_widths(config: dict, family: str, layers: int, experts: int) -> synth.SynthModel:
    """The release's widths with ``layers`` layers and ``experts`` experts a layer (its FP8 release if the
    config has a quantization_config: e4m3 weights, bfloat16 block scales)."""
    text = config.get("text_config", config)
    overrides = {**text, "num_hidden_layers": layers, "num_experts": experts}
    if "layer_types" in text:
        overrides["layer_types"] = text["layer_types"][:layers]
    return synth.SynthModel(model_type=family, tie_word_embeddings=False, config_overrides=overrides,
                            quantization="fp8" if "quantization_config" in config else None)


MEASURED = {  # name: (model, what)
    "qwen3-next-80b-widths-4-layers-64-experts": at_widths(QWEN3_NEXT_80B, "qwen3_next", 4, 64),
    "qwen3.5-397b-widths-4-layers-32-experts": at_widths(QWEN3_5_397B, "qwen3_5_moe", 4, 32),
    "qwen3.5-397b-fp8-widths-4-layers-32-experts": at_widths(QWEN3_5_397B_FP8, "qwen3_5_moe", 4, 32),
}
PLANNED = {"Qwen3-Next-80B-A3B": (QWEN3_NEXT_80B, "qwen3_next"), "Qwen3.5-35B-A3B": (QWEN3_5_35B, "qwen3_5_moe"),
           "Qwen3.5-397B-A17B": (QWEN3_5_397B, "qwen3_5_moe"),
           "Qwen3.5-397B-A17B-FP8": (QWEN3_5_397B_FP8, "qwen3_5_moe")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--out", default=str(BENCH / "HYBRID-MEMORY.md"))
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {}
    for name, model in MEASURED.items():
        src = WORK / name
        shutil.rmtree(src, ignore_errors=True)
        synth.write_checkpoint(model, str(src), max_shard_bytes=5 * 10**9, fast=True)
        rows[name] = [convert(src, WORK / f"{name}-out", devices) for devices in (1, 16)]
        print(json.dumps({name: rows[name]}), flush=True)
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    plans: dict[str, list[dict]] = {}
    for name, (config, family) in PLANNED.items():
        src = WORK / f"{name}-headers"
        shutil.rmtree(src, ignore_errors=True)
        model = synth.SynthModel(model_type=family, tie_word_embeddings=config["tie_word_embeddings"],
                                 config_overrides=dict(config.get("text_config", config)),
                                 quantization="fp8" if "quantization_config" in config else None)
        synth.write_checkpoint(model, str(src), max_shard_bytes=5 * 10**9, header_only=True)
        (src / "config.json").write_text(json.dumps(config))
        plans[name] = [plan_of(src, devices) | {"devices": devices} for devices in (16, 1)]
        print(json.dumps({name: {k: plans[name][0][k] for k in ("predicted_peak_rss_bytes", "source_bytes")}}))
        shutil.rmtree(src, ignore_errors=True)
    write(rows, plans, Path(args.out))
    ok = all("error" not in r and r["peak_rss_bytes"] <= r["predicted_peak_rss_bytes"] <= 1.5 * GIB
             for runs in rows.values() for r in runs)
    return 0 if ok else 1


def write(rows: dict, plans: dict, path: Path) -> None:
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [
        "# Qwen3-Next and Qwen3.5: measured at their widths, planned at full size",
        "",
        f"Written by `bench/hybrid_memory.py` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, 2 cores shared "
        "with other work. Peak RSS: the conversion process's own high-water mark (VmHWM); wall: from outside. "
        "Synthetic checkpoints in the hub's layout (Qwen3.5: `in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a` "
        "apart, experts fused (experts, 2 x 1024, 4096); its FP8 release: e4m3 linear layers with bfloat16 "
        "128x128 block scales, experts one by one, kept quantised), one period of layers (3 linear-attention + "
        "1 full), scanned; the released vocabulary, hidden size, heads and expert widths.",
        "",
        "| synthetic checkpoint (hub format) | source | output | devices | peak RSS | predicted | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in rows.items():
        for r in runs:
            if "error" in r:
                lines.append(f"| {name} | - | - | {r['devices']} | failed: `{r['error']}` | - | - |")
                continue
            lines.append(f"| {name} | {gib(r['source_bytes'])} | {gib(r['output_bytes'])} | {r['devices']} "
                         f"| {gib(r['peak_rss_bytes'])} | {gib(r['predicted_peak_rss_bytes'])} "
                         f"| {r['wall_seconds']:.0f} s |")
    lines += ["", "| full model, published config.json, header-only files | source | output | devices "
                  "| predicted peak RSS | predicted time (2 cores) | largest read | plan took |",
              "|---|---|---|---|---|---|---|---|"]
    for name, runs in plans.items():
        for p in runs:
            lines.append(f"| {name} | {p['source_bytes'] / GIB:.0f} GiB | {p['output_bytes'] / GIB:.0f} GiB "
                         f"| {p['devices']} | {gib(p['predicted_peak_rss_bytes'])} "
                         f"| {p['predicted_seconds'] / 3600:.1f} h | {p['largest_read_bytes'] / 2**20:.0f} MiB "
                         f"| {p['plan_seconds']} s |")
    lines += ["", "The model's `mtp.*` and (Qwen3.5) `model.visual.*` tensors are not in these synthetic files; "
                  "a real release's are read from the headers only and reported.", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
