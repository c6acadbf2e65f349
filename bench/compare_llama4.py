"""Llama 4: ckptconv against MaxText 0.2.5's own Llama 4 converters, leaf by leaf, bit for bit.

    .venv/bin/python -m bench llama4 [--only scout,maverick]

Per case: a tiny random ``Llama4ForConditionalGeneration`` made by transformers' own class and
``save_pretrained`` (``bench/hf_tiny.py --class Llama4ForConditionalGeneration``, from the ``config.json``
``ckptconv.commands.synth`` writes: the hub's ``language_model.model.*`` names, fused experts, a one-layer
vision tower); MaxText's two scripts on it (``bench/maxtext_llama4_tiny.py``: their hub routes, 16 simulated
devices): ``llama4_ckpt_unscanned.py`` (unscanned) and ``llama_or_mistral_ckpt.py`` (scanned); ckptconv
unscanned on 1 and on 16 devices against the first, and scanned on 16 against the second and against the
first's leaves restacked as MaxText's llama4 scan holds them (``decoder/layers/layers_{i % 4}``, cycle
``i // 4`` on axis 1). Without ``--multimodal`` the unscanned script's vision leaves (``vision_encoder``) are
left out of the comparison; ckptconv ``--multimodal`` (vision model and projector) is compared with every leaf
of the unscanned script (the scanned script skips the vision model), unscanned on 1 and 16 devices and scanned
on 16 (its decoder restacked in cycles of 4; MaxText's vision layers are unscanned either way).
Prints the rows as JSON and a Markdown table for ``docs/bench/FAMILIES.md``. Work files: bench/work/llama4/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from bench import steps
from bench.steps import BENCH, error_line, run, setup_maxtext
from ckptconv.commands import synth

WORK = BENCH / "work" / "llama4"

SMALL = dict(vocab_size=128, num_experts=4, moe_intermediate_size=32, intermediate_size=96, tie_word_embeddings=False)
MODELS = {  # Maverick's pattern (dense and MoE layers alternate), Scout's (every layer MoE)
    "maverick": synth.SynthModel(model_type="llama4", num_layers=8, config_overrides={"interleave_moe_layer_step": 2},
                                 **SMALL),
    "scout": synth.SynthModel(model_type="llama4", num_layers=4, **SMALL),
}
# (ckptconv's layout, scan, devices, MaxText's output it is compared with, restacked in cycles of 4, --multimodal)
OURS = (("noscan-1dev", False, 1, "maxtext-unscanned", False, False),
        ("noscan-16dev", False, 16, "maxtext-unscanned", False, False),
        ("scan-16dev", True, 16, "maxtext-scanned", False, False),
        ("scan-16dev", True, 16, "maxtext-unscanned", True, False),
        ("multimodal-noscan-1dev", False, 1, "maxtext-unscanned", False, True),
        ("multimodal-noscan-16dev", False, 16, "maxtext-unscanned", False, True),
        ("multimodal-scan-16dev", True, 16, "maxtext-unscanned", True, True))
MAXTEXT_LAYOUTS = {("maxtext-unscanned", False): "llama4_ckpt_unscanned.py",
                   ("maxtext-scanned", False): "llama_or_mistral_ckpt.py (scanned)",
                   ("maxtext-unscanned", True): "llama4_ckpt_unscanned.py, restacked in cycles of 4"}
VISION = "params/params/vision_encoder"


def run_model(name: str, model: synth.SynthModel, ctx: dict) -> list[dict]:
    root = WORK / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(model.config()))
    made = steps.hf_tiny(root / "config.json", root / "hf", root / "hf_tiny.log", "--class",
                         "Llama4ForConditionalGeneration", env=ctx["mt_env"])
    if made.returncode:
        return [{"case": name, "error": error_line(made)}]
    for theirs, flags in (("maxtext-unscanned", []), ("maxtext-scanned", ["--scanned"])):
        made = run([ctx["mt_python"], BENCH / "maxtext_llama4_tiny.py", root / "hf", root / theirs, *flags],
                   root / f"{theirs}.log", ctx["mt_env"])
        if made.returncode:
            return [{"case": name, "error": f"MaxText ({theirs}): {error_line(made)}"}]
    rows = []
    for layout, scan, devices, theirs, restacked, multimodal in OURS:
        out = root / f"ckptconv-{layout}"
        if not out.exists():
            mine = steps.convert(root / "hf", out, root / f"ckptconv-{layout}.log", "--devices", devices,
                                 "--scan-layers" if scan else "--no-scan-layers", *(["--multimodal"] if multimodal else []))
            if mine.returncode:
                rows.append({"case": f"llama4-{name}-{layout}", "error": f"ckptconv: {error_line(mine)}"})
                continue
        row = {"case": f"llama4-{name}-{layout}", "layers": model.num_layers, "scan": scan, "devices": devices,
               "maxtext_layout": MAXTEXT_LAYOUTS[theirs, restacked]}
        restack = ["--stack-layers-of-b", "--cycle", "4"] if restacked else []
        result_file = root / f"compare-{layout}-{theirs}{'-restacked' if restacked else ''}.json"
        ignore = [] if multimodal else ["--ignore-in-b", VISION]
        _, result = steps.compare_outputs(out, root / theirs, result_file, result_file.with_suffix(".log"), *restack,
                                          *ignore, env=ctx["mt_env"])
        rows.append(row | {"identical": result["identical"], "leaves": result["leaves_compared"],
                           "bytes": result["bytes_compared"], "mismatches": result["value_mismatches"][:3],
                           "only_in_ckptconv": result["only_in_a"], "only_in_maxtext": result["only_in_b"],
                           "maxtext_vision_leaves_left_out": len(result["ignored_in_b"]),
                           "vision_leaves_compared": 0 if not multimodal else sum(
                               1 for leaf in result["leaves"] if leaf["leaf"].startswith(VISION)),
                           "metadata_differences": sorted({d["field"] for d in result["metadata_differences"]})})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| case | layers | scan | devices | MaxText's output | leaves | KiB | result | metadata that differs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | | | | | - | - | failed: `{r['error'][:150]}` | - |")
            continue
        result = "**identical**" if r["identical"] else f"DIFFERENT: {r['mismatches'] or r['only_in_maxtext']}"
        lines.append(f"| {r['case']} | {r['layers']} | {r['scan']} | {r['devices']} | {r['maxtext_layout']} "
                     f"| {r['leaves']} | {r['bytes'] / 1024:.0f} | {result} | "
                     f"{', '.join(r['metadata_differences']) or 'none'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model names: " + ", ".join(MODELS))
    args = parser.parse_args(argv)
    ctx = setup_maxtext()
    wanted = set(args.only.split(",")) if args.only else set(MODELS)
    rows = [row for name, model in MODELS.items() if name in wanted for row in run_model(name, model, ctx)]
    for row in rows:
        print(json.dumps(row), flush=True)
    (WORK / "results.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))
    return 0 if all(r.get("identical") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
