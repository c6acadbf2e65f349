"""DeepSeek-V4-Flash: ckptconv against MaxText 0.2.5's ``to_maxtext`` (``deepseek4-284b``), leaf by leaf; writes
the V4 section of docs/bench/GIANTS.md and the recorded leaves of the family's ``maxtext`` logit example.

    .venv/bin/python -m bench deepseek-v4 [--only hub|synth]

Two checkpoints:
- ``hub``: a random release in the hub's own layout and formats (``bench/hf_tiny_v4.py``, MaxText's venv: FP8 e4m3
  linear layers with ue8m0 ``.scale`` blocks, FP4 experts, int64 ``tid2eid``; names checked by transformers' own
  DeepseekV4ForCausalLM on its bfloat16 copy). MaxText's route: its ``deepseek_dequantize.py`` to bfloat16, then
  ``to_maxtext``; ckptconv reads the FP8/FP4 files directly.
- ``synth``: the family's ``deepseek_v4-maxtext`` logit example as ``ckptconv.commands.synth`` writes it (bfloat16).
  MaxText's leaves of it are recorded (shape, dtype, SHA-256) in tests/data/maxtext_leaves/ for
  tests/test_maxtext_leaves.py.

Each is converted scanned on 16 simulated devices and unscanned on 1 by ckptconv, and by MaxText on 16 both times (for V4
its ``to_maxtext`` fails to save from 1 simulated device, where it skips the JAX conversion: Orbax finds no handler
for the TrainState; its qwen3_moe and gemma3 conversions do save from 1 device, docs/bench/FAMILIES.md); MaxText's sizes come from the checkpoint (``bench/maxtext_convert_tiny.py``, eager loading). Compared with ``bench/compare_outputs.py`` with MaxText's
``MoEBiasVar`` router bias and ``Tid2EidVar`` table read where ckptconv writes them (``params/params``, where every
MaxText 0.2.5 loader finds them: docs/bench/LOADERS.md): that is the only difference allowed.
Work files: bench/work/deepseek_v4/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.maxtext_loaders imports this by path too

from bench import steps  # noqa: E402
from bench.steps import BENCH, DOCS, REPO, setup_maxtext  # noqa: E402
from ckptconv.commands import synth  # noqa: E402
from ckptconv.families import deepseek_v4  # noqa: E402

WORK = BENCH / "work" / "deepseek_v4"

# MaxText's router bias and tid2eid collections, read where ckptconv writes them (README; docs/bench/LOADERS.md)
MOVED = ["--moved-in-b", "params/MoEBiasVar=params/params", "--moved-in-b", "params/Tid2EidVar=params/params"]
BEGIN, END = "<!-- deepseek_v4: begin (`python -m bench deepseek-v4`) -->", "<!-- deepseek_v4: end -->"

DIGESTS = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[3])
import numpy as np
from compare_outputs import items_dir, leaf_metadata, restore_leaf
items = items_dir(sys.argv[1])
out = {}
for path, meta in leaf_metadata(items).items():
    if path == ("step",):
        continue
    value = np.ascontiguousarray(restore_leaf(items, path, meta))
    if path[:2] in (("params", "MoEBiasVar"), ("params", "Tid2EidVar")):
        path = ("params", "params") + path[2:]
    out["/".join(path)] = {"shape": list(value.shape), "dtype": str(value.dtype),
                           "sha256": hashlib.sha256(value.tobytes()).hexdigest()}
json.dump(out, open(sys.argv[2], "w"), indent=1, sort_keys=True)
"""


def v4_overrides(c: dict, scan: bool) -> dict:
    """MaxText config overrides giving its deepseek4-284b model the checkpoint's sizes (also ``python -m bench loaders``)."""
    return {"base_emb_dim": c["hidden_size"], "base_num_query_heads": c["num_attention_heads"],
            "base_num_kv_heads": 1, "base_num_decoder_layers": c["num_hidden_layers"],
            "base_moe_mlp_dim": c["moe_intermediate_size"], "base_mlp_dim": c["moe_intermediate_size"],
            "vocab_size": c["vocab_size"], "head_dim": c["head_dim"], "qk_rope_head_dim": c["qk_rope_head_dim"],
            "num_experts": c["n_routed_experts"], "num_experts_per_tok": c["num_experts_per_tok"],
            "q_lora_rank": c["q_lora_rank"], "o_groups": c["o_groups"], "o_lora_rank": c["o_lora_rank"],
            "indexer_head_dim": c["index_head_dim"], "indexer_n_heads": c["index_n_heads"],
            "indexer_topk": c["index_topk"], "sliding_window_size": c["sliding_window"],
            "compress_ratios": "[" + ",".join(map(str, c["compress_ratios"])) + "]",
            "first_num_hash_layers": c["num_hash_layers"], "mhc_expansion_rate": c["hc_mult"],
            "attention": "dot_product",  # MaxText refuses deepseek4 with its default attention on CPU
            "scan_layers": str(scan).lower()}


def overrides(c: dict, scan: bool) -> list[str]:
    """The same, as MaxText's command-line ``key=value`` arguments."""
    return [f"{k}={v}" for k, v in v4_overrides(c, scan).items()]


def run(cmd: list, log: Path, env: dict | None = None) -> tuple[int, float]:
    """A step in a fresh process (its output in ``log``): its exit status and wall seconds."""
    done, seconds = steps.timed(cmd, log, env)
    return done.returncode, seconds


def last_error(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if "Error" in line and not line.startswith(" ")]
    return (lines[-1] if lines else log.read_text().splitlines()[-1])[:220]


def compare(ctx: dict, ours: Path, theirs: Path, out: Path) -> dict:
    _, result = steps.compare_outputs(ours, theirs, out, out.with_suffix(".log"), *MOVED, env=ctx["mt_env"])
    return {"identical": result["identical"], "leaves": result["leaves_compared"],
            "mib": result["bytes_compared"] / 2**20, "mismatches": result["value_mismatches"][:3],
            "only": (result["only_in_a"] + result["only_in_b"])[:3]}


def case(ctx: dict, name: str, hf: Path, maxtext_input: Path, config: dict) -> list[dict]:
    rows = []
    for scan, devices in ((True, 16), (False, 1)):
        layout = "scanned" if scan else "unscanned"
        root = WORK / name / layout
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        ours, theirs = root / "ckptconv", root / "maxtext"
        mine, mine_s = run(steps.convert_cmd(hf, ours, "--devices", devices,
                                             "--scan-layers" if scan else "--no-scan-layers"),
                           root / "ckptconv.log", steps.CONVERT_ENV)
        # MaxText on 16 devices either way: for V4 on 1 device its to_maxtext (which skips the JAX conversion there)
        # fails to save (orbax NoEntryError for the TrainState); values do not depend on the device count
        their, their_s = run(steps.maxtext_convert_cmd("deepseek4-284b", maxtext_input, theirs, overrides(config, scan),
                                                       ["--simulated_cpu_devices_count=16"]),
                             root / "maxtext.log", ctx["mt_env"])
        row = {"case": name, "layout": layout, "devices": devices, "ckptconv_exit": mine, "ckptconv_s": mine_s,
               "maxtext_exit": their, "maxtext_s": their_s}
        if their:
            row["maxtext_error"] = last_error(root / "maxtext.log")
        if not mine and not their:
            row |= compare(ctx, ours, theirs, root / "compare.json")
            if name == "synth" and scan:
                record = root / "maxtext-leaves.json"
                code, _ = run([ctx["mt_python"], "-c", DIGESTS, str(theirs), str(record), str(BENCH)],
                              root / "digests.log", ctx["mt_env"])
                if not code:
                    example = deepseek_v4.SYNTHETIC.logits[0]
                    data = {"example": example.name, "config": config, "maxtext": ctx["mt_versions"]["maxtext"],
                            "moved": "params/MoEBiasVar -> params/params, params/Tid2EidVar -> params/params",
                            "leaves": json.loads(record.read_text())}
                    (REPO / "tests" / "data" / "maxtext_leaves" / f"{example.name}.json").write_text(
                        json.dumps(data, indent=1, sort_keys=True) + "\n")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def write(rows: list[dict], ctx: dict) -> None:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [BEGIN, "", "## DeepSeek-V4-Flash against MaxText 0.2.5's to_maxtext", "",
             f"Written by `python -m bench deepseek-v4` on {now}, 2 cores shared; MaxText "
             f"{ctx['mt_versions']['maxtext']} (`deepseek4-284b`, its sizes replaced by the checkpoint's: "
             "`bench/maxtext_convert_tiny.py`; `attention=dot_product`, which its config demands on CPU). "
             "`hub`: a random release in the hub's layout (`bench/hf_tiny_v4.py`: reference names, FP8 e4m3 "
             "linear layers with ue8m0 `.scale` blocks, FP4 e2m1 experts, int64 `tid2eid`; hidden 128, 4 heads of "
             "64, 5 layers with compress ratios [0, 0, 4, 128, 4], 3 hash layers, 8 experts), converted by MaxText "
             "after its own `deepseek_dequantize.py` and by ckptconv from the FP8/FP4 files. `synth`: the family's "
             "`deepseek_v4-maxtext` example (bfloat16, as `ckptconv.commands.synth` writes it), whose MaxText "
             "leaves tests/test_maxtext_leaves.py checks against. Compared bit for bit with MaxText's `MoEBiasVar` "
             "router bias and `Tid2EidVar` tables read where ckptconv writes them (`params/params`, where both of "
             "MaxText's loaders find them: docs/bench/LOADERS.md); nothing else differs. MaxText converts on 16 "
             "simulated devices for both layouts: from 1 device (where it skips the JAX conversion) its V4 save fails "
             "(orbax `NoEntryError`: no handler for the `TrainState`), as it did twice here, eager and lazy loading; "
             "its qwen3_moe and gemma3 conversions save from 1 device (docs/bench/FAMILIES.md).", "",
             "| checkpoint | layout | ckptconv devices | leaves compared | MiB | result | ckptconv wall | MaxText wall (16 devices) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "identical" in r:
            result = "bit-identical" if r["identical"] else f"DIFFERENT {r['mismatches']} {r['only']}"
            lines.append(f"| {r['case']} | {r['layout']} | {r['devices']} | {r['leaves']} | {r['mib']:.1f} | "
                         f"{result} | {r['ckptconv_s']:.0f} s | {r['maxtext_s']:.0f} s |")
        else:
            why = f"MaxText fails: `{r.get('maxtext_error', '')}`" if r["maxtext_exit"] else "ckptconv failed"
            lines.append(f"| {r['case']} | {r['layout']} | {r['devices']} | - | - | {why} | {r['ckptconv_s']:.0f} s "
                         f"(exit {r['ckptconv_exit']}) | {r['maxtext_s']:.0f} s |")
    lines += ["", END]
    path = DOCS / "GIANTS.md"
    text = path.read_text()
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + "\n".join(lines) + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("hub", "synth"), help="rerun one checkpoint, keep the other's rows")
    only = parser.parse_args(argv).only
    ctx = setup_maxtext()
    WORK.mkdir(parents=True, exist_ok=True)
    saved = WORK / "rows.json"
    kept = [r for r in json.loads(saved.read_text()) if r["case"] != only] if only and saved.exists() else []
    hub, deq, made = WORK / "hub-fp8", WORK / "hub-bf16", WORK / "synth-hf"
    for directory in (hub, deq, made):
        shutil.rmtree(directory, ignore_errors=True)
    for cmd, log in (([ctx["mt_python"], str(BENCH / "hf_tiny_v4.py"), str(WORK / "hub-check"), "--bf16"], "check"),
                     ([ctx["mt_python"], str(BENCH / "hf_tiny_v4.py"), str(hub)], "hub"),
                     (steps.mt_step("maxtext_dequantize.py", "fp8", hub, deq), "deq")):
        code, _ = run(cmd, WORK / f"{log}.log", ctx["mt_env"])
        if code:
            raise SystemExit(f"{' '.join(cmd)} failed: see {WORK / f'{log}.log'}")
    model = synth.for_family(deepseek_v4.FAMILY, deepseek_v4.SYNTHETIC.logits[0].model)
    synth.write_checkpoint(model, str(made))
    rows = kept
    if only in (None, "hub"):
        rows += case(ctx, "hub", hub, deq, json.loads((hub / "config.json").read_text()))
    if only in (None, "synth"):
        rows += case(ctx, "synth", made, made, model.config())
    rows.sort(key=lambda r: (r["case"] != "hub", r["layout"]))
    saved.write_text(json.dumps(rows, indent=1))
    write(rows, ctx)
    return 0 if all(r.get("identical") or r["maxtext_exit"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
