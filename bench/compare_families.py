"""Convert tiny checkpoints of every family with ckptconv and with MaxText 0.2.5's ``to_maxtext``,
and compare the two outputs leaf by leaf, bit for bit; writes ``docs/bench/FAMILIES.md``.

    .venv/bin/python -m bench families [--only qwen3_moe,gemma3] [--keep]

Each case is a random bf16 synthetic checkpoint (``ckptconv.commands.synth``, the hub's names and
``config.json``), converted by ``python -m ckptconv convert`` and by MaxText's converter through
``bench/maxtext_convert_tiny.py`` (which only puts the checkpoint's own config into MaxText's
``model_name`` table: MaxText cannot otherwise convert a 2-layer model). ``bench/compare_outputs.py``
restores both with Orbax's public API in MaxText's venv. Work files go to bench/work/families/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/X.py` (the Makefile's) too

from bench import steps
from bench.steps import BENCH, DOCS, OFFLINE_ENV, setup_maxtext
from ckptconv.commands import synth
from ckptconv.families import gemma4, gemma4_small, olmo3
from tests import hub_checkpoints

WORK = BENCH / "work" / "families"


@dataclass(frozen=True)
class Case:
    """One family at one layout: the synthetic model, MaxText's model_name and how to run both."""

    name: str
    model: synth.SynthModel | None  # None: ``hub`` gives the model
    maxtext_model: str
    scan: bool = True
    devices: int = 16
    dtype: str = "bfloat16"
    loader: str = "lazy"  # MaxText's tensor loading: lazy (safe_open) or eager "transformers" (Gemma 3 needs it)
    maxtext_unscanned: bool = False  # MaxText cannot write this scanned layout: compare with its unscanned, restacked
    dequantize: str | None = None  # MaxText's route for a quantised release: its dequantiser first (fp8, mxfp4)
    # who writes the HF checkpoint: "synth" (the hub's names and config.json) or "transformers" (the family's
    # own class in MaxText's venv, from synth's config.json: bench/hf_tiny.py; what save_pretrained writes)
    maker: str = "synth"
    extra: dict = field(default_factory=dict)
    # a config of tests/hub_checkpoints.py: the model made by transformers' own class, stored as the hub does
    hub: dict | None = None
    # an FP8 release's tensors stored in another dtype, by name ending (as a release may keep A_log in float32)
    recast: dict = field(default_factory=dict)

    def config(self) -> dict:
        return self.hub if self.hub is not None else self.model.config()

    @property
    def model_type(self) -> str:
        return self.config()["model_type"]

    def write(self, directory: Path) -> None:
        if self.hub is None:  # an index, as MaxText's dequantisers need
            synth.write_checkpoint(self.model, str(directory), max_shard_bytes=1 << 20)
        else:
            from tests import hub_checkpoints

            if self.recast:
                bf16 = {k: v for k, v in self.hub.items() if k != "quantization_config"}
                tensors = hub_checkpoints.fp8_tensors(hub_checkpoints.hub_tensors(hub_checkpoints.build(bf16), bf16))
                for name in tensors:
                    dtype = next((d for end, d in self.recast.items() if name.endswith(end)), None)
                    if dtype is not None:
                        tensors[name] = tensors[name].astype(dtype)
                hub_checkpoints.write_stored(str(directory), tensors, self.hub)
                return
            make = hub_checkpoints.make_fp8 if "quantization_config" in self.hub else hub_checkpoints.make
            make(str(directory), self.hub)


def overrides(case: Case) -> list[str]:
    """MaxText config overrides that give its model the checkpoint's sizes."""
    model_type, config = case.model_type, case.config()
    if model_type in ("deepseek_v3", "deepseek_v2", "deepseek_v32"):
        values = {"base_emb_dim": config["hidden_size"], "base_num_query_heads": config["num_attention_heads"],
                  "base_num_kv_heads": config["num_attention_heads"], "base_mlp_dim": config["intermediate_size"],
                  "base_moe_mlp_dim": config["moe_intermediate_size"], "num_experts": config["n_routed_experts"],
                  "num_experts_per_tok": config["num_experts_per_tok"], "shared_experts": config["n_shared_experts"],
                  "first_num_dense_layers": config["first_k_dense_replace"], "q_lora_rank": config["q_lora_rank"] or 0,
                  "kv_lora_rank": config["kv_lora_rank"], "qk_nope_head_dim": config["qk_nope_head_dim"],
                  "qk_rope_head_dim": config["qk_rope_head_dim"], "v_head_dim": config["v_head_dim"],
                  "vocab_size": config["vocab_size"], "base_num_decoder_layers": config["num_hidden_layers"],
                  "scan_layers": str(case.scan).lower()}
        if model_type == "deepseek_v32":  # the indexer's sizes (MaxText: indexer_n_heads, indexer_head_dim)
            values |= {"indexer_n_heads": config["index_n_heads"], "indexer_head_dim": config["index_head_dim"]}
        return [f"{k}={v}" for k, v in {**values, **case.extra}.items()]
    text = config.get("thinker_config", config).get("text_config", config)  # Qwen3-Omni: the thinker's decoder
    layers = text["num_hidden_layers"] // (2 if model_type == "gemma2" else 1)
    head_dim = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])  # OLMo 3 has no field
    values = {"base_emb_dim": text["hidden_size"], "base_num_query_heads": text["num_attention_heads"],
              "base_num_kv_heads": text["num_key_value_heads"], "head_dim": head_dim,
              "base_mlp_dim": text.get("intermediate_size", text.get("moe_intermediate_size")),
              "base_num_decoder_layers": layers,
              "scan_layers": str(case.scan).lower()}
    if not model_type.startswith("gemma"):
        values["vocab_size"] = text["vocab_size"]  # Gemma keeps MaxText's own vocabulary (256128 / 262144)
    if model_type in ("qwen3_next", "qwen3_5_moe"):  # the hybrid stack: all layers MoE, one shared expert
        moe = text["moe_intermediate_size"]
        values |= {"num_experts": text["num_experts"], "num_experts_per_tok": 2, "base_moe_mlp_dim": moe,
                   "base_mlp_dim": moe, "shared_experts": 1,
                   "inhomogeneous_layer_cycle_interval": text.get("full_attention_interval", 4),
                   "gdn_num_key_heads": text["linear_num_key_heads"],
                   "gdn_num_value_heads": text["linear_num_value_heads"],
                   "gdn_key_head_dim": text["linear_key_head_dim"], "gdn_value_head_dim": text["linear_value_head_dim"],
                   "gdn_conv_kernel_dim": text["linear_conv_kernel_dim"]}
        sections = text.get("rope_parameters", {}).get("mrope_section")
        if sections:  # MaxText checks they cover the (tiny) rotary dims
            values["mrope_section"] = json.dumps(sections).replace(" ", "")
    if model_type in ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_vl_moe", "qwen3_omni_moe"):
        values |= {"num_experts": text.get("num_experts", text.get("num_local_experts")), "num_experts_per_tok": 2,
                   "base_moe_mlp_dim": text.get("moe_intermediate_size", text["intermediate_size"])}
    if model_type == "gemma4" and text.get("hidden_size_per_layer_input"):  # E2B / E4B: gemma4_small
        values |= {"global_head_dim": text["global_head_dim"], "use_multimodal": "false",
                   "hidden_size_per_layer_input": text["hidden_size_per_layer_input"],
                   "vocab_size_per_layer_input": text["vocab_size_per_layer_input"],
                   "num_kv_shared_layers": text["num_kv_shared_layers"],
                   "use_double_wide_mlp": str(text["use_double_wide_mlp"]).lower()}
    elif model_type == "gemma4":  # the global layers' sizes; 26B-A4B: routed experts beside the dense MLP (shared)
        values |= {"global_head_dim": text["global_head_dim"],
                   "global_num_kv_heads": text["num_global_key_value_heads"], "use_multimodal": "false"}
        if text.get("enable_moe_block"):
            values |= {"num_experts": text["num_experts"], "num_experts_per_tok": text["top_k_experts"],
                       "base_moe_mlp_dim": text["moe_intermediate_size"], "shared_experts": 1}
    if model_type in ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe"):  # the text decoder only (MaxText's default: not)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        values |= {"use_multimodal": "false", "mrope_section": json.dumps(rope["mrope_section"]).replace(" ", "")}
        if model_type == "qwen3_omni_moe":
            values["use_audio"] = "false"
        if case.scan:  # MaxText refuses scan_layers with any deepstack index, which only the vision path uses
            values["deepstack_visual_indexes_for_vit"] = "[]"
        if model_type != "qwen3_vl":
            values["base_mlp_dim"] = text["moe_intermediate_size"]
    return [f"{k}={v}" for k, v in {**values, **case.extra}.items()]


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
OLMO3 = synth.SynthModel(model_type="olmo3", num_layers=8, num_kv_heads=2, vocab_size=300)
OLMO3_YARN = synth.SynthModel(model_type="olmo3", num_layers=4, num_heads=5, num_kv_heads=1, hidden_size=80,
                              vocab_size=300, config_overrides={"rope_scaling": olmo3.YARN,
                                                                "max_position_embeddings": 65536})
DEEPSEEK_V2 = synth.SynthModel(model_type="deepseek_v2", hidden_size=256, num_layers=3, num_heads=4, head_dim=16,
                               intermediate_size=320, moe_intermediate_size=96, num_experts=4, vocab_size=300)
DEEPSEEK_V32 = synth.SynthModel(model_type="deepseek_v32", hidden_size=256, num_layers=3, num_heads=4, head_dim=16,
                                intermediate_size=320, moe_intermediate_size=192, num_experts=4, quantization="fp8",
                                vocab_size=300, config_overrides={"index_n_heads": 4, "index_head_dim": 32})
QWEN3_VL = synth.SynthModel(model_type="qwen3_vl", num_layers=4, tie_word_embeddings=True, vocab_size=300)
QWEN3_VL_MOE = synth.SynthModel(model_type="qwen3_vl_moe", num_layers=4, num_experts=4, moe_intermediate_size=48,
                                tie_word_embeddings=False, vocab_size=300)
QWEN3_OMNI = synth.SynthModel(model_type="qwen3_omni_moe", num_layers=4, num_experts=4, moe_intermediate_size=48,
                              tie_word_embeddings=False, vocab_size=300)
# Gemma 4: 31B's dense layout and 26B-A4B's MoE one (two blocks of 5 sliding + 1 full), made by transformers' own
# Gemma4ForConditionalGeneration (vision tower beside the decoder), the config.json in the releases' spelling
# (widths whose sqrt is not a float32 value: the embedding's scale rounds as MaxText's does, or the case differs)
GEMMA4_31B = synth.SynthModel(model_type="gemma4", **{**gemma4.DENSE_TINY, "vocab_size": 300, "hidden_size": 48})
GEMMA4_26B = synth.SynthModel(model_type="gemma4", **{**gemma4.MOE_TINY, "vocab_size": 300, "hidden_size": 80,
                                                      "num_layers": 12})
# Gemma 4 E2B (4 sliding + 1 full; the last 4 of 10 layers share keys and values, their MLPs twice as wide) and E4B
# (5 + 1; 4 of 12 shared), per-layer inputs 16 wide; MaxText runs (and converts) them unscanned only
GEMMA4_E2B = synth.SynthModel(model_type="gemma4", **{**gemma4.E2B_TINY, "vocab_size": 300, "hidden_size": 48,
                                                      "config_overrides": gemma4_small.synthetic_fields(
                                                          10, 5, shared=4, ple=16, wide=True, vocab=300)})
GEMMA4_E4B = synth.SynthModel(model_type="gemma4", **{**gemma4.E4B_TINY, "vocab_size": 300, "hidden_size": 80,
                                                      "config_overrides": gemma4_small.synthetic_fields(
                                                          12, 6, shared=4, ple=16, wide=False, vocab=300)})
# MaxText refuses its indexer with the default attention on the CPU ("only supported with dot_product attention")
V32_ATTENTION = {"attention": "dot_product"}
CASES = [
    Case("qwen3", synth.SynthModel(model_type="qwen3", tie_word_embeddings=True), "qwen3-0.6b"),
    Case("llama3.1", synth.SynthModel(model_type="llama", tie_word_embeddings=False,
                                      config_overrides={"rope_scaling": LLAMA31_ROPE}), "llama3.1-8b"),
    Case("qwen3_moe", synth.SynthModel(model_type="qwen3_moe", num_experts=16, moe_intermediate_size=48,
                                       tie_word_embeddings=False), "qwen3-30b-a3b"),
    Case("qwen3_moe-noscan-1dev", synth.SynthModel(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=48,
                                                   tie_word_embeddings=False), "qwen3-30b-a3b", scan=False, devices=1,
         loader="safetensors"),  # MaxText's lazy loader cannot save with 1 device (Orbax finds no handler)
    Case("mixtral", synth.SynthModel(model_type="mixtral", num_experts=4, num_layers=4, tie_word_embeddings=False),
         "mixtral-8x7b"),
    # MaxText 0.2.5 fails on scanned Mixtral (it stacks MoeBlock_0/gate on axis 0: shape mismatch); compare
    # ckptconv's scanned output with MaxText's unscanned one, its layers stacked on MaxText's scan axis 1.
    Case("mixtral-vs-restacked", synth.SynthModel(model_type="mixtral", num_experts=4, num_layers=4,
                                                  tie_word_embeddings=False), "mixtral-8x7b", maxtext_unscanned=True),
    Case("mixtral-noscan", synth.SynthModel(model_type="mixtral", num_experts=4, tie_word_embeddings=False),
         "mixtral-8x7b", scan=False),
    Case("gemma2", synth.SynthModel(model_type="gemma2", num_layers=4, vocab_size=256000, hidden_size=32,
                                    head_dim=8, intermediate_size=64), "gemma2-2b"),
    Case("gemma2-noscan-f32", synth.SynthModel(model_type="gemma2", num_layers=4, vocab_size=256000, hidden_size=32,
                                               head_dim=8, intermediate_size=64), "gemma2-2b", scan=False,
         dtype="float32"),
    Case("gemma3", synth.SynthModel(model_type="gemma3", num_layers=8, vocab_size=262208, hidden_size=48,
                                    head_dim=12, intermediate_size=64), "gemma3-4b", loader="transformers"),
    Case("gemma3-noscan-1dev", synth.SynthModel(model_type="gemma3", num_layers=7, vocab_size=262208, hidden_size=48,
                                                head_dim=12, intermediate_size=64), "gemma3-4b", scan=False,
         devices=1, loader="transformers"),
    # Quantised releases against MaxText's two-step route: its dequantiser, then to_maxtext
    Case("deepseek-v3-fp8-noscan", synth.SynthModel(
        model_type="deepseek_v3", hidden_size=256, num_layers=3, num_heads=4, head_dim=16, intermediate_size=320,
        moe_intermediate_size=192, num_experts=4, quantization="fp8", vocab_size=300), "deepseek3-671b",
        scan=False, dequantize="fp8"),
    Case("deepseek-v3-fp8", synth.SynthModel(
        model_type="deepseek_v3", hidden_size=256, num_layers=3, num_heads=4, head_dim=16, intermediate_size=320,
        moe_intermediate_size=192, num_experts=4, quantization="fp8", vocab_size=300), "deepseek3-671b",
        dequantize="fp8"),
    # if MaxText cannot write the scanned layout itself: compare with its unscanned output, restacked
    Case("deepseek-v3-fp8-vs-restacked", synth.SynthModel(
        model_type="deepseek_v3", hidden_size=256, num_layers=3, num_heads=4, head_dim=16, intermediate_size=320,
        moe_intermediate_size=192, num_experts=4, quantization="fp8", vocab_size=300), "deepseek3-671b",
        dequantize="fp8", maxtext_unscanned=True),
    # DeepSeek-V2-Lite's layout (bf16 release): queries without LoRA, softmax routing without a router bias
    Case("deepseek-v2-lite", DEEPSEEK_V2, "deepseek2-16b"),
    Case("deepseek-v2-lite-noscan-1dev", DEEPSEEK_V2, "deepseek2-16b", scan=False, devices=1, loader="safetensors"),
    Case("deepseek-v2-lite-vs-restacked", DEEPSEEK_V2, "deepseek2-16b", maxtext_unscanned=True),
    # DeepSeek-V3.2's FP8 release: V3 plus the lightning indexer (wq_b, wk in FP8)
    Case("deepseek-v3.2-fp8-noscan-1dev", DEEPSEEK_V32, "deepseek3.2-671b", scan=False, devices=1,
         loader="safetensors", dequantize="fp8", extra=V32_ATTENTION),
    Case("deepseek-v3.2-fp8", DEEPSEEK_V32, "deepseek3.2-671b", dequantize="fp8", extra=V32_ATTENTION),
    Case("deepseek-v3.2-fp8-vs-restacked", DEEPSEEK_V32, "deepseek3.2-671b", dequantize="fp8",
         maxtext_unscanned=True, extra=V32_ATTENTION),
    Case("qwen3-next", synth.SynthModel(model_type="qwen3_next", num_layers=8, num_experts=4, moe_intermediate_size=32,
                                        tie_word_embeddings=False), "qwen3-next-80b-a3b"),
    Case("qwen3-next-noscan-1dev", synth.SynthModel(model_type="qwen3_next", num_layers=8, num_experts=4,
                                                    moe_intermediate_size=32, tie_word_embeddings=False),
         "qwen3-next-80b-a3b", scan=False, devices=1, loader="safetensors"),
    # made by transformers' own Qwen3NextForCausalLM, stored as the hub does (experts one by one, mtp.*)
    Case("qwen3-next-transformers", None, "qwen3-next-80b-a3b", hub=hub_checkpoints.qwen3_next_config()),
    Case("qwen3-next-transformers-noscan-1dev", None, "qwen3-next-80b-a3b", scan=False, devices=1,
         loader="safetensors", hub=hub_checkpoints.qwen3_next_config()),
    # made by transformers' own Qwen3_5MoeForConditionalGeneration, stored as the hub does (fused experts,
    # separate linear-attention projections, a vision tower, mtp.*)
    Case("qwen3.5-transformers", None, "qwen3.5-35b-a3b", hub=hub_checkpoints.qwen3_5_moe_config()),
    Case("qwen3.5-transformers-noscan-1dev", None, "qwen3.5-35b-a3b", scan=False, devices=1,
         loader="safetensors", hub=hub_checkpoints.qwen3_5_moe_config()),
    # its FP8 release (e4m3 kept, bf16 block scales, experts one by one) as MaxText's qwen3.5-*-fp8 model holds it
    Case("qwen3.5-fp8-transformers", None, "qwen3.5-35b-a3b-fp8", hub=hub_checkpoints.qwen3_5_moe_fp8_config()),
    Case("qwen3.5-fp8-transformers-noscan-1dev", None, "qwen3.5-35b-a3b-fp8", scan=False, devices=1,
         loader="safetensors", hub=hub_checkpoints.qwen3_5_moe_fp8_config()),
    # --dtype float8_e4m3fn against MaxText's --save_dtype float8_e4m3fn: the e4m3 weights kept, all else as stored
    Case("qwen3.5-fp8-keepfp8", None, "qwen3.5-35b-a3b-fp8", dtype="float8_e4m3fn",
         hub=hub_checkpoints.qwen3_5_moe_fp8_config()),
    Case("qwen3.5-fp8-keepfp8-noscan", None, "qwen3.5-35b-a3b-fp8", scan=False, dtype="float8_e4m3fn",
         hub=hub_checkpoints.qwen3_5_moe_fp8_config(num_hidden_layers=6)),
    Case("qwen3.5-fp8-keepfp8-noscan-1dev", None, "qwen3.5-35b-a3b-fp8", scan=False, devices=1, dtype="float8_e4m3fn",
         loader="safetensors", hub=hub_checkpoints.qwen3_5_moe_fp8_config()),
    # A_log stored float32 (kept float32), the final norm float16 (MaxText: anything else becomes float32)
    Case("qwen3.5-fp8-keepfp8-f32-f16", None, "qwen3.5-35b-a3b-fp8", dtype="float8_e4m3fn",
         hub=hub_checkpoints.qwen3_5_moe_fp8_config(),
         recast={"linear_attn.A_log": "float32", "language_model.norm.weight": "float16"}),
    Case("gpt-oss-mxfp4", synth.SynthModel(
        model_type="gpt_oss", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, num_experts=4, quantization="mxfp4", vocab_size=300), "gpt-oss-20b", dequantize="mxfp4"),
    Case("gpt-oss-mxfp4-noscan-1dev", synth.SynthModel(
        model_type="gpt_oss", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, num_experts=4, quantization="mxfp4", vocab_size=300), "gpt-oss-20b", scan=False,
        devices=1, loader="safetensors", dequantize="mxfp4"),
    # OLMo 3: made by transformers' own Olmo3ForCausalLM (8 layers: two blocks of 3 sliding + 1 full; GQA), and
    # in the hub's form by synth with an Instruct release's YaRN
    Case("olmo3", OLMO3, "olmo3-7b", maker="transformers"),
    Case("olmo3-noscan-1dev", OLMO3, "olmo3-7b", scan=False, devices=1, loader="safetensors", maker="transformers"),
    # Qwen3-VL and Qwen3-Omni's text decoders, made by transformers' own classes (vision and audio towers beside
    # them; Qwen3-VL-MoE's fused experts in the releases' layout: bench/hf_tiny.py), MaxText with use_multimodal=false
    Case("qwen3-vl", QWEN3_VL, "qwen3-vl-2b", maker="transformers"),
    Case("qwen3-vl-noscan-1dev", QWEN3_VL, "qwen3-vl-2b", scan=False, devices=1, loader="safetensors",
         maker="transformers"),
    Case("qwen3-vl-moe-noscan", QWEN3_VL_MOE, "qwen3-vl-30b-a3b", scan=False, maker="transformers"),
    Case("qwen3-vl-moe-noscan-1dev", QWEN3_VL_MOE, "qwen3-vl-30b-a3b", scan=False, devices=1, loader="safetensors",
         maker="transformers"),
    # MaxText's scanned mapping names Qwen3-VL-MoE's experts one by one: its scanned conversion cannot run
    Case("qwen3-vl-moe", QWEN3_VL_MOE, "qwen3-vl-30b-a3b", maker="transformers"),
    Case("qwen3-vl-moe-vs-restacked", QWEN3_VL_MOE, "qwen3-vl-30b-a3b", maker="transformers", maxtext_unscanned=True),
    Case("qwen3-omni", QWEN3_OMNI, "qwen3-omni-30b-a3b", maker="transformers"),
    Case("qwen3-omni-noscan-1dev", QWEN3_OMNI, "qwen3-omni-30b-a3b", scan=False, devices=1, loader="safetensors",
         maker="transformers"),
    Case("gemma4-31b", GEMMA4_31B, "gemma4-31b", maker="transformers"),
    Case("gemma4-31b-noscan-1dev", GEMMA4_31B, "gemma4-31b", scan=False, devices=1, loader="safetensors",
         maker="transformers"),
    Case("gemma4-26b-a4b", GEMMA4_26B, "gemma4-26b", maker="transformers"),
    Case("gemma4-26b-a4b-noscan-1dev", GEMMA4_26B, "gemma4-26b", scan=False, devices=1, loader="safetensors",
         maker="transformers"),
    Case("gemma4-e2b-noscan", GEMMA4_E2B, "gemma4-e2b", scan=False, maker="transformers"),
    Case("gemma4-e2b-noscan-1dev", GEMMA4_E2B, "gemma4-e2b", scan=False, devices=1, loader="safetensors",
         maker="transformers"),
    Case("gemma4-e4b-noscan", GEMMA4_E4B, "gemma4-e4b", scan=False, maker="transformers"),
    Case("gemma4-e4b-noscan-1dev", GEMMA4_E4B, "gemma4-e4b", scan=False, devices=1, loader="safetensors",
         maker="transformers"),
    Case("olmo3-32b-yarn-hub", OLMO3_YARN, "olmo3-32b"),
    Case("olmo3-32b-yarn-hub-noscan-1dev", OLMO3_YARN, "olmo3-32b", scan=False, devices=1, loader="safetensors"),
]


def run_case(case: Case, ctx: dict) -> dict:
    root = WORK / case.name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    hf, ours, theirs = root / "hf", root / "ckptconv", root / "maxtext"
    if case.maker == "transformers":
        config = root / "synth-config.json"
        config.write_text(json.dumps(case.model.config()))
        made = steps.hf_tiny(config, hf, root / "hf_tiny.log", env=ctx["mt_env"])
        if made.returncode:
            return {"case": case.name, "family": case.model_type, "maxtext_model": case.maxtext_model,
                    "maxtext_layout": "-", "scan_layers": case.scan, "devices": case.devices, "dtype": case.dtype,
                    "ckptconv_exit": "-", "maxtext_exit": "-", "error": made.stderr[-600:]}
    else:
        case.write(hf)
    mine = steps.convert(hf, ours, root / "ckptconv.log", *steps.layout(case.scan, case.devices, case.dtype))
    loader = ["--lazy_load_tensors=true"] if case.loader == "lazy" else [
        "--lazy_load_tensors=false", f"--eager_load_method={case.loader}"]
    theirs_layout = overrides(case) + (["scan_layers=false"] if case.maxtext_unscanned else [])
    their_input = hf
    if case.dequantize:
        their_input = root / "hf-bf16"
        step = steps.dequantize(case.dequantize, hf, their_input, root / "dequantize.log", env=ctx["mt_env"])
        if step.returncode:
            return {"case": case.name, "family": case.model_type, "maxtext_model": case.maxtext_model,
                    "maxtext_layout": "-", "scan_layers": case.scan, "devices": case.devices, "dtype": case.dtype,
                    "ckptconv_exit": mine.returncode, "maxtext_exit": step.returncode, "error": step.stderr[-600:]}
    mt = steps.maxtext_convert(case.maxtext_model, their_input, theirs, theirs_layout,
                               [*loader, f"--simulated_cpu_devices_count={case.devices}", f"--save_dtype={case.dtype}"],
                               root / "maxtext.log", env=ctx["mt_env"])
    row = {"case": case.name, "family": case.model_type, "maxtext_model": case.maxtext_model,
           "maxtext_layout": ("unscanned, restacked" if case.maxtext_unscanned else "same")
                             + (", made by transformers' class" if case.maker == "transformers" else "")
                             + (f", after MaxText's {case.dequantize} dequantiser" if case.dequantize else ""),
           "scan_layers": case.scan, "devices": case.devices, "dtype": case.dtype,
           "ckptconv_exit": mine.returncode, "maxtext_exit": mt.returncode}
    if mine.returncode or mt.returncode:
        row["error"] = (mine.stderr or mt.stderr)[-600:]
        return row
    restack = ["--stack-layers-of-b"] if case.maxtext_unscanned else []
    # MaxText's converter keeps DeepSeek's router bias in its own collection; ckptconv writes it under
    # params/params, where every MaxText loader finds it (README, "What is written"): compared there
    moved = ["--moved-in-b", "params/MoEBiasVar=params/params"]
    compared, result = steps.compare_outputs(ours, theirs, root / "compare.json", root / "compare.log", *restack, *moved,
                                             env=ctx["mt_env"])
    row |= {"identical": result["identical"], "leaves": result["leaves_compared"],
            "bytes": result["bytes_compared"], "value_mismatches": result["value_mismatches"][:3],
            "only_in_ckptconv": result["only_in_a"], "only_in_maxtext": result["only_in_b"],
            "metadata_differences": sorted({d["field"] for d in result["metadata_differences"]}),
            "compare_exit": compared.returncode}
    return row


def kept_rows(path: Path, rerun: set[str]) -> dict[str, str]:
    """The table lines of an earlier ``FAMILIES.md`` for the cases not run again (``--merge``)."""
    return steps.kept_rows(path, {case.name for case in CASES} - rerun)


def write(rows: list[dict], ctx: dict, path: Path, kept: dict[str, str] | None = None) -> None:
    fresh: dict[str, str] = {}
    lines = [
        "# Families: ckptconv vs MaxText 0.2.5's `to_maxtext`, leaf by leaf",
        "",
        f"Written by `python -m bench families` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"(MaxText {ctx['mt_versions'].get('maxtext')}, transformers {ctx['mt_versions'].get('transformers')}).",
        "Each row: one random bf16 synthetic checkpoint with the hub's names and `config.json` (or, where marked, "
        "made by transformers' own model class and `save_pretrained`: `bench/hf_tiny.py`), converted by both "
        "tools with the same layout; both outputs restored with Orbax's public API and compared bit for bit. "
        "Chunk shapes may differ (ckptconv's are finer, always inside one device's shard); MaxText reads any. "
        "DeepSeek's router bias: MaxText's converter writes it in `params/MoEBiasVar`, ckptconv under "
        "`params/params` (where every MaxText 0.2.5 loader finds it; README), and it is compared there.",
        "",
        "| case | MaxText model_name | scan | devices | dtype | MaxText layout | leaves | MiB | result | metadata that differs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            last = r["error"].strip().splitlines()[-1][:160].replace("|", "/")
            result = f"failed (ckptconv exit {r['ckptconv_exit']}, MaxText exit {r['maxtext_exit']}: `{last}`)"
            fresh[r["case"]] = (f"| {r['case']} | {r['maxtext_model']} | {r['scan_layers']} | {r['devices']} "
                                f"| {r['dtype']} | {r['maxtext_layout']} | - | - | {result} | - |")
            continue
        result = "**identical**" if r["identical"] else f"DIFFERENT: {r['value_mismatches'] or r['only_in_maxtext']}"
        fresh[r["case"]] = (f"| {r['case']} | {r['maxtext_model']} | {r['scan_layers']} | {r['devices']} "
                            f"| {r['dtype']} | {r['maxtext_layout']} | {r['leaves']} | {r['bytes'] / 2**20:.1f} | {result} | "
                            f"{', '.join(r['metadata_differences']) or 'none'} |")
    if kept:
        lines[4:4] = [f"Rows of {', '.join(sorted(kept))} are kept from earlier runs (`--merge`)."]
    table = {**(kept or {}), **fresh}
    lines += [table[case.name] for case in CASES if case.name in table]
    # sections other scripts' results are recorded in (``## Llama 4``: ``python -m bench llama4``) are kept
    earlier = path.read_text() if path.exists() else ""
    sections = earlier[earlier.index("\n## ") + 1:earlier.index("\nRaw rows:")] if "\n## " in earlier else ""
    lines += ["", sections.rstrip()] if sections else []
    lines += ["", "Raw rows: `bench/work/families/results.json`.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names or family names")
    parser.add_argument("--keep", action="store_true", help="keep the work files")
    parser.add_argument("--out", default=str(DOCS / "FAMILIES.md"))
    parser.add_argument("--merge", action="store_true", help="keep the earlier rows of the cases not run")
    args = parser.parse_args(argv)
    ctx = setup_maxtext()
    ctx["mt_env"] = {**ctx["mt_env"], **OFFLINE_ENV}
    wanted = set(args.only.split(",")) if args.only else None
    rows = []
    for case in CASES:
        if wanted and case.name not in wanted and case.model_type not in wanted:
            continue
        row = run_case(case, ctx)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if not args.keep:
            shutil.rmtree(WORK / case.name / "hf", ignore_errors=True)
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "results.json").write_text(json.dumps(rows, indent=2))
    kept = kept_rows(Path(args.out), {r["case"] for r in rows}) if args.merge else None
    write(rows, ctx, Path(args.out), kept)
    return 0 if all(r.get("identical") for r in rows if "error" not in r) else 1


if __name__ == "__main__":
    sys.exit(main())
