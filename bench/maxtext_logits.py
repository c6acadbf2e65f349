"""MaxText 0.2.5's own forward pass on ckptconv's checkpoints against transformers' logits; writes ``docs/bench/LOGITS.md``.

    .venv/bin/python -m bench logits [--only olmo3-yarn-scan,...] [--merge]

Per case: a tiny random model made by transformers' own class (``bench/hf_tiny.py`` in MaxText's
venv, from a ``config.json`` that ``ckptconv.commands.synth`` writes; weights rounded to bfloat16),
its float32 logits; ``ckptconv convert --dtype float32 --devices 1``; then, in a fresh process of
MaxText's venv, ``model_creation_utils.from_pretrained`` (MaxText's inference loader) with MaxText's
own model config for the family (``model_name``, sizes and run-time settings overridden from the
checkpoint's ``config.json``) and one forward pass: max abs difference of the logits against
transformers' (float32; tolerance 1e-4). Work files go to bench/work/logits/.
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
from bench.steps import BENCH, DOCS, MT_ENV, MT_PYTHON, error_line, last_json, run  # noqa: E402

WORK = BENCH / "work" / "logits"
TOLERANCE = 1e-4
# --devices of the conversions (1 as MaxText's single-device runs; more: the data files by device, MaxText still
# restoring them onto its one CPU device)
DEVICES = "1"


@dataclass(frozen=True)
class Case:
    name: str
    model_type: str
    maxtext_model: str
    scan: bool
    sizes: dict  # synth.SynthModel fields
    yarn: bool = False  # the Instruct releases' RoPE (OLMo 3: YaRN, factor 8)
    # the transformers reference applies YaRN to every layer, as transformers 4.57 ran OLMo 3 and as MaxText
    # 0.2.5 does (transformers 5 applies it to the full-attention layers only)
    yarn_everywhere: bool = False


# OLMo 3: 8 layers (two blocks of 3 sliding + 1 full), GQA, a sliding window shorter than the 12 tokens so
# the sliding layers really mask; with and without the Instruct releases' YaRN.
OLMO3 = {"num_layers": 8, "num_kv_heads": 2, "vocab_size": 300, "config_overrides": {"sliding_window": 5}}
CASES = [Case(f"olmo3{'-yarn' if yarn else ''}-{'scan' if scan else 'noscan'}", "olmo3", "olmo3-7b", scan, OLMO3, yarn)
         for yarn in (False, True) for scan in (True, False)]
CASES += [Case(f"olmo3-yarn-every-layer-{'scan' if scan else 'noscan'}", "olmo3", "olmo3-7b", scan, OLMO3, True, True)
          for scan in (True, False)]
# Qwen3-VL (dense, MoE) and Qwen3-Omni-MoE's text decoders (towers beside them in the checkpoint), MaxText with
# use_multimodal=false: 4 layers, GQA, 4 experts of width 48
QWEN3_MM = {"num_layers": 4, "num_kv_heads": 2, "vocab_size": 300}
QWEN3_MM_MOE = QWEN3_MM | {"num_experts": 4, "moe_intermediate_size": 48, "tie_word_embeddings": False}
CASES += [Case(f"{name}-{'scan' if scan else 'noscan'}", model_type, maxtext_model, scan, sizes)
          for name, model_type, maxtext_model, sizes in (
              ("qwen3-vl", "qwen3_vl", "qwen3-vl-2b", QWEN3_MM), ("qwen3-vl-moe", "qwen3_vl_moe", "qwen3-vl-30b-a3b",
                                                                   QWEN3_MM_MOE),
              ("qwen3-omni", "qwen3_omni_moe", "qwen3-omni-30b-a3b", QWEN3_MM_MOE))
          for scan in (True, False)]

# Gemma 4: 31B's dense layout and 26B-A4B's MoE one (12 layers: two blocks of 5 sliding + 1 full; global layers with
# their own head dim and KV heads, keys as values), Gemma4ForConditionalGeneration with its vision tower; a sliding
# window shorter than the 12 tokens so the sliding layers really mask
GEMMA4 = {"num_layers": 12, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
          "intermediate_size": 96, "vocab_size": 300, "config_overrides": {"sliding_window": 5}}
GEMMA4_MOE = GEMMA4 | {"num_experts": 4, "moe_intermediate_size": 32}
CASES += [Case(f"{name}-{'scan' if scan else 'noscan'}", "gemma4", maxtext_model, scan, sizes)
          for name, maxtext_model, sizes in (("gemma4-31b", "gemma4-31b", GEMMA4),
                                             ("gemma4-26b-a4b", "gemma4-26b", GEMMA4_MOE))
          for scan in (True, False)]
# Gemma 4 E2B (4 sliding + 1 full, the last 4 of 10 layers on shared keys and values with MLPs twice as wide) and
# E4B (5 + 1, 4 of 12 shared), per-layer inputs 16 wide: MaxText's gemma4_small runs them unscanned only
GEMMA4_SMALL = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 96,
                "vocab_size": 300}
CASES += [Case(f"{name}-noscan", "gemma4", name, False, GEMMA4_SMALL | {
    "num_layers": layers, "config_overrides": {"sliding_window": 5}, "small": (period, wide)})
    for name, layers, period, wide in (("gemma4-e2b", 10, 5, True), ("gemma4-e4b", 12, 6, False))]


def hf_config(case: Case) -> dict:
    from ckptconv.commands import synth
    from ckptconv.families import olmo3

    sizes = dict(case.sizes)
    overrides = dict(sizes.pop("config_overrides", {}))
    if "small" in sizes:  # Gemma 4 E2B / E4B: (period, wide MLPs), 4 shared layers, per-layer inputs 16 wide
        from ckptconv.families import gemma4_small

        period, wide = sizes.pop("small")
        overrides |= gemma4_small.synthetic_fields(sizes["num_layers"], period, shared=4, ple=16, wide=wide,
                                                   vocab=sizes["vocab_size"])
    if case.yarn:
        overrides |= {"rope_scaling": olmo3.YARN, "max_position_embeddings": 65536}
    return synth.SynthModel(model_type=case.model_type, config_overrides=overrides, **sizes).config()


def reference_config(case: Case, config: dict) -> dict:
    """The config transformers builds the reference from: ``config``, or with YaRN on every layer type."""
    if not case.yarn_everywhere:
        return config
    yarn = {**config["rope_scaling"], "rope_theta": config["rope_theta"]}
    rest = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta")}
    return rest | {"rope_parameters": {"sliding_attention": dict(yarn), "full_attention": dict(yarn)}}


def maxtext_overrides(config: dict, scan: bool = True) -> dict:
    """MaxText settings that give its model this checkpoint's sizes and run-time behaviour."""
    if config["model_type"] in ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe"):
        return multimodal_overrides(config, scan)
    if config["model_type"] == "gemma4":
        return gemma4_overrides(config["text_config"])
    heads = config["num_attention_heads"]
    values = {"base_emb_dim": config["hidden_size"], "base_num_query_heads": heads,
              "base_num_kv_heads": config["num_key_value_heads"],
              "head_dim": config.get("head_dim", config["hidden_size"] // heads),
              "base_mlp_dim": config["intermediate_size"], "base_num_decoder_layers": config["num_hidden_layers"],
              "vocab_size": config["vocab_size"], "normalization_layer_epsilon": config["rms_norm_eps"],
              "sliding_window_size": config["sliding_window"], "rope_max_timescale": config["rope_theta"],
              "max_position_embeddings": config["max_position_embeddings"]}
    yarn = config.get("rope_scaling")
    if yarn:
        values |= {"rope_type": "yarn", "rope_factor": yarn["factor"], "beta_fast": yarn["beta_fast"],
                   "beta_slow": yarn["beta_slow"],
                   "original_max_position_embeddings": yarn["original_max_position_embeddings"]}
    else:
        values |= {"rope_type": "default"}
    return values


def multimodal_overrides(config: dict, scan: bool) -> dict:
    """Qwen3-VL / Qwen3-Omni's text decoder alone: sizes from its text config, the towers off. On text, mRoPE is
    plain RoPE (one position per token, all three sections), so MaxText runs it as plain RoPE (use_mrope=false);
    its configs' deepstack indexes (which refuse scan_layers) serve only the vision path."""
    text = config.get("thinker_config", config)["text_config"]
    values = {"base_emb_dim": text["hidden_size"], "base_num_query_heads": text["num_attention_heads"],
              "base_num_kv_heads": text["num_key_value_heads"], "head_dim": text["head_dim"],
              "base_mlp_dim": text.get("moe_intermediate_size", text["intermediate_size"]),
              "base_num_decoder_layers": text["num_hidden_layers"], "vocab_size": text["vocab_size"],
              "normalization_layer_epsilon": text["rms_norm_eps"], "rope_max_timescale": text["rope_theta"],
              "use_multimodal": "false", "use_audio": "false", "use_mrope": "false",
              "logits_via_embedding": str(bool(config.get("thinker_config", config)["tie_word_embeddings"])).lower()}
    if scan:
        values["deepstack_visual_indexes_for_vit"] = "[]"
    if "num_experts" in text:
        values |= {"num_experts": text["num_experts"], "num_experts_per_tok": text["num_experts_per_tok"],
                   "base_moe_mlp_dim": text["moe_intermediate_size"], "norm_topk_prob": text["norm_topk_prob"]}
    return values


def gemma4_overrides(text: dict) -> dict:
    """Gemma 4's text decoder: sizes and run-time settings from its text config; MaxText's own vocabulary (the
    checkpoint's embedding is padded to it), the vision tower off."""
    rope = text["rope_parameters"]
    values = {"base_emb_dim": text["hidden_size"], "base_num_query_heads": text["num_attention_heads"],
              "base_num_kv_heads": text["num_key_value_heads"], "head_dim": text["head_dim"],
              "global_head_dim": text["global_head_dim"],
              "base_mlp_dim": text["intermediate_size"], "base_num_decoder_layers": text["num_hidden_layers"],
              "normalization_layer_epsilon": text["rms_norm_eps"], "sliding_window_size": text["sliding_window"],
              "local_rope_max_timescale": rope["sliding_attention"]["rope_theta"],
              "global_rope_max_timescale": rope["full_attention"]["rope_theta"],
              "global_rope_proportion": rope["full_attention"]["partial_rotary_factor"],
              "final_logits_soft_cap": text["final_logit_softcapping"], "use_multimodal": "false"}
    if text.get("hidden_size_per_layer_input"):  # E2B / E4B (gemma4_small): their global layers keep the KV heads
        values |= {"hidden_size_per_layer_input": text["hidden_size_per_layer_input"],
                   "vocab_size_per_layer_input": text["vocab_size_per_layer_input"],
                   "num_kv_shared_layers": text["num_kv_shared_layers"],
                   "use_double_wide_mlp": str(text["use_double_wide_mlp"]).lower()}
    else:
        values["global_num_kv_heads"] = text["num_global_key_value_heads"]
    if text.get("enable_moe_block"):
        values |= {"num_experts": text["num_experts"], "num_experts_per_tok": text["top_k_experts"],
                   "base_moe_mlp_dim": text["moe_intermediate_size"], "shared_experts": 1}
    return values


# --- in MaxText's venv -----------------------------------------------------------------------

def run_forward(maxtext_model: str, ckpt: str, scan: bool, hf_dir: str, work: str) -> dict:
    import numpy as np
    from maxtext.utils import model_creation_utils

    config = json.loads((Path(hf_dir) / "synth-config.json").read_text())
    tokens = np.load(Path(hf_dir) / "hf_tokens.npy")
    values = forward.settings(maxtext_model, work, "logits", len(tokens), scan, ckpt, **maxtext_overrides(config, scan))
    model, _ = model_creation_utils.from_pretrained(forward.config(values, "logits"))
    logits = forward.logits(model, tokens)
    Path(work).mkdir(parents=True, exist_ok=True)
    np.save(Path(work) / "maxtext_logits.npy", logits)
    return forward.against(logits, np.load(Path(hf_dir) / "hf_logits.npy"), TOLERANCE)


# --- the driver (any Python: it runs everything in fresh processes) ---------------------------

def run_case(case: Case, devices: str = DEVICES) -> dict:
    root = WORK / case.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf, dst = root / "hf", root / "ckptconv"
    row = {"case": case.name, "maxtext_model": case.maxtext_model, "scan": case.scan}
    config, reference = root / "synth-config.json", root / "reference-config.json"
    config.write_text(json.dumps(hf_config(case)))
    reference.write_text(json.dumps(reference_config(case, hf_config(case))))
    made = steps.hf_tiny(reference, hf, root / "hf_tiny.log")
    if made.returncode:
        return row | {"error": "hf_tiny: " + error_line(made)}
    shutil.copy(config, hf / "synth-config.json")
    converted = steps.convert(hf, dst, root / "convert.log", *steps.layout(case.scan, devices, "float32"))
    if converted.returncode:
        return row | {"error": "convert: " + error_line(converted)}
    result = run([MT_PYTHON, __file__, "forward", case.maxtext_model, dst / "0" / "items", str(case.scan), hf,
                  root / "mt"], root / "forward.log", env=MT_ENV)
    return row | (last_json(result) if result.returncode == 0 else {"error": "MaxText: " + error_line(result)})


NOTES = (
    "`olmo3-yarn-scan`, `olmo3-yarn-noscan`: the Instruct releases' YaRN. transformers 5 applies it to the "
    "full-attention layers only (`rope_parameters` per layer type); MaxText 0.2.5's olmo3 decoder applies the "
    "configured `rope_type` to every layer (its `models/olmo3.py` says transformers' code passed one rotary embedding "
    "to all layers, as 4.x did). The checkpoint is the same in both cases: against a reference with YaRN on every "
    "layer (`olmo3-yarn-every-layer-*`) MaxText agrees to float32 rounding. The difference is MaxText's run-time RoPE "
    "on the sliding layers, not a weight; without YaRN (base releases) the two agree to float32 rounding as well."
)


def write(rows: list[dict], path: Path) -> None:
    versions = steps.mt_versions()
    lines = [
        "# MaxText 0.2.5's forward pass on ckptconv's checkpoints vs transformers' logits",
        "",
        f"Written by `python -m bench logits` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"(MaxText {versions[0]}, transformers {versions[1]}, CPU).",
        "Each row: a tiny random model made by transformers' own class (weights rounded to bf16), its float32 logits "
        "on 12 tokens; `ckptconv convert --dtype float32 --devices 1`; MaxText's `from_pretrained` with its own "
        "model config (sizes and run-time settings from the checkpoint's config.json) and one forward pass, float32. "
        f"Tolerance {TOLERANCE:g}.",
        "",
        "| case | MaxText model_name | scan | max abs logit | max abs difference | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['maxtext_model']} | {r['scan']} | - | - | **fails**: "
                         f"`{r['error'].replace('|', '/')}` |")
            continue
        lines.append(f"| {r['case']} | {r['maxtext_model']} | {r['scan']} | {r['max_abs_logit']:.2f} "
                     f"| {r['max_abs_logits_diff']:.1e} | {'**ok**' if r['ok'] else 'DIFFERENT'} |")
    lines += ["", NOTES, "", "Raw rows: `bench/work/logits/results.json`; logs beside them.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "forward":
        maxtext_model, ckpt, scan, hf_dir, work = argv[1], argv[2], argv[3] == "True", argv[4], argv[5]
        print(json.dumps(run_forward(maxtext_model, ckpt, scan, hf_dir, work)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--out", default=str(DOCS / "LOGITS.md"))
    parser.add_argument("--merge", action="store_true", help="keep the other cases' rows of the last run")
    parser.add_argument("--devices", default=DEVICES, help="ckptconv convert --devices (MaxText restores onto 1)")
    args = parser.parse_args(argv)
    steps.require_maxtext(parser)
    previous = WORK / "results.json"
    kept = json.loads(previous.read_text()) if args.merge and previous.exists() else []
    rows = steps.run_cases(CASES, args.only, lambda case: run_case(case, args.devices), previous, kept)
    write(rows, Path(args.out))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
