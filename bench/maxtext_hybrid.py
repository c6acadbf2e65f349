"""MaxText 0.2.5's own forward pass on ckptconv's Qwen3-Next / Qwen3.5 checkpoints; writes ``docs/bench/HYBRID.md``.

    bash bench/maxtext_env.sh    # once: MaxText 0.2.5's venv (or MAXTEXT_PYTHON=/path/to/its/python)
    .venv/bin/python -m bench hybrid [--only qwen3-next-scan,...]

Per case: a tiny random model made with transformers' own class, stored as the hub ships it
(``tests/hub_checkpoints.py``), and its float32 logits; then ``ckptconv convert --dtype float32
--devices 1`` and MaxText's own ``to_maxtext`` (``--save_dtype=float32``, through
``bench/maxtext_convert_tiny.py``) on the same files; then, in a fresh process of MaxText's venv for
each, ``model_creation_utils.from_pretrained`` and one forward pass, logits against transformers'.
MaxText's Gated DeltaNet runs a chunked float32 recurrence, so its logits differ from transformers'
by more than other families' do; the bar is MaxText's own conversion: ckptconv's checkpoint must
do no worse (and <= 1e-4 where MaxText's own does). Work files go to bench/work/hybrid/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path as a step in MaxText's venv: bench, tests
from bench import forward, steps  # noqa: E402
from bench.steps import BENCH, DOCS, MT_PYTHON, error_line, last_json, run  # noqa: E402

WORK = BENCH / "work" / "hybrid"
TOLERANCE = 1e-4
TOKENS = [3, 17, 101, 42, 7, 90, 9, 64, 5, 77, 120, 33]


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # qwen3_next | qwen3_5_moe
    maxtext_model: str
    scan: bool
    layers: int = 8
    fp8: bool = False  # the FP8 release, kept quantised (MaxText's qwen3.5-*-fp8 model, weight_dtype float8)
    dtype: str = "float32"  # both converters' output dtype (float8_e4m3fn: the FP8 release's e4m3 kept as stored)

    def config(self) -> dict:
        from tests import hub_checkpoints

        if self.fp8:
            return hub_checkpoints.qwen3_5_moe_fp8_config(num_hidden_layers=self.layers)
        make = hub_checkpoints.qwen3_next_config if self.family == "qwen3_next" else hub_checkpoints.qwen3_5_moe_config
        return make(num_hidden_layers=self.layers)


CASES = [
    Case("qwen3-next-scan", "qwen3_next", "qwen3-next-80b-a3b", True),
    Case("qwen3-next-noscan", "qwen3_next", "qwen3-next-80b-a3b", False),
    Case("qwen3-next-scan-remainder", "qwen3_next", "qwen3-next-80b-a3b", True, layers=6),
    Case("qwen3.5-scan", "qwen3_5_moe", "qwen3.5-35b-a3b", True),
    Case("qwen3.5-noscan", "qwen3_5_moe", "qwen3.5-35b-a3b", False),
    Case("qwen3.5-fp8-scan", "qwen3_5_moe", "qwen3.5-35b-a3b-fp8", True, layers=4, fp8=True),
    Case("qwen3.5-fp8-noscan", "qwen3_5_moe", "qwen3.5-35b-a3b-fp8", False, layers=4, fp8=True),
    Case("qwen3.5-fp8-keepfp8-scan", "qwen3_5_moe", "qwen3.5-35b-a3b-fp8", True, layers=4, fp8=True,
         dtype="float8_e4m3fn"),
    Case("qwen3.5-fp8-keepfp8-noscan", "qwen3_5_moe", "qwen3.5-35b-a3b-fp8", False, layers=4, fp8=True,
         dtype="float8_e4m3fn"),
]


def overrides(config: dict, scan: bool, **extra) -> dict:
    """MaxText config overrides giving its model the checkpoint's sizes (float32, exact matmuls)."""
    t = config.get("text_config", config)
    rope = t.get("rope_parameters", {})
    sections = {"mrope_section": json.dumps(rope["mrope_section"]).replace(" ", "")} if "mrope_section" in rope else {}
    return {"base_emb_dim": t["hidden_size"], "base_num_query_heads": t["num_attention_heads"],
            "base_num_kv_heads": t["num_key_value_heads"], "head_dim": t["head_dim"],
            "base_mlp_dim": t["moe_intermediate_size"], "base_moe_mlp_dim": t["moe_intermediate_size"],
            "base_num_decoder_layers": t["num_hidden_layers"], "vocab_size": t["vocab_size"],
            "num_experts": t["num_experts"], "num_experts_per_tok": t["num_experts_per_tok"], "shared_experts": 1,
            "inhomogeneous_layer_cycle_interval": t["full_attention_interval"],
            "gdn_num_key_heads": t["linear_num_key_heads"], "gdn_num_value_heads": t["linear_num_value_heads"],
            "gdn_key_head_dim": t["linear_key_head_dim"], "gdn_value_head_dim": t["linear_value_head_dim"],
            "gdn_conv_kernel_dim": t["linear_conv_kernel_dim"],
            "rope_max_timescale": int(rope.get("rope_theta", t.get("rope_theta", 10000))),
            "partial_rotary_factor": rope.get("partial_rotary_factor", t.get("partial_rotary_factor")),
            "normalization_layer_epsilon": t["rms_norm_eps"], "scan_layers": scan,
            **sections, **extra}


# --- in MaxText's venv -----------------------------------------------------------------------

def forward_pass(model_name: str, ckpt: str, settings: str, hf_logits: str, work: str) -> dict:
    import numpy as np
    from maxtext.utils import model_creation_utils

    values = json.loads(settings)
    config = forward.config(forward.settings(model_name, work, "hybrid", len(TOKENS), values["scan_layers"], ckpt,
                                             **forward.EXACT_MOE, **values), "hybrid")
    model, _ = model_creation_utils.from_pretrained(config)
    return {"max_abs_logits_diff": forward.against(forward.logits(model, TOKENS), np.load(hf_logits),
                                                   TOLERANCE)["max_abs_logits_diff"]}


# --- the driver (the project's venv: torch and transformers for the HF side) ------------------

def run_case(case: Case) -> dict:
    import numpy as np

    from tests import hub_checkpoints

    root = WORK / case.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf, ours, theirs = root / "hf", root / "ckptconv", root / "maxtext"
    config = case.config()
    if case.fp8:  # transformers' logits of the release's values (e4m3 x block scale)
        stored = hub_checkpoints.make_fp8(str(hf), config)
        np.save(root / "hf_logits.npy", hub_checkpoints.fp8_logits(config, stored, np.array(TOKENS)))
    else:
        np.save(root / "hf_logits.npy", hub_checkpoints.make(str(hf), config, np.array(TOKENS)))
    row = {"case": case.name, "family": case.family, "maxtext_model": case.maxtext_model, "scan": case.scan,
           "layers": case.layers}
    mine = steps.convert(hf, ours, root / "convert.log", *steps.layout(case.scan, 1, case.dtype))
    if mine.returncode:
        return row | {"error": "ckptconv: " + error_line(mine)}
    settings = overrides(config, case.scan, **({"weight_dtype": "float8_e4m3fn"} if case.fp8 else {}))
    mt_env = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "HF_HOME": str(root / "hf-home")}
    converted = steps.maxtext_convert(case.maxtext_model, hf, theirs, [f"{k}={v}" for k, v in settings.items()],
                                      ["--lazy_load_tensors=false", "--eager_load_method=safetensors",
                                       "--simulated_cpu_devices_count=1", f"--save_dtype={case.dtype}"],
                                      root / "to_maxtext.log", env=mt_env)
    checkpoints = {"ckptconv": ours / "0" / "items"}
    if converted.returncode == 0:
        checkpoints["maxtext"] = next(theirs.rglob("0/items"))
    else:
        row["maxtext"] = {"error": "to_maxtext: " + error_line(converted)}
    for who, items in checkpoints.items():
        result = run([MT_PYTHON, __file__, "forward", case.maxtext_model, items, json.dumps(settings),
                      root / "hf_logits.npy", root / f"work-{who}"], root / f"forward-{who}.log", env=mt_env)
        row[who] = last_json(result) if result.returncode == 0 else {"error": "forward: " + error_line(result)}
    return row


def verdict(row: dict) -> str:
    ours, theirs = row.get("ckptconv", {}), row.get("maxtext", {})
    if "max_abs_logits_diff" not in ours:
        return "**fails**"
    bar = max(TOLERANCE, theirs.get("max_abs_logits_diff", TOLERANCE))
    return "**ok**" if ours["max_abs_logits_diff"] <= bar else "WORSE"


def cell(result: dict) -> str:
    if not result:
        return "-"
    if "error" in result:
        return f"fails: `{result['error'].replace('|', '/')}`"
    return f"{result['max_abs_logits_diff']:.1e}"


def write(rows: list[dict], path: Path) -> None:
    versions = steps.mt_versions()
    lines = [
        "# MaxText 0.2.5's forward pass on ckptconv's Qwen3-Next / Qwen3.5 checkpoints",
        "",
        f"Written by `python -m bench hybrid` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"(MaxText {versions[0]}, transformers {versions[1]}, CPU).",
        "Each row: a tiny random model from transformers' own class (hidden 64, 4 experts, linear attention with "
        "2 key / 4 value heads, a full-attention layer every 4), stored as the hub ships it, converted to float32 "
        "by ckptconv and by MaxText's `to_maxtext`; MaxText's `from_pretrained` and one forward pass on each, "
        f"max abs difference from transformers' float32 logits over {len(TOKENS)} tokens. `ok`: ckptconv's "
        f"checkpoint no worse than MaxText's own conversion (or <= {TOLERANCE:g}). The `-fp8` rows: the model's FP8 "
        "release (hidden 256, head and linear head dims 128, experts 128 wide: whole 128-blocks), its e4m3 weights "
        "and bfloat16 block scales kept as MaxText's `qwen3.5-35b-a3b-fp8` model holds them and run with "
        "`weight_dtype=float8_e4m3fn` (MaxText dequantises), against transformers' logits of the release's values.",
        "",
        "| case | MaxText model | scan | layers | ckptconv's checkpoint | MaxText's own conversion | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['maxtext_model']} | {r['scan']} | {r['layers']} | {r['error']} | - | - |")
            continue
        lines.append(f"| {r['case']} | {r['maxtext_model']} | {r['scan']} | {r['layers']} | {cell(r.get('ckptconv'))} "
                     f"| {cell(r.get('maxtext'))} | {verdict(r)} |")
    lines += ["", "Raw rows: `bench/work/hybrid/results.json`; logs beside them.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "forward":
        print(json.dumps(forward_pass(*argv[1:6])), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--out", default=str(DOCS / "HYBRID.md"))
    args = parser.parse_args(argv)
    steps.require_maxtext(parser)
    rows = steps.run_cases(CASES, args.only, run_case, WORK / "results.json")
    write(rows, Path(args.out))
    return 0 if all(verdict(r) == "**ok**" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
