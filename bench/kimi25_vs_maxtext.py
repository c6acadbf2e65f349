"""Kimi-K2.5 / K2.6 (``kimi_k25``): ckptconv against MaxText 0.2.5's standalone Kimi script, leaf by leaf;
writes its section of docs/bench/GIANTS.md.

    .venv/bin/python -m bench kimi25 [--keep]

A tiny random release in the hub's layout (``ckptconv.commands.synth``: ``language_model.`` names,
``text_config``, routed experts in compressed-tensors INT4, a vision tower and projector beside) is converted
by MaxText's ``convert_deepseek_family_ckpt.py`` (scanned, 16 simulated devices) and
``convert_deepseek_family_unscanned_ckpt.py`` (1 device) as ``kimi-k2.5-text`` (``bench/maxtext_kimi25.py``
gives them the tiny sizes), and by ckptconv with the same layouts in float32 and bfloat16. MaxText's scripts
write every leaf float16: ours must be theirs upcast wherever float16 holds the value, and round to theirs
elsewhere (values below float16's normal range). Work files under bench/work/kimi25/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from bench import steps
from bench.steps import BENCH, DOCS, last_json, run, setup_maxtext
from ckptconv.commands import synth

WORK = BENCH / "work" / "kimi25"

MODEL = synth.SynthModel(model_type="kimi_k25", hidden_size=512, num_layers=3, num_heads=8, head_dim=32,
                         intermediate_size=640, moe_intermediate_size=256, num_experts=8, quantization="int4",
                         vocab_size=1000, extra_tensors={"vision_tower.patch_embed.proj.weight": (64, 3, 14, 14),
                                                         "mm_projector.proj.0.weight": (256, 256)})
LAYOUTS = (("scanned", 16), ("unscanned", 1))
SECTION = "## Kimi-K2.5 / K2.6 against MaxText 0.2.5's standalone script"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the work files")
    args = parser.parse_args(argv)
    ctx = setup_maxtext()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    hf = WORK / "hf"
    synth.write_checkpoint(MODEL, str(hf))
    rows = []
    for layout, devices in LAYOUTS:
        theirs = WORK / f"maxtext-{layout}"
        start = time.monotonic()
        made = run([ctx["mt_python"], BENCH / "maxtext_kimi25.py", "convert", hf, theirs, layout, devices],
                   WORK / f"maxtext-{layout}.log", ctx["mt_env"])
        their_wall = time.monotonic() - start
        if made.returncode:
            rows.append({"layout": layout, "devices": devices, "error": made.stderr.strip().splitlines()[-1][:200]})
            continue
        for dtype in ("float32", "bfloat16"):
            ours = WORK / f"ckptconv-{layout}-{dtype}"
            converted = steps.convert(hf, ours, WORK / f"{ours.name}.log", *steps.layout(layout == "scanned", devices, dtype))
            assert converted.returncode == 0, converted.stderr
            report = json.loads((ours / "ckptconv-report.json").read_text())
            compared = run([ctx["mt_python"], BENCH / "maxtext_kimi25.py", "compare", ours, theirs],
                           WORK / f"compare-{layout}-{dtype}.log", ctx["mt_env"])
            row = {"layout": layout, "devices": devices, "dtype": dtype, **last_json(compared),
                   "peak_rss_bytes": report["peak_rss_bytes"], "wall_seconds": report["wall_seconds"],
                   "maxtext_wall_seconds": their_wall,
                   "not_converted": [e["what"] for e in report["not_converted"]]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    (WORK / "results.json").write_text(json.dumps(rows, indent=2))
    write(rows, DOCS / "GIANTS.md")
    if not args.keep:
        for path in WORK.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
    return 0 if all("error" not in r and not r["not_f16_rounding"] and not r["only_in_ours"]
                    and not r["only_in_theirs"] and r["differing"] == r["differing_outside_f16_range"]
                    for r in rows) else 1


def write(rows: list[dict], path: Path) -> None:
    """Replace this script's section of GIANTS.md (the other sections stay as they are)."""
    t = MODEL.config()["text_config"]
    lines = [SECTION, "",
             f"Written by `python -m bench kimi25` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{os.cpu_count()} cores. A random release in the hub's layout (`language_model.` names, `text_config`, "
             f"hidden {t['hidden_size']}, {t['num_hidden_layers']} layers ({t['first_k_dense_replace']} dense), "
             f"{t['n_routed_experts']} routed experts of {t['moe_intermediate_size']} in compressed-tensors INT4, a "
             "vision tower and projector beside) converted by MaxText's `convert_deepseek_family_ckpt.py` (scanned) "
             "and `convert_deepseek_family_unscanned_ckpt.py` as `kimi-k2.5-text` (its table's sizes replaced by "
             "the checkpoint's: `bench/maxtext_kimi25.py`) and by `ckptconv convert`. MaxText's scripts write every "
             "leaf float16 (the INT4 experts decoded to bfloat16 first); compared upcast to ours. \"f16 rounding\": "
             "every leaf of theirs is exactly ours rounded to float16; the elements that differ are all below "
             "float16's normal range (its subnormals hold fewer bits). Both write the router bias under "
             "`params/params`; neither writes the vision tensors.", "",
             "| layout | devices | ckptconv --dtype | leaves (step included) | elements "
             "| differing (all below f16's normal range) | max abs diff | max rel diff | theirs = ours rounded to f16 | ckptconv peak RSS | ckptconv wall "
             "| MaxText wall |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['devices']} | | MaxText failed: `{r['error']}` | | | | | | | | |")
            continue
        same = not r["not_f16_rounding"] and not r["only_in_ours"] and not r["only_in_theirs"]
        lines.append(f"| {r['layout']} | {r['devices']} | {r['dtype']} | {r['leaves']} | {r['elements']} | "
                     f"{r['differing']} ({r['differing_outside_f16_range']}) | {r['max_abs_diff']:.3g} | "
                     f"{r['max_rel_diff']:.3g} | {'yes' if same else 'NO: ' + str(r['not_f16_rounding'][:3])} | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} GiB | {r['wall_seconds']:.1f} s | "
                     f"{r['maxtext_wall_seconds']:.0f} s |")
    text = path.read_text() if path.exists() else ""
    kept = re.split(rf"\n{re.escape(SECTION)}\n", text)[0].rstrip("\n")
    tail = re.search(rf"\n{re.escape(SECTION)}\n.*?(\n## .*)", text, re.S)
    path.write_text(kept + "\n\n" + "\n".join(lines) + "\n" + (tail.group(1) if tail else ""))


if __name__ == "__main__":
    sys.exit(main())
