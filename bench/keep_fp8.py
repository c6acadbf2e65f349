"""``--dtype float8_e4m3fn`` (MaxText's ``--save_dtype float8_e4m3fn``): bytes, memory, and what MaxText writes.

    .venv/bin/python -m bench keep-fp8 [--keep] [--skip-maxtext]

1. Qwen3.5-397B-A17B-FP8 at its released widths (one period of 4 layers, 32 of its 512 experts; synthetic, the
   hub's layout): converted with ``--dtype bfloat16`` and ``--dtype float8_e4m3fn`` at 1 and 16 devices, each in
   a fresh process: output bytes, peak RSS (the conversion's own VmHWM) against the plan's prediction, wall;
2. the full Qwen3.5-35B-A3B-FP8 and -397B-A17B-FP8 planned from their published config.json (header-only
   files) with both dtypes: output bytes;
3. MaxText 0.2.5's own ``to_maxtext --save_dtype float8_e4m3fn`` on a tiny DeepSeek-V3 FP8 release: the dtypes of
   the leaves it writes and whether any holds a block scale (none: it drops them), beside ckptconv's scale leaves
   for the same release (``--deepseek-only``: this step alone, its section of --out replaced). MaxText's forward
   pass on ckptconv's kept DeepSeek checkpoints is ``python -m bench keep-fp8-deepseek``.

The leaf-by-leaf comparison with MaxText for Qwen3.5 is ``python -m bench families --only qwen3.5-fp8-keepfp8,...``
(docs/bench/FAMILIES.md). Writes docs/bench/KEEP-FP8.md; work files in bench/work/keep-fp8/ (deleted unless --keep).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench import steps
from bench.measure import convert, plan_of
from bench.steps import BENCH, DOCS, OFFLINE_ENV, setup_maxtext
from bench.widths import at_widths
from ckptconv.commands import synth
from tests.published_configs import QWEN3_5_35B_FP8, QWEN3_5_397B_FP8

WORK = BENCH / "work" / "keep-fp8"

GIB = 1024**3
DTYPES = ("bfloat16", "float8_e4m3fn")
MEASURED = {"qwen3.5-397b-fp8-widths-4-layers-32-experts": at_widths(QWEN3_5_397B_FP8, "qwen3_5_moe", 4, 32)}
PLANNED = {"Qwen3.5-35B-A3B-FP8": QWEN3_5_35B_FP8, "Qwen3.5-397B-A17B-FP8": QWEN3_5_397B_FP8}
DEEPSEEK_FP8 = synth.SynthModel(model_type="deepseek_v3", hidden_size=256, num_layers=3, num_heads=4, head_dim=16,
                                intermediate_size=320, moe_intermediate_size=192, num_experts=4, quantization="fp8",
                                vocab_size=300)

# run in MaxText's venv: every leaf's dtype and shape, restored with Orbax's public API
LIST_LEAVES = r"""
import json, sys
import numpy as np, jax, orbax.checkpoint as ocp
items = sys.argv[1]
ckpt = ocp.PyTreeCheckpointer()
meta = ckpt.metadata(items)
meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
tree = ckpt.restore(items, args=ocp.args.PyTreeRestore(restore_args=args))
flat = jax.tree_util.tree_flatten_with_path(tree)[0]
print(json.dumps({"/".join(str(getattr(k, "key", k)) for k in p): [str(np.asarray(v).dtype), list(np.shape(v))]
                  for p, v in flat}))
"""


def deepseek_under_maxtext(ctx: dict) -> dict:
    """MaxText's to_maxtext --save_dtype float8_e4m3fn on a DeepSeek-V3 FP8 release, and ckptconv's answer."""
    from bench.compare_families import Case, overrides

    root = WORK / "deepseek-v3-fp8"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf, theirs = root / "hf", root / "maxtext"
    synth.write_checkpoint(DEEPSEEK_FP8, str(hf), max_shard_bytes=1 << 20)
    ours = steps.convert(hf, root / "ckptconv", root / "ckptconv.log", "--dtype", "float8_e4m3fn")
    # unscanned: MaxText 0.2.5's to_maxtext fails on every scanned DeepSeek (README, docs/bench/FAMILIES.md)
    case = Case("deepseek-v3-fp8-keepfp8", DEEPSEEK_FP8, "deepseek3-671b", scan=False, dtype="float8_e4m3fn")
    mt = steps.maxtext_convert(case.maxtext_model, hf, theirs, overrides(case),
                               ["--lazy_load_tensors=true", "--simulated_cpu_devices_count=16",
                                "--save_dtype=float8_e4m3fn"], root / "maxtext.log", env=ctx["mt_env"])
    row = {"ckptconv_exit": ours.returncode, "maxtext_exit": mt.returncode}
    if ours.returncode:
        row["ckptconv_says"] = ours.stderr.strip().splitlines()[-1:]
    else:
        mine = _leaves(ctx, root / "ckptconv" / "0" / "items")
        row["ckptconv_scale_leaves"] = sum(1 for n in mine if n.endswith("_scale"))
    if mt.returncode:
        row["maxtext_error"] = mt.stderr.strip().splitlines()[-1:]
        return row
    leaves = _leaves(ctx, next(theirs.glob("**/items")))
    source_scales = sum(1 for name in json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
                        if name.endswith("_scale_inv"))
    by_dtype: dict[str, int] = {}
    for dtype, _ in leaves.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + 1
    row |= {"leaves": len(leaves), "by_dtype": by_dtype, "source_scale_tensors": source_scales,
            "scale_leaves": sorted(n for n in leaves if "scale" in n.rsplit("/", 1)[-1] and "norm" not in n),
            "e4m3_leaves": sorted(n for n, (dtype, _) in leaves.items() if dtype == "float8_e4m3fn")[:4]}
    return row


def _leaves(ctx: dict, items: Path) -> dict:
    """Every leaf's dtype and shape, read in MaxText's venv."""
    listed = subprocess.run([ctx["mt_python"], "-c", LIST_LEAVES, str(items)], capture_output=True, text=True,
                            env=ctx["mt_env"], check=True)
    return json.loads(listed.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--skip-maxtext", action="store_true")
    parser.add_argument("--reuse", metavar="LOG", help="take step 1's rows from an earlier run's printed lines")
    parser.add_argument("--out", default=str(DOCS / "KEEP-FP8.md"))
    parser.add_argument("--deepseek-only", action="store_true",
                        help="rerun step 3 alone and replace its section of an existing --out")
    args = parser.parse_args(argv)
    if args.deepseek_only:
        ctx = setup_maxtext()
        ctx["mt_env"] = {**ctx["mt_env"], **OFFLINE_ENV}
        deepseek = deepseek_under_maxtext(ctx)
        print(json.dumps({"deepseek": deepseek}), flush=True)
        out = Path(args.out)
        text = out.read_text()
        head = text[:text.index(DEEPSEEK_HEADING)] if DEEPSEEK_HEADING in text else text.rstrip("\n") + "\n\n"
        out.write_text(head + "\n".join(deepseek_section(deepseek) + CLOSING))
        return 0
    WORK.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {}
    plans: dict[str, list[dict]] = {}
    earlier = [json.loads(line) for line in Path(args.reuse).read_text().splitlines()
               if line.startswith("{")] if args.reuse else []
    for line in earlier:
        for name, value in line.items():
            if name in MEASURED:
                rows[name] = value
    for name, model in MEASURED.items() if not args.reuse else ():
        src = WORK / name
        shutil.rmtree(src, ignore_errors=True)
        synth.write_checkpoint(model, str(src), max_shard_bytes=5 * 10**9, fast=True)
        rows[name] = [convert(src, WORK / f"{name}-out", devices, dtype) | {"dtype": dtype}
                      for dtype in DTYPES for devices in (1, 16)]
        print(json.dumps({name: rows[name]}), flush=True)
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    for name, config in PLANNED.items():
        src = WORK / f"{name}-headers"
        shutil.rmtree(src, ignore_errors=True)
        model = synth.SynthModel(model_type="qwen3_5_moe", tie_word_embeddings=config["tie_word_embeddings"],
                                 config_overrides=dict(config["text_config"]), quantization="fp8")
        synth.write_checkpoint(model, str(src), max_shard_bytes=5 * 10**9, header_only=True)
        (src / "config.json").write_text(json.dumps(config))
        plans[name] = [plan_of(src, 16, dtype) | {"dtype": dtype} for dtype in DTYPES]
        keys = ("dtype", "source_bytes", "output_bytes", "predicted_peak_rss_bytes")
        print(json.dumps({name: [{k: p[k] for k in keys} for p in plans[name]]}))
        shutil.rmtree(src, ignore_errors=True)
    deepseek = None
    if not args.skip_maxtext:
        ctx = setup_maxtext()
        ctx["mt_env"] = {**ctx["mt_env"], **OFFLINE_ENV}
        deepseek = deepseek_under_maxtext(ctx)
        print(json.dumps({"deepseek": deepseek}), flush=True)
    write(rows, plans, deepseek, Path(args.out))
    if not args.keep:
        shutil.rmtree(WORK, ignore_errors=True)
    return 0 if all("error" not in r and r["peak_rss_bytes"] <= r["predicted_peak_rss_bytes"]
                    for runs in rows.values() for r in runs) else 1


def write(rows: dict, plans: dict, deepseek: dict | None, path: Path) -> None:
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [
        "# `--dtype float8_e4m3fn`: an FP8 release kept as FP8",
        "",
        f"Written by `python -m bench keep-fp8` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, 2 cores shared "
        "with other work. Peak RSS: the conversion process's own high-water mark (VmHWM); wall: from outside. "
        "Synthetic FP8 release in the hub's layout (e4m3 linear layers, bfloat16 128x128 block scales, experts one "
        "by one), one period of layers (3 linear-attention + 1 full), scanned, the released widths.",
        "",
        "| synthetic checkpoint (hub format) | --dtype | source | output | devices | peak RSS | predicted | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in rows.items():
        for r in runs:
            if "error" in r:
                lines.append(f"| {name} | {r['dtype']} | - | - | {r['devices']} | failed: `{r['error']}` | - | - |")
                continue
            lines.append(f"| {name} | {r['dtype']} | {gib(r['source_bytes'])} | {gib(r['output_bytes'])} "
                         f"| {r['devices']} | {gib(r['peak_rss_bytes'])} | {gib(r['predicted_peak_rss_bytes'])} "
                         f"| {r['wall_seconds']:.0f} s |")
    lines += ["", "| full release, published config.json, header-only files | --dtype | source | output "
                  "| output / bfloat16's | predicted peak RSS (16 devices) |", "|---|---|---|---|---|---|"]
    for name, runs in plans.items():
        wide = next(p["output_bytes"] for p in runs if p["dtype"] == "bfloat16")
        for p in runs:
            lines.append(f"| {name} | {p['dtype']} | {p['source_bytes'] / GIB:.1f} GiB "
                         f"| {p['output_bytes'] / GIB:.1f} GiB "
                         f"| {p['output_bytes'] / wide:.3f} | {gib(p['predicted_peak_rss_bytes'])} |")
    if deepseek is not None:
        lines += [""] + deepseek_section(deepseek)
    path.write_text("\n".join(lines + CLOSING))


DEEPSEEK_HEADING = "## MaxText 0.2.5 on a DeepSeek-V3 FP8 release with `--save_dtype float8_e4m3fn`"
CLOSING = ["", "The leaf-by-leaf comparison with MaxText's own `--save_dtype float8_e4m3fn` output is in "
               "docs/bench/FAMILIES.md (`qwen3.5-fp8-keepfp8*` rows, `python -m bench families`).", ""]


def deepseek_section(deepseek: dict) -> list[str]:
    return [DEEPSEEK_HEADING, "",
            f"Run on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. "
            "A tiny DeepSeek-V3 FP8 release (e4m3 linear layers with float32 128x128 `weight_scale_inv`), "
            "converted by MaxText's `to_maxtext` (model `deepseek3-671b` at the checkpoint's sizes, unscanned "
            "(its scanned DeepSeek conversion fails in any dtype), lazy loading, 16 devices), and by "
            "`ckptconv convert --dtype float8_e4m3fn`:", "", "```", json.dumps(deepseek, indent=2), "```", "",
            "MaxText's DeepSeek parameter mapping names no scale, so the release's `weight_scale_inv` tensors "
            "are never read: the e4m3 kernels are written without their block scales (`scale_leaves`: none), and "
            "MaxText's runtime (`dequantize_weight` with no scale) multiplies by raw e4m3 codes. ckptconv writes each "
            "scale beside its kernel (`ckptconv_scale_leaves`), where MaxText's `load_params_from_path` dequantises "
            "it: its forward pass on those checkpoints against transformers' logits is "
            "[KEEP-FP8-DEEPSEEK.md](KEEP-FP8-DEEPSEEK.md)."]


if __name__ == "__main__":
    sys.exit(main())
