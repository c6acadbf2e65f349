"""MaxText 0.2.5's own forward pass on ckptconv's Llama 4 checkpoints against transformers' logits.

    .venv/bin/python -m bench llama4-logits [--only maverick-scan,...]

Per case: a tiny random ``Llama4ForConditionalGeneration`` made by transformers' own class
(``bench/hf_tiny.py --class Llama4ForConditionalGeneration`` in MaxText's venv; weights rounded to bfloat16),
its float32 logits on 12 tokens; ``ckptconv convert --dtype float32 --devices 1`` scanned or not; then, in
a fresh process of MaxText's venv, ``model_creation_utils.from_pretrained`` (MaxText's inference loader) with
MaxText's own ``llama4-17b-16e`` / ``llama4-17b-128e`` config (sizes and run-time settings overridden from the
checkpoint's ``config.json``) and one forward pass: max abs difference against transformers' logits
(float32; tolerance 1e-4); and, in another fresh process, ``checkpointing.load_params_from_path`` (MaxText's
training loader) into the model's abstract state, every leaf against what the checkpoint holds, bit for bit. MaxText's llama3.1 RoPE hardcodes Llama 3.1's scaling (factor 8, low/high
frequency factors 1/4, 8192 positions) and reads none of the checkpoint's, so the models here use exactly
those (Scout's pattern) or none (``rope_use_scale: false``, Maverick's). Work files: bench/work/llama4-logits/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path as a step in MaxText's venv: bench, tests
from bench import forward, steps  # noqa: E402
from bench.steps import BENCH, MT_ENV, MT_PYTHON, error_line, last_json, run  # noqa: E402

WORK = BENCH / "work" / "llama4-logits"
TOLERANCE = 1e-4

LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SMALL = dict(vocab_size=128, num_experts=4, moe_intermediate_size=32, intermediate_size=96, tie_word_embeddings=False)


@dataclass(frozen=True)
class Case:
    name: str
    maxtext_model: str
    scan: bool
    layers: int
    overrides: dict = field(default_factory=dict)  # text_config fields


# Scout's pattern (every layer MoE, L2 q/k norm, Llama 3.1 RoPE scaling); Maverick's (dense and MoE alternate,
# no q/k norm, no RoPE scaling); 8 layers: two cycles, each with a NoPE layer
SCOUT = {"rope_parameters": LLAMA31_ROPE}
MAVERICK = {"interleave_moe_layer_step": 2, "use_qk_norm": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
CASES = [Case(f"{name}-{'scan' if scan else 'noscan'}", model, scan, 8, overrides)
         for name, model, overrides in (("scout", "llama4-17b-16e", SCOUT), ("maverick", "llama4-17b-128e", MAVERICK))
         for scan in (True, False)]


def hf_config(case: Case) -> dict:
    from ckptconv.commands import synth

    return synth.SynthModel(model_type="llama4", num_layers=case.layers, config_overrides=case.overrides,
                            **SMALL).config()


def maxtext_overrides(config: dict) -> dict:
    """MaxText settings that give its llama4 model this checkpoint's sizes and run-time behaviour."""
    t = config["text_config"]
    rope = t["rope_parameters"]
    return {"base_emb_dim": t["hidden_size"], "base_num_query_heads": t["num_attention_heads"],
            "base_num_kv_heads": t["num_key_value_heads"], "head_dim": t["head_dim"],
            "base_mlp_dim": t["intermediate_size_mlp"], "base_moe_mlp_dim": t["intermediate_size"],
            "num_experts": t["num_local_experts"], "num_experts_per_tok": t["num_experts_per_tok"],
            "shared_experts": 1, "base_num_decoder_layers": t["num_hidden_layers"], "vocab_size": t["vocab_size"],
            "normalization_layer_epsilon": t["rms_norm_eps"], "rope_max_timescale": int(rope["rope_theta"]),
            "rope_use_scale": rope["rope_type"] == "llama3", "use_qk_norm": t["use_qk_norm"],
            "interleave_moe_layer_step": t["interleave_moe_layer_step"],
            "nope_layer_interval": t["no_rope_layer_interval"], "inhomogeneous_layer_cycle_interval": 4,
            "temperature_tuning": t["attn_temperature_tuning"], "chunk_attn_window_size": t["attention_chunk_size"]}


# --- in MaxText's venv -----------------------------------------------------------------------

def maxtext_config(maxtext_model: str, ckpt: str, scan: bool, hf_dir: str, work: str):
    import numpy as np

    config = json.loads((Path(hf_dir) / "synth-config.json").read_text())
    tokens = np.load(Path(hf_dir) / "hf_tokens.npy")
    return forward.config(forward.settings(maxtext_model, work, "logits", len(tokens), scan, ckpt, **forward.EXACT_MOE,
                                           **maxtext_overrides(config)), "logits")


def run_forward(maxtext_model: str, ckpt: str, scan: bool, hf_dir: str, work: str) -> dict:
    import numpy as np
    from maxtext.utils import model_creation_utils

    tokens = np.load(Path(hf_dir) / "hf_tokens.npy")
    model, _ = model_creation_utils.from_pretrained(maxtext_config(maxtext_model, ckpt, scan, hf_dir, work))
    return forward.against(forward.logits(model, tokens), np.load(Path(hf_dir) / "hf_logits.npy"), TOLERANCE)


def run_load_params(maxtext_model: str, ckpt: str, scan: bool, hf_dir: str, work: str) -> dict:
    """MaxText's training loader into the model's abstract state: every leaf as written, bit for bit."""
    from flax import nnx
    from maxtext.common import checkpointing
    from maxtext.utils import model_creation_utils

    config = maxtext_config(maxtext_model, ckpt, scan, hf_dir, work)
    _, abstract_model = model_creation_utils.create_nnx_abstract_model(config)
    loaded = checkpointing.load_params_from_path(ckpt, nnx.state(abstract_model, nnx.Param),
                                                 config.checkpoint_storage_concurrent_gb)
    got = forward.loaded_leaves(loaded)
    want = {k: v for k, (collection, v) in forward.written_leaves(ckpt).items() if collection == "params"}
    mismatched = forward.mismatched(got, want)
    return {"leaves_written": len(want), "leaves_loaded": len(got), "mismatched": mismatched[:5],
            "load_params_ok": not mismatched and set(want) == set(got)}


# --- the driver ------------------------------------------------------------------------------

def run_case(case: Case) -> dict:
    root = WORK / case.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf, dst = root / "hf", root / "ckptconv"
    row = {"case": case.name, "maxtext_model": case.maxtext_model, "scan": case.scan, "layers": case.layers}
    config = root / "synth-config.json"
    config.write_text(json.dumps(hf_config(case)))
    made = steps.hf_tiny(config, hf, root / "hf_tiny.log", "--class", "Llama4ForConditionalGeneration")
    if made.returncode:
        return row | {"error": "hf_tiny: " + error_line(made)}
    shutil.copy(config, hf / "synth-config.json")
    converted = steps.convert(hf, dst, root / "convert.log", *steps.layout(case.scan, 1, "float32"))
    if converted.returncode:
        return row | {"error": "convert: " + error_line(converted)}
    result = run([MT_PYTHON, __file__, "forward", case.maxtext_model, dst / "0" / "items", str(case.scan), hf,
                  root / "mt"], root / "forward.log", env=MT_ENV)
    if result.returncode:
        return row | {"error": "MaxText: " + error_line(result)}
    row |= last_json(result)
    loaded = run([MT_PYTHON, __file__, "load_params", case.maxtext_model, dst / "0" / "items", str(case.scan), hf,
                  root / "mt-load"], root / "load_params.log", env=MT_ENV)
    return row | (last_json(loaded) if loaded.returncode == 0 else {"load_params_error": error_line(loaded)})


def table(rows: list[dict]) -> str:
    lines = ["| case | MaxText model_name | scan | layers | max abs logit | max abs difference | result "
             "| `load_params_from_path` |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['maxtext_model']} | {r['scan']} | {r['layers']} | - | - | **fails**: "
                         f"`{r['error'].replace('|', '/')[:200]}` | - |")
            continue
        loaded = (f"fails: `{r['load_params_error'][:120]}`" if "load_params_error" in r else
                  f"{'**every leaf as written**' if r['load_params_ok'] else 'DIFFERENT: ' + str(r['mismatched'])} "
                  f"({r['leaves_loaded']} / {r['leaves_written']} leaves)")
        lines.append(f"| {r['case']} | {r['maxtext_model']} | {r['scan']} | {r['layers']} | {r['max_abs_logit']:.2f} "
                     f"| {r['max_abs_logits_diff']:.1e} | {'**ok**' if r['ok'] else 'DIFFERENT'} | {loaded} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("forward", "load_params"):
        maxtext_model, ckpt, scan, hf_dir, work = argv[1], argv[2], argv[3] == "True", argv[4], argv[5]
        step = run_forward if argv[0] == "forward" else run_load_params
        print(json.dumps(step(maxtext_model, ckpt, scan, hf_dir, work)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names: " + ", ".join(c.name for c in CASES))
    args = parser.parse_args(argv)
    rows = steps.run_cases(CASES, args.only, run_case, WORK / "results.json")
    print(table(rows))
    return 0 if all(r.get("ok") and r.get("load_params_ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
