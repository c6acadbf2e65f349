"""Vision towers (``convert --multimodal``) against MaxText 0.2.5 with ``use_multimodal=true``; writes
``docs/bench/VISION.md``.

    .venv/bin/python -m bench vision [--only gemma3,qwen3_vl,qwen3_vl_moe,qwen3_5_moe,gemma4_31b,gemma4_26b,
                                             qwen3_omni,memory,memory-qwen3_5_moe,memory_gemma4,omni_memory]
                                     [--keep] [--no-logits] [--out PATH]

Gemma 3 (below) and Qwen3-VL (a tiny ``Qwen3VLForConditionalGeneration`` by ``bench/hf_tiny.py``, a 2-block tower
with a deepstack merger after each; compared unscanned on 16 and 1 devices, the only layout MaxText runs it in,
and ``--multimodal --scan-layers`` refused), Qwen3-VL-MoE (``qwen3_vl_moe``: the same tower beside a MoE decoder,
likewise), Qwen3.5 (``qwen3_5_moe``: ``tests/hub_checkpoints.py``'s hub-format 35B-A3B with a 2-block tower: scanned
on 16, unscanned on 1), ckptconv's checkpoint of the last three exported back ``--like`` the source and compared
tensor by tensor; Gemma 4 (``gemma4_31b``, ``gemma4_26b``: tiny models made by ``Gemma4ForConditionalGeneration``,
compared scanned on 16 devices and unscanned on 1, and MaxText's forward on text and on an image); Qwen3-Omni-MoE's
thinker (``qwen3_omni``: a tiny ``Qwen3OmniMoeForConditionalGeneration`` by ``bench/hf_tiny.py``, its vision tower,
Qwen3-VL's with other merger names, and its audio tower; compared as Qwen3-VL's, MaxText's ``qwen3-omni-30b-a3b``
with ``use_multimodal=true use_audio=true``, exported back, and MaxText's towers run on their own against
transformers'); ``memory`` / ``memory-qwen3_5_moe`` / ``memory_gemma4`` / ``omni_memory``: peak RSS against the
prediction with the releases' whole towers (at Gemma 3 4B's widths, one period of Qwen3.5-35B-A3B's, Gemma 4
26B-A4B's, Qwen3-Omni-30B-A3B's).
For Gemma 3:

1. A tiny random ``Gemma3ForConditionalGeneration`` made by transformers' own class (in MaxText's venv), weights
   rounded to bfloat16, saved by ``save_pretrained`` and its tower renamed to the releases' names
   (``vision_tower.vision_model.*``; transformers >= 5.8 writes ``vision_tower.*``). The tower is sized for
   MaxText's Gemma 3 vision path, which hard-codes an 896x896 image and 256 soft tokens per image: patch 56 gives
   16x16 = 256 patches (MaxText's ``VisionExit`` and HF's projector pool then leave them as they are).
2. ``ckptconv convert --multimodal`` and MaxText's ``to_maxtext ... use_multimodal=true`` (its eager
   ``transformers`` loader, the one its Gemma 3 mapping is written for), scanned on 16 devices and unscanned on 1;
   the outputs compared leaf by leaf with ``bench/compare_outputs.py``.
3. MaxText's own forward pass (``model_creation_utils.from_pretrained``, float32) on ckptconv's float32
   checkpoint against transformers' float32 logits, on text alone and on text around one image (the image's
   256 placeholder tokens bidirectional in both, as ``token_type_ids`` / MaxText's placeholder mask make them).

The script runs itself in MaxText's venv for the steps that need MaxText or torch (``hf`` and ``forward``).
Work files go to bench/work/vision/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path as a step in MaxText's venv: bench, tests
from bench import steps  # noqa: E402
from bench.steps import BENCH, DOCS, MT_ENV, MT_PYTHON, REPO, run  # noqa: E402

WORK = BENCH / "work" / "vision"
TOLERANCE = 1e-4

PLACEHOLDER = 262144  # MaxText's GEMMA_TOKEN_PLACEHOLDER, and transformers' default image_token_index
# hidden 64: sqrt(64) = 8 is exact in bfloat16. MaxText's converter (and ckptconv, as MaxText) store the embedding
# times sqrt(hidden) rounded to bfloat16, transformers scales by the exact root: at hidden 48 (6.9375 vs 6.9282)
# that alone moved the logits by 9e-4 on text and image alike, hiding what the comparison is for.
TEXT = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 7,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24, "query_pre_attn_scalar": 24,
        "sliding_window": 512, "rms_norm_eps": 1e-6,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "image_size": 896, "patch_size": 56, "vision_use_head": False}
TOP = {"mm_tokens_per_image": 256, "boi_token_index": 3, "eoi_token_index": 4, "image_token_index": PLACEHOLDER}
TEXT_TOKENS = [2, 17, 41, 9, 33, 60, 5, 88, 12, 70, 21, 6]
PREFIX, SUFFIX = [2, 17, 41, 3], [4, 33, 60, 5, 88, 12]  # around <boi> 256 x image <eoi>

# (case, family, scan, devices): Qwen3-VL's vision path runs unscanned only (its --scan-layers is refused)
CASES = [("gemma3-vision", "gemma3", True, 16), ("gemma3-vision-noscan-1dev", "gemma3", False, 1),
         ("qwen3-vl-vision-noscan", "qwen3_vl", False, 16), ("qwen3-vl-vision-noscan-1dev", "qwen3_vl", False, 1),
         ("qwen3-vl-moe-vision-noscan", "qwen3_vl_moe", False, 16),
         ("qwen3-vl-moe-vision-noscan-1dev", "qwen3_vl_moe", False, 1),
         ("qwen3.5-vision", "qwen3_5_moe", True, 16), ("qwen3.5-vision-noscan-1dev", "qwen3_5_moe", False, 1),
         ("gemma4-31b-vision", "gemma4_31b", True, 16), ("gemma4-31b-vision-noscan-1dev", "gemma4_31b", False, 1),
         ("gemma4-26b-vision", "gemma4_26b", True, 16), ("gemma4-26b-vision-noscan-1dev", "gemma4_26b", False, 1),
         ("qwen3-omni-towers-noscan", "qwen3_omni", False, 16),
         ("qwen3-omni-towers-noscan-1dev", "qwen3_omni", False, 1)]
# Gemma 4: ``python -m bench families``'s 31B (dense, hidden 48) and 26B-A4B (MoE, hidden 80) tiny models, 12 layers,
# made by transformers' Gemma4ForConditionalGeneration with the synthetic config's tower: 2 layers, hidden 32, 2 heads
# of 16, MLP 64, patch 4, 64 positions per axis, standardize (std_scale / std_bias random, as bench/hf_tiny.py sets)
GEMMA4 = {"gemma4_31b": ("GEMMA4_31B", "gemma4-31b"), "gemma4_26b": ("GEMMA4_26B", "gemma4-26b")}
FAMILIES = ("gemma3", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe", *GEMMA4, "qwen3_omni")
# the peak-memory runs: --only name -> memory_case's family (omni_memory has its own, omni_memory_case)
MEMORY = {"memory": "gemma3", "memory-qwen3_5_moe": "qwen3_5_moe", "memory_gemma4": "gemma4"}
# the families whose compared cases also export ckptconv's checkpoint back --like the source, which must give every
# tensor back bit for bit. Not Gemma 4 (never did) nor Gemma 3: its `1 + w` norms are rounded to bfloat16 in the
# checkpoint (as MaxText's converter does) and come back within one bfloat16 step (measured: 88 of 132 tensors
# identical, the other 44 every norm, max abs diff 0.0039), as tests/test_export.py says
EXPORT_BACK = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe", "qwen3_omni")
# Qwen3-VL: 2 decoder layers (hidden 64), a 2-block tower (hidden 32, 2 heads, MLP 64) with a deepstack merger
# after each block, made by transformers' Qwen3VLForConditionalGeneration (bench/hf_tiny.py)
QWEN3_VL_VISION = {"depth": 2, "deepstack_visual_indexes": [0, 1]}
# Qwen3-VL-MoE: the same tower beside a 2-layer MoE decoder (4 experts of width 48), made by
# Qwen3VLMoeForConditionalGeneration, its fused experts written back in the releases' layout (bench/hf_tiny.py)
QWEN3_VL_MOE = {"num_experts": 4, "moe_intermediate_size": 48, "tie_word_embeddings": False}
MAXTEXT_MODEL = {"qwen3_vl": "qwen3-vl-2b", "qwen3_vl_moe": "qwen3-vl-30b-a3b", "qwen3_5_moe": "qwen3.5-35b-a3b"}
# Qwen3.5: tests/hub_checkpoints.py's tiny 35B-A3B (made by Qwen3_5MoeForConditionalGeneration, stored as the hub
# ships it: three files and an index, experts fused, linear-attention projections apart, mtp.*) with a 2-block tower
QWEN3_5_VISION = {"depth": 2}
# Qwen3-Omni: 2 decoder layers (hidden 64, 4 experts), the same vision tower, a 2-layer audio tower (d_model 32,
# 2 heads, FFN 64, 16 mel bins, 16 convolution channels)
QWEN3_OMNI_AUDIO = {"encoder_layers": 2}


# --- in MaxText's venv -----------------------------------------------------------------------

def make_hf(out: Path) -> None:
    """The tiny model, its hub-named files, and transformers' float32 logits on both inputs."""
    import ml_dtypes  # noqa: F401  (safetensors' numpy reader needs bfloat16 known)
    import numpy as np
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=TEXT, vision_config=VISION, **TOP))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32) + 0)
            if p.ndim == 1:  # norms and biases: non-zero, so a missed (1 + w) or bias shows
                p.add_(torch.randn_like(p).mul(0.1).to(torch.bfloat16).to(torch.float32))
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    model = Gemma3ForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()  # reads them back
    rng = np.random.default_rng(7)
    pixels = rng.uniform(-1, 1, (1, 3, 896, 896)).astype(np.float32)
    image_ids = PREFIX + [PLACEHOLDER] * 256 + SUFFIX
    with torch.no_grad():
        text = model(input_ids=torch.tensor([TEXT_TOKENS])).logits[0].numpy()
        ids = torch.tensor([image_ids])
        image = model(input_ids=ids, pixel_values=torch.from_numpy(pixels),
                      token_type_ids=(ids == PLACEHOLDER).long()).logits[0].numpy()
    np.save(out / "pixels.npy", pixels)
    np.save(out / "image_ids.npy", np.array(image_ids))
    np.save(out / "text_logits.npy", text)
    np.save(out / "image_logits.npy", image)


GEMMA4_PLACEHOLDER = 258880  # MaxText's GEMMA4_TOKEN_PLACEHOLDER and the releases' image_token_id
GEMMA4_SIDE = 16  # a 16x16 image in 4x4 patches: 16 patches, pooled 2x2 into 4 soft tokens (the synthetic tower)
GEMMA4_PREFIX, GEMMA4_SUFFIX = [2, 17, 41, 3], [4, 33, 60, 5]  # around the soft tokens (3, 4: plain tokens here)


def gemma4_image_logits(out: Path) -> None:
    """transformers' float32 logits of the model bench/hf_tiny.py saved in ``out``: on text, and on text around
    one image (pixel_values as patches flattened (row, column, channel), (x, y) positions row-major, the soft
    tokens bidirectional among themselves in the sliding layers through ``mm_token_type_ids``)."""
    import numpy as np
    import torch
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    vision = json.loads((out / "config.json").read_text())["vision_config"]
    p, n = vision["patch_size"], GEMMA4_SIDE // vision["patch_size"]
    image = np.random.default_rng(7).uniform(0, 1, (GEMMA4_SIDE, GEMMA4_SIDE, 3)).astype(np.float32)
    patches = image.reshape(n, p, n, p, 3).transpose(0, 2, 1, 3, 4).reshape(n * n, p * p * 3)
    xy = np.stack(np.meshgrid(np.arange(n), np.arange(n)), -1).reshape(-1, 2)  # patch i * n + j at (x=j, y=i)
    soft = n * n // vision["pooling_kernel_size"] ** 2
    ids = GEMMA4_PREFIX + [GEMMA4_PLACEHOLDER] * soft + GEMMA4_SUFFIX
    with torch.no_grad():
        text = model(input_ids=torch.tensor([TEXT_TOKENS])).logits[0].numpy()
        tokens = torch.tensor([ids])
        with_image, grey = (model(input_ids=tokens, pixel_values=torch.from_numpy(pixels)[None],
                                  image_position_ids=torch.from_numpy(xy)[None],
                                  mm_token_type_ids=(tokens == GEMMA4_PLACEHOLDER).long()).logits[0].numpy()
                            for pixels in (patches, np.full_like(patches, 0.5)))
    # how far the picture moves the logits (against a flat grey one): the comparison sees the vision path
    (out / "image_effect.json").write_text(json.dumps(float(np.abs(with_image - grey).max())))
    np.save(out / "pixels.npy", image[None])
    np.save(out / "image_ids.npy", np.array(ids))
    np.save(out / "text_logits.npy", text)
    np.save(out / "image_logits.npy", with_image)


def gemma4_forward(ckpt: str, hf_dir: str, work: str, maxtext_model: str) -> dict:
    """MaxText's gemma4-31b / gemma4-26b with use_multimodal=true on ckptconv's float32 checkpoint (scanned)."""
    from bench import maxtext_logits

    hf = Path(hf_dir)
    config = json.loads((hf / "config.json").read_text())
    vision = config["vision_config"]
    values = maxtext_logits.gemma4_overrides(config["text_config"]) | {
        "use_multimodal": "true", "hidden_size_for_vit": vision["hidden_size"],
        "intermediate_size_for_vit": vision["intermediate_size"],
        "num_hidden_layers_for_vit": vision["num_hidden_layers"],
        "num_attention_heads_for_vit": vision["num_attention_heads"], "patch_size_for_vit": vision["patch_size"],
        "conv_stride_for_vit": vision["patch_size"], "num_position_embeddings_for_vit": vision["position_embedding_size"],
        "image_size_for_vit": f"[{GEMMA4_SIDE},{GEMMA4_SIDE}]",
        "vision_output_length": (GEMMA4_SIDE // vision["patch_size"] // vision["pooling_kernel_size"]) ** 2,
        "normalization_layer_epsilon": config["text_config"]["rms_norm_eps"]}
    return run_maxtext(ckpt, hf, work, maxtext_model, values)


def run_maxtext(ckpt: str, hf: Path, work: str, maxtext_model: str, values: dict) -> dict:
    import jax.numpy as jnp
    import maxtext
    import numpy as np
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    image_ids = np.load(hf / "image_ids.npy")
    length = max(len(image_ids), len(TEXT_TOKENS))
    overrides = {
        "model_name": maxtext_model, "override_model_config": True, "hardware": "cpu",
        "skip_jax_distributed_system": True, "base_output_directory": work, "run_name": "logits",
        "load_parameters_path": ckpt, "attention": "dot_product", "dtype": "float32", "weight_dtype": "float32",
        "matmul_precision": "highest", "per_device_batch_size": 1, "max_target_length": length,
        "max_prefill_predict_length": length, "enable_checkpointing": False, "enable_dropout": False,
        "dtype_mm": "float32", "scan_layers": "true", **values}
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(["logits", base, *[f"{k}={v}" for k, v in overrides.items()]])
    model, _ = model_creation_utils.from_pretrained(config)
    result = {}
    for name, ids, images in (("text", np.array(TEXT_TOKENS), None), ("image", image_ids, np.load(hf / "pixels.npy"))):
        tokens = jnp.asarray(ids[None], jnp.int32)
        positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
        kwargs = {} if images is None else {"encoder_images": jnp.asarray(images, jnp.float32)}
        logits = np.asarray(model(tokens, positions, jnp.ones_like(tokens), enable_dropout=False, **kwargs),
                            np.float32)[0]
        want = np.load(hf / f"{name}_logits.npy")
        diff = float(np.abs(logits[:, : want.shape[-1]] - want).max())
        result[name] = {"max_abs_logits_diff": diff, "max_abs_logit": float(np.abs(want).max()),
                        "tokens": int(len(ids)), "ok": diff <= TOLERANCE}
    if (hf / "image_effect.json").exists():
        result["image"]["image_effect"] = json.loads((hf / "image_effect.json").read_text())
    return result


def qwen3_vl_sizes(config: dict) -> list[str]:
    """MaxText's qwen3-vl-2b (qwen3-vl-30b-a3b) given the checkpoint's text and tower sizes, use_multimodal=true
    (unscanned)."""
    text, vision = config["text_config"], config["vision_config"]
    values = {"base_emb_dim": text["hidden_size"], "base_num_query_heads": text["num_attention_heads"],
              "base_num_kv_heads": text["num_key_value_heads"], "head_dim": text["head_dim"],
              "base_mlp_dim": text["intermediate_size"], "base_num_decoder_layers": text["num_hidden_layers"],
              "vocab_size": text["vocab_size"], "scan_layers": "false", "use_multimodal": "true",
              "mrope_section": json.dumps(text["rope_scaling"]["mrope_section"]).replace(" ", ""),
              "hidden_size_for_vit": vision["hidden_size"], "intermediate_size_for_vit": vision["intermediate_size"],
              "num_attention_heads_for_vit": vision["num_heads"], "num_hidden_layers_for_vit": vision["depth"],
              "deepstack_visual_indexes_for_vit": json.dumps(vision["deepstack_visual_indexes"]).replace(" ", ""),
              "out_hidden_size_for_vit": vision["out_hidden_size"],
              "num_position_embeddings_for_vit": vision.get("num_position_embeddings", 2304),
              "patch_size_for_vit": vision.get("patch_size", 16),
              "temporal_patch_size_for_vit": vision.get("temporal_patch_size", 2),
              "spatial_merge_size_for_vit": vision.get("spatial_merge_size", 2)}
    if config["model_type"] == "qwen3_vl_moe":
        values |= {"num_experts": text["num_experts"], "num_experts_per_tok": text["num_experts_per_tok"],
                   "base_moe_mlp_dim": text["moe_intermediate_size"], "base_mlp_dim": text["moe_intermediate_size"]}
    return [f"{k}={v}" for k, v in values.items()]


def qwen3_5_sizes(config: dict, scan: bool) -> list[str]:
    """MaxText's qwen3.5-35b-a3b given the checkpoint's sizes (``python -m bench families``'s) and its tower's,
    use_multimodal=true (no deepstack: MaxText runs it scanned too)."""
    sys.path.insert(0, str(REPO))
    from bench.compare_families import Case, overrides

    vision = config["vision_config"]
    values = {"use_multimodal": "true", "hidden_size_for_vit": vision["hidden_size"],
              "intermediate_size_for_vit": vision["intermediate_size"],
              "num_attention_heads_for_vit": vision["num_heads"], "num_hidden_layers_for_vit": vision["depth"],
              "out_hidden_size_for_vit": vision["out_hidden_size"],
              "num_position_embeddings_for_vit": vision["num_position_embeddings"],
              "patch_size_for_vit": vision["patch_size"], "temporal_patch_size_for_vit": vision["temporal_patch_size"],
              "spatial_merge_size_for_vit": vision["spatial_merge_size"]}
    return overrides(Case("qwen3.5-vision", None, "qwen3.5-35b-a3b", scan=scan, hub=config)) + [
        f"{k}={v}" for k, v in values.items()]


def qwen3_omni_sizes(config: dict) -> list[str]:
    """MaxText's qwen3-omni-30b-a3b given the thinker's text, vision and audio sizes, use_multimodal and use_audio
    (unscanned)."""
    thinker = config["thinker_config"]
    text, audio = thinker["text_config"], thinker["audio_config"]
    values = dict(item.split("=", 1) for item in qwen3_vl_sizes({**thinker, "text_config": {
        **text, "intermediate_size": text["moe_intermediate_size"]}}))
    values |= {"num_experts": text["num_experts"], "num_experts_per_tok": 2,
               "base_moe_mlp_dim": text["moe_intermediate_size"], "use_audio": "true",
               "d_model_for_audio": audio["d_model"], "encoder_layers_for_audio": audio["encoder_layers"],
               "encoder_attention_heads_for_audio": audio["encoder_attention_heads"],
               "encoder_ffn_dim_for_audio": audio["encoder_ffn_dim"], "num_mel_bins_for_audio": audio["num_mel_bins"],
               "downsample_hidden_size_for_audio": audio["downsample_hidden_size"],
               "output_dim_for_audio": audio["output_dim"]}
    return [f"{k}={v}" for k, v in values.items()]


def maxtext_sizes(scan: bool) -> list[str]:
    values = {"base_emb_dim": TEXT["hidden_size"], "base_num_query_heads": TEXT["num_attention_heads"],
              "base_num_kv_heads": TEXT["num_key_value_heads"], "head_dim": TEXT["head_dim"],
              "base_mlp_dim": TEXT["intermediate_size"], "base_num_decoder_layers": TEXT["num_hidden_layers"],
              "scan_layers": str(scan).lower(), "use_multimodal": "true",
              "hidden_size_for_vit": VISION["hidden_size"], "intermediate_size_for_vit": VISION["intermediate_size"],
              "num_hidden_layers_for_vit": VISION["num_hidden_layers"],
              "num_attention_heads_for_vit": VISION["num_attention_heads"], "image_size_for_vit": VISION["image_size"],
              "patch_size_for_vit": VISION["patch_size"], "conv_stride_for_vit": VISION["patch_size"]}
    return [f"{k}={v}" for k, v in values.items()]


def forward(ckpt: str, hf_dir: str, work: str) -> dict:
    """MaxText's model on ckptconv's checkpoint (scanned, float32): logits on text, and on text and an image."""
    import jax.numpy as jnp
    import maxtext
    import numpy as np
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    hf = Path(hf_dir)
    image_ids = np.load(hf / "image_ids.npy")
    overrides = {
        "model_name": "gemma3-4b", "override_model_config": True, "hardware": "cpu",
        "skip_jax_distributed_system": True, "base_output_directory": work, "run_name": "logits",
        "load_parameters_path": ckpt, "attention": "dot_product", "dtype": "float32", "weight_dtype": "float32",
        "matmul_precision": "highest", "per_device_batch_size": 1, "max_target_length": len(image_ids),
        "max_prefill_predict_length": len(image_ids), "enable_checkpointing": False, "enable_dropout": False,
        "sliding_window_size": TEXT["sliding_window"], "rope_max_timescale": 10000, "local_rope_max_timescale": 10000,
        "rope_linear_scaling_factor": 1.0, "dtype_mm": "float32",
    }
    settings = [f"{k}={v}" for k, v in overrides.items()] + maxtext_sizes(True)
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(["logits", base, *settings])
    model, _ = model_creation_utils.from_pretrained(config)
    result = {}
    for name, ids, images in (("text", np.array(TEXT_TOKENS), None),
                              ("image", image_ids, np.load(hf / "pixels.npy").transpose(0, 2, 3, 1))):
        tokens = jnp.asarray(ids[None], jnp.int32)
        positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
        kwargs = {} if images is None else {"encoder_images": jnp.asarray(images, jnp.float32)}
        logits = np.asarray(model(tokens, positions, jnp.ones_like(tokens), enable_dropout=False, **kwargs),
                            np.float32)[0]
        want = np.load(hf / f"{name}_logits.npy")
        diff = float(np.abs(logits[:, : want.shape[-1]] - want).max())
        result[name] = {"max_abs_logits_diff": diff, "max_abs_logit": float(np.abs(want).max()),
                        "tokens": int(len(ids)), "ok": diff <= TOLERANCE}
    return result


def omni_towers(ckpt: str, hf_dir: str, work: str) -> dict:
    """MaxText's Qwen3-Omni towers on ckptconv's float32 checkpoint (unscanned) against transformers' on the source:
    the audio tower's output (after its projector) on one 100-frame chunk of random mel features, and the vision
    tower's merged image embeddings and deepstack features on one random 32x32 image (2x2 merged tokens)."""
    import jax.numpy as jnp
    import maxtext
    import numpy as np
    import torch
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils
    from transformers import Qwen3OmniMoeForConditionalGeneration

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    thinker = config["thinker_config"]
    audio, vision = thinker["audio_config"], thinker["vision_config"]
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval().thinker.model
    rng = np.random.default_rng(7)
    frames = 100  # one chunk (n_window * 2): MaxText attends within a chunk, transformers within 8 (n_window_infer)
    mel = rng.normal(size=(audio["num_mel_bins"], frames)).astype(np.float32)
    patch, tpatch, channels = vision["patch_size"], vision["temporal_patch_size"], vision["in_channels"]
    grid = (1, 2 * vision["spatial_merge_size"], 2 * vision["spatial_merge_size"])  # 4x4 patches
    patches = grid[0] * grid[1] * grid[2]
    pixels = rng.uniform(-1, 1, (patches, channels * tpatch * patch * patch)).astype(np.float32)
    def reference() -> dict:
        with torch.no_grad():
            heard = hf.audio_tower(torch.from_numpy(mel), feature_lens=torch.tensor([frames])).last_hidden_state
            seen = hf.visual(torch.from_numpy(pixels), grid_thw=torch.tensor([grid]))
        return {"audio": heard.numpy(), "image": seen.pooler_output.numpy(),
                **{f"deepstack_{j}": f.numpy() for j, f in enumerate(seen.deepstack_features)}}

    want = reference()
    # MaxText's towers use jax.nn.gelu (the tanh form) where transformers' use the exact GELU (the audio tower's
    # convolutions, MLP and projector; the vision mergers): transformers again with every GELU in the tanh form
    exact_gelu = torch.nn.functional.gelu

    def tanh_gelu(x, approximate="none"):
        return exact_gelu(x, approximate="tanh")

    bound = [m for m in hf.modules() if getattr(m, "act", None) is exact_gelu]  # GELUActivation keeps its own
    torch.nn.functional.gelu = tanh_gelu
    for module in bound:
        module.act = tanh_gelu
    try:
        want_tanh = reference()
    finally:
        torch.nn.functional.gelu = exact_gelu
        for module in bound:
            module.act = exact_gelu

    overrides = {
        "model_name": "qwen3-omni-30b-a3b", "override_model_config": True, "hardware": "cpu",
        "skip_jax_distributed_system": True, "base_output_directory": work, "run_name": "towers",
        "load_parameters_path": ckpt, "attention": "dot_product", "dtype": "float32", "weight_dtype": "float32",
        "matmul_precision": "highest", "per_device_batch_size": 1, "max_target_length": 16,
        "max_prefill_predict_length": 16, "enable_checkpointing": False, "enable_dropout": False,
        "dtype_mm": "float32", "n_window_for_audio": audio.get("n_window", 50),
    }
    # the sizes from the config.json the checkpoint was made from (the hub's spelling: rope_scaling)
    settings = [f"{k}={v}" for k, v in overrides.items()] + qwen3_omni_sizes(
        json.loads((WORK / "qwen3-omni-config.json").read_text()))
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    model, _ = model_creation_utils.from_pretrained(pyconfig.initialize(["towers", base, *settings]))
    got = {"audio": np.asarray(model.audio_encoder(jnp.asarray(mel[None]), deterministic=True), np.float32)[0]}
    # MaxText takes the processor's patch rows as one (batch, C, T, H, W) array and cuts it back into the same rows
    image = jnp.asarray(pixels.reshape(1, channels, grid[0] * tpatch, grid[1] * patch, grid[2] * patch))
    embeddings, deep = model.vision_encoder(image, deterministic=True)
    got["image"] = np.asarray(embeddings, np.float32).reshape(want["image"].shape)
    got |= {f"deepstack_{j}": np.asarray(f, np.float32).reshape(want[f"deepstack_{j}"].shape)
            for j, f in enumerate(deep or [])}
    result = {}
    for name, reference in want.items():
        if name not in got:
            result[name] = {"error": "MaxText returned no such output"}
            continue
        diff = float(np.abs(got[name] - reference).max())
        result[name] = {"shape": list(reference.shape), "max_abs": float(np.abs(reference).max()),
                        "max_abs_diff": diff, "ok": diff <= TOLERANCE,
                        "max_abs_diff_tanh_gelu": float(np.abs(got[name] - want_tanh[name]).max())}
    return result


# --- in ckptconv's venv ----------------------------------------------------------------------

def last_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1][:200] if lines else f"exit {result.returncode}"


def make_qwen3_vl(family: str, hf: Path) -> subprocess.CompletedProcess:
    from ckptconv.commands import synth

    fields = QWEN3_VL_MOE if family == "qwen3_vl_moe" else {}
    config = synth.SynthModel(model_type=family, num_layers=2, vocab_size=300, **fields).config()
    config["vision_config"].update(QWEN3_VL_VISION)
    path = WORK / f"{family}-config.json"
    path.write_text(json.dumps(config))
    return steps.hf_tiny(path, hf, WORK / f"hf-{family}.log")


def make_qwen3_5(hf: Path) -> subprocess.CompletedProcess:
    """The hub-format Qwen3.5 checkpoint (in MaxText's venv: torch, transformers 5.25)."""
    sys.path.insert(0, str(REPO))
    from tests import hub_checkpoints

    config = hub_checkpoints.qwen3_5_moe_config()
    config["vision_config"].update(QWEN3_5_VISION)
    path = WORK / "qwen3_5_moe-config.json"
    path.write_text(json.dumps(config))
    code = ("import json, sys; sys.path.insert(0, sys.argv[3]); from tests import hub_checkpoints; "
            "hub_checkpoints.make(sys.argv[2], json.load(open(sys.argv[1])))")
    return run([MT_PYTHON, "-c", code, path, hf, REPO], WORK / "hf-qwen3_5_moe.log", env=MT_ENV)


def gemma4_case(family: str, scan: bool) -> "compare_families.Case":  # noqa: F821
    from bench import compare_families

    model, maxtext_model = GEMMA4[family]
    return compare_families.Case(family, getattr(compare_families, model), maxtext_model, scan=scan,
                                 maker="transformers")


def make_gemma4(family: str, hf: Path) -> subprocess.CompletedProcess:
    path = WORK / f"{family}-config.json"
    path.write_text(json.dumps(gemma4_case(family, True).config()))
    return steps.hf_tiny(path, hf, WORK / f"hf-{family}.log")


def gemma4_sizes(family: str, scan: bool) -> list[str]:
    """compare_families' text sizes for MaxText's gemma4-31b / gemma4-26b, use_multimodal=true and the tower's."""
    from bench import compare_families

    case = gemma4_case(family, scan)
    vision = case.config()["vision_config"]
    values = {"use_multimodal": "true", "hidden_size_for_vit": vision["hidden_size"],
              "intermediate_size_for_vit": vision["intermediate_size"],
              "num_hidden_layers_for_vit": vision["num_hidden_layers"],
              "num_attention_heads_for_vit": vision["num_attention_heads"], "patch_size_for_vit": vision["patch_size"],
              "conv_stride_for_vit": vision["patch_size"],
              "num_position_embeddings_for_vit": vision["position_embedding_size"],
              "image_size_for_vit": "[16,16]"}
    return [item for item in compare_families.overrides(case) if not item.startswith("use_multimodal=")] + [
        f"{k}={v}" for k, v in values.items()]


def make_qwen3_omni(hf: Path) -> subprocess.CompletedProcess:
    from ckptconv.commands import synth

    config = synth.SynthModel(model_type="qwen3_omni_moe", num_layers=2, num_experts=4, moe_intermediate_size=48,
                              tie_word_embeddings=False, vocab_size=300).config()
    config["thinker_config"]["vision_config"].update(QWEN3_VL_VISION)
    config["thinker_config"]["audio_config"].update(QWEN3_OMNI_AUDIO)
    path = WORK / "qwen3-omni-config.json"
    path.write_text(json.dumps(config))
    return steps.hf_tiny(path, hf, WORK / "hf-qwen3-omni.log")


def refusal(hf: Path, family: str) -> dict:
    """ckptconv's answer to --multimodal --scan-layers for Qwen3-VL (Qwen3-VL-MoE, Qwen3-Omni: deepstack): one line,
    exit 2, nothing written."""
    dst = WORK / f"{family}-scan-refused"
    shutil.rmtree(dst, ignore_errors=True)
    result = steps.convert(hf, dst, WORK / f"{family}-scan-refused.log", "--multimodal", "--scan-layers")
    return {"exit": result.returncode, "stderr": result.stderr.strip(), "written": dst.exists()}


def export_back(ours: Path, hf: Path, root: Path) -> dict:
    """``ckptconv export`` of ckptconv's checkpoint, ``--like`` the source: every tensor it writes against the
    source's, byte for byte, and the source's tensors it does not write (those the conversion reported). ``export``
    / ``export_ok``: the tables' column; ``export_*`` counts: the Qwen3-Omni section's lines."""
    import ml_dtypes  # noqa: F401  (bfloat16 known to numpy)
    from safetensors.numpy import load_file

    dst = root / "exported"
    shutil.rmtree(dst, ignore_errors=True)
    done = run([sys.executable, "-m", "ckptconv", "export", ours, dst, "--like", hf, "--progress", "none"],
               root / "export.log")
    if done.returncode:
        return {"export": f"failed: `{last_line(done)}`", "export_exit": done.returncode,
                "export_error": last_line(done)}

    def tensors(directory: Path) -> dict:
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    source, back = tensors(hf), tensors(dst)
    shutil.rmtree(dst, ignore_errors=True)
    same = [k for k in back if k in source and source[k].dtype == back[k].dtype and
            source[k].shape == back[k].shape and source[k].tobytes() == back[k].tobytes()]
    differ = sorted((set(source) & set(back)) - set(same))
    left = sorted({k.split(".")[0] for k in set(source) - set(back)})
    unwritten = f", not written: {', '.join(left)}.*" if left else ""
    return {"export": f"{len(same)}/{len(back)} tensors identical{unwritten}", "export_ok": len(same) == len(back),
            "export_exit": 0, "export_tensors": len(back), "source_tensors": len(source),
            "export_identical": not differ and source.keys() == back.keys(),
            "export_differ": differ[:3] + sorted(source.keys() ^ back.keys())[:3]}


def compare_case(name: str, family: str, scan: bool, devices: int, hf: Path) -> dict:
    root = WORK / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ours, theirs = root / "ckptconv", root / "maxtext"
    mine = steps.convert(hf, ours, root / "ckptconv.log", "--devices", devices,
                         "--scan-layers" if scan else "--no-scan-layers", "--multimodal")
    if family == "gemma3":
        model, sizes, loader = "gemma3-4b", maxtext_sizes(scan), "transformers"
    elif family in GEMMA4:
        model, sizes, loader = GEMMA4[family][1], gemma4_sizes(family, scan), "safetensors"
    elif family == "qwen3_5_moe":
        model, loader = MAXTEXT_MODEL[family], "safetensors"
        sizes = qwen3_5_sizes(json.loads((WORK / f"{family}-config.json").read_text()), scan)
    elif family == "qwen3_omni":
        model, loader = "qwen3-omni-30b-a3b", "safetensors"
        sizes = qwen3_omni_sizes(json.loads((WORK / "qwen3-omni-config.json").read_text()))
    else:
        model, loader = MAXTEXT_MODEL[family], "safetensors"
        sizes = qwen3_vl_sizes(json.loads((WORK / f"{family}-config.json").read_text()))
    mt = steps.maxtext_convert(model, hf, theirs, sizes, ["--lazy_load_tensors=false", f"--eager_load_method={loader}",
                                                       f"--simulated_cpu_devices_count={devices}",
                                                       "--save_dtype=bfloat16"],
                               root / "maxtext.log", env={"HF_HOME": str(WORK / "hf-home")})
    row = {"case": name, "family": family, "scan": scan, "devices": devices, "ckptconv_exit": mine.returncode,
           "maxtext_exit": mt.returncode}
    if mine.returncode or mt.returncode:
        return row | {"error": last_line(mine if mine.returncode else mt)}
    compared, result = steps.compare_outputs(ours, theirs, root / "compare.json", root / "compare.log")
    if family in EXPORT_BACK:
        row |= export_back(ours, hf, root)
    listed = result.get("compared", result.get("leaves", []))
    tower = [leaf for leaf in listed if "vision_encoder" in str(leaf)]
    audio = [leaf for leaf in listed if "audio_encoder" in str(leaf)]
    return row | {"identical": result["identical"], "leaves": result["leaves_compared"],
                  "vision_leaves": len(tower) or None, "audio_leaves": len(audio) or None,
                  "bytes": result["bytes_compared"],
                  "value_mismatches": result["value_mismatches"][:3], "only_in_ckptconv": result["only_in_a"],
                  "only_in_maxtext": result["only_in_b"], "compare_exit": compared.returncode,
                  "metadata_differences": sorted({d["field"] for d in result["metadata_differences"]})}


def forward_case(hf: Path, step: str = "forward", directory: str = "logits") -> dict:
    """``convert --multimodal --dtype float32 --devices 1``, then this script's ``step`` (``forward``: the decoder's
    logits on text and an image; ``omni-towers``: Qwen3-Omni's towers alone) in MaxText's venv."""
    root = WORK / directory
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ours = root / "ckptconv-f32"
    mine = steps.convert(hf, ours, root / "ckptconv.log", "--devices", 1, "--dtype", "float32", "--multimodal")
    if mine.returncode:
        return {"error": last_line(mine)}
    fwd = run([MT_PYTHON, __file__, step, ours / "0" / "items", hf, root], root / "forward.log", env=MT_ENV)
    if fwd.returncode:
        return {"error": last_line(fwd)}
    return json.loads(fwd.stdout.strip().splitlines()[-1])


# what the towers' differences are (measured by hand on MaxText's own float32 conversion, see the driver's note)
OMNI_TOWERS_NOTE = (
    "The differences are MaxText's run-time code, not the weights: on MaxText's own conversion of the same checkpoint "
    "(`to_maxtext ... --save_dtype=float32`, measured once by hand on 2026-12-05) the same forward gives the same "
    "differences to every digit (2.16e-05, 1.53e-04, 1.27e-04, 1.12e-04). MaxText's towers use `jax.nn.gelu` (the "
    "tanh form) where transformers' use the exact GELU (the audio convolutions, MLP and projector; the vision "
    "mergers): with transformers' GELUs in the tanh form (last column) the audio tower agrees to float32 rounding; "
    "the vision tower's remaining 2-3e-5 were not traced further (MaxText's vision path: rotary and interpolated "
    "positions, attention).")


# the releases' towers: Gemma 3's SigLIP (27 layers, hidden 1152, MLP 4304, 4096 positions) and Gemma 4's 26B-A4B / 31B
# tower (27 layers, hidden 1152 = 16 heads of 72, MLP 4304, patch 16, 10240 positions per axis, standardize)
RELEASE_TOWERS = {
    "gemma3": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
               "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
    "gemma4": {"hidden_size": 1152, "intermediate_size": 4304, "model_type": "gemma4_vision", "num_attention_heads": 16,
               "num_key_value_heads": 16, "head_dim": 72, "global_head_dim": 72, "num_hidden_layers": 27,
               "patch_size": 16, "position_embedding_size": 10240, "pooling_kernel_size": 3, "standardize": True,
               "use_clipped_linears": False}}
# Qwen3-VL-30B-A3B's and Qwen3.5-35B-A3B's tower (27 blocks, hidden 1152, MLP 4304, 16 heads)
QWEN_TOWER = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
              "num_position_embeddings": 2304, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}


def gemma4_logits_case(family: str) -> dict:
    """maxtext_logits.py's Gemma 4 tiny model (hidden 64, 12 layers, sliding window 5) with the synthetic tower, made
    by transformers' class; ckptconv ``--multimodal --dtype float32 --devices 1`` (scanned); MaxText's forward on
    text and on text around one image against transformers' float32 logits."""
    from bench import maxtext_logits
    from ckptconv.commands import synth

    root = WORK / f"logits-{family}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sizes = dict(maxtext_logits.GEMMA4 if family == "gemma4_31b" else maxtext_logits.GEMMA4_MOE)
    config = synth.SynthModel(model_type="gemma4", **sizes).config()
    (root / "config.json").write_text(json.dumps(config))
    hf, ours = root / "hf", root / "ckptconv-f32"
    for step in ([MT_PYTHON, BENCH / "hf_tiny.py", root / "config.json", hf], [MT_PYTHON, __file__, "gemma4-hf", hf]):
        made = run(step, root / "hf.log", env=MT_ENV)
        if made.returncode:
            return {"error": last_line(made)}
    mine = steps.convert(hf, ours, root / "ckptconv.log", "--devices", 1, "--dtype", "float32", "--multimodal")
    if mine.returncode:
        return {"error": last_line(mine)}
    fwd = run([MT_PYTHON, __file__, "gemma4-forward", ours / "0" / "items", hf, root, GEMMA4[family][1]],
              root / "forward.log", env=MT_ENV)
    if fwd.returncode:
        return {"error": last_line(fwd)}
    return json.loads(fwd.stdout.strip().splitlines()[-1])


def memory_case(family: str = "gemma3") -> dict:
    """Peak RSS of ``convert --multimodal`` against ``plan``'s prediction, with the release's whole tower: Gemma 3
    4B's decoder widths (2 layers) beside the SigLIP tower (0.83 GB), Gemma 4 26B-A4B's (one block of 6 layers,
    8 experts) beside Gemma 4's tower (1.1 GB), or (``qwen3_5_moe``) one period of Qwen3.5-35B-A3B's widths (16 of
    its 256 experts, a vocabulary of 8192) beside the release's tower (0.89 GB)."""
    from ckptconv.commands import synth
    from ckptconv.families import gemma4

    class WithTower(synth.SynthModel):
        def config(self) -> dict:
            config = super().config()
            if family in RELEASE_TOWERS:
                config["vision_config"] = RELEASE_TOWERS[family]
            else:
                config["vision_config"].update(QWEN_TOWER, out_hidden_size=self.hidden_size)
            return config

    src = WORK / f"memory-src-{family}"
    shutil.rmtree(src, ignore_errors=True)
    if family == "qwen3_5_moe":
        model = WithTower(model_type="qwen3_5_moe", vocab_size=8192, hidden_size=2048, num_layers=4, num_heads=16,
                          num_kv_heads=2, head_dim=256, num_experts=16, moe_intermediate_size=512,
                          tie_word_embeddings=False, encoders=True,
                          config_overrides={"linear_num_key_heads": 16, "linear_num_value_heads": 32,
                                            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                            "shared_expert_intermediate_size": 512})
    else:
        sizes = ({"vocab_size": 262208, "hidden_size": 2560, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4,
                  "head_dim": 256, "intermediate_size": 10240} if family == "gemma3"
                 else {**gemma4.WIDTHS_26B, "num_layers": 6, "num_experts": 8})
        model = WithTower(model_type=family, encoders=True, **sizes)
    synth.write_checkpoint(model, str(src))
    return measure_peaks(src, "memory")


def omni_memory_case() -> dict:
    """Peak RSS of ``convert --multimodal`` with Qwen3-Omni-30B-A3B's whole towers (vision: 27 blocks, hidden 1152,
    MLP 4304, deepstack [8, 16, 24]; audio: 32 layers, d_model 1280, FFN 5120, 128 mel bins, 480 channels;
    about 2.3 GB of towers) beside 2 decoder layers at the release's widths with 8 experts, against ``plan``'s prediction."""
    from ckptconv.commands import synth

    class WithTowers(synth.SynthModel):
        def config(self) -> dict:
            config = super().config()
            config["thinker_config"]["vision_config"] = {
                "model_type": "qwen3_omni_moe_vision_encoder", "depth": 27, "hidden_size": 1152,
                "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048,
                "deepstack_visual_indexes": [8, 16, 24]}
            config["thinker_config"]["audio_config"] = {
                "model_type": "qwen3_omni_moe_audio_encoder", "encoder_layers": 32, "d_model": 1280,
                "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "num_mel_bins": 128,
                "downsample_hidden_size": 480, "output_dim": 2048}
            return config

    src = WORK / "omni-memory-src"
    shutil.rmtree(src, ignore_errors=True)
    synth.write_checkpoint(WithTowers(model_type="qwen3_omni_moe", vocab_size=8192, hidden_size=2048, num_layers=2,
                                      num_heads=32, num_kv_heads=4, head_dim=128, num_experts=8,
                                      moe_intermediate_size=768, tie_word_embeddings=False, encoders=True), str(src))
    return measure_peaks(src, "omni-memory")


def measure_peaks(src: Path, name: str) -> dict:
    """``plan``'s predicted peak and ``convert --multimodal``'s measured one for ``src`` on 16 devices and on 1
    (outputs and ``src`` removed after; logs ``WORK/<name>-plan.log`` and ``-convert.log``)."""
    rows = []
    for devices in (16, 1):
        dst = WORK / f"{name}-dst{devices}"
        shutil.rmtree(dst, ignore_errors=True)
        flags = ["--multimodal", "--devices", str(devices)]
        planned = run([sys.executable, "-m", "ckptconv", "plan", src, *flags, "--json"], WORK / f"{name}-plan.log")
        done = steps.convert(src, dst, WORK / f"{name}-convert.log", *flags)
        report = json.loads((dst / "ckptconv-report.json").read_text()) if done.returncode == 0 else {}
        rows.append({"devices": devices, "predicted": json.loads(planned.stdout)["predicted_peak_rss_bytes"],
                     "measured": report.get("peak_rss_bytes"), "source_bytes": report.get("source_bytes"),
                     "leaves": report.get("leaves"), "exit": done.returncode})
        shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return {"rows": rows}


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | scan | devices | leaves | MiB | result | metadata that differs | export back |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['scan']} | {r['devices']} | - | - | failed (ckptconv exit "
                         f"{r['ckptconv_exit']}, MaxText exit {r['maxtext_exit']}: `{r['error']}`) | - | - |")
            continue
        result = "**identical**" if r["identical"] else (
            f"DIFFERENT: {r['value_mismatches'] or r['only_in_ckptconv'] or r['only_in_maxtext']}")
        lines.append(f"| {r['case']} | {r['scan']} | {r['devices']} | {r['leaves']} | {r['bytes'] / 2**20:.1f} | "
                     f"{result} | {', '.join(r['metadata_differences']) or 'none'} | {r.get('export', 'not run')} |")
    return lines


# written by hand into VISION.md's Gemma 4 section (g4vis): the export back and the refusals, measured by the tests
GEMMA4_NOTE = (
    "`export` back to the hub's names is bit-identical (tests/test_gemma4_vision.py, scanned on 16 "
    "devices and unscanned\non 1: every tensor, the tower's included). E2B / E4B with `--multimodal`: "
    "exit 2, nothing written, one line (MaxText\n0.2.5's converter says of its gemma4-small vision "
    'mappings "multimodal not yet supported", and its\n`models/gemma4_vision.py` has no clamps for the '
    '`use_clipped_linears` towers E2B / E4B ship):\n\n    ckptconv: error: .../config.json: --multimodal: '
    "MaxText 0.2.5 does not convert Gemma 4 E2B / E4B's vision tower (its gemma4-small multimodal "
    "mapping is marked unsupported) and its tower has no clipped linears, which E2B / E4B's use; convert "
    'without --multimodal (the text decoder)\n\nLikewise refused: a 26B / 31B-form tower with '
    "`use_clipped_linears`, without `standardize` (MaxText's mapping reads\n`std_scale` / `std_bias`), or "
    "with fewer KV heads than heads (MaxText builds the tower's attention from the hidden\nsize and head "
    'count alone).'
).split("\n")


# a section of VISION.md written by hand (its first line says so), which a rerun keeps as it is
QWEN3_VL_IMAGE = "## Qwen3-VL: MaxText's forward pass with an image"


def sections_by_hand(path: Path) -> dict:
    """The ``## `` sections of ``path`` whose text starts "Written by hand", by heading, each as its lines."""
    sections, heading = {}, None
    for line in (path.read_text().splitlines() if path.exists() else []):
        if line.startswith("## ") or line.startswith("Raw rows: "):
            heading = line if line.startswith("## ") else None
            sections[heading] = []
        if heading:
            sections[heading].append(line)
    return {h: body for h, body in sections.items()
            if h and next((line for line in body[1:] if line), "").startswith("Written by hand")}


def write(results: dict, path: Path) -> None:
    by_hand = sections_by_hand(path if path.exists() else DOCS / "VISION.md")  # --out elsewhere: the repo's
    lines = [
        "# Vision encoders: ckptconv `--multimodal` vs MaxText 0.2.5 `use_multimodal=true`",
        "",
        f"Written by `python -m bench vision` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"(families run then: {', '.join(sorted(results.get('_ran', [])))}; others kept from earlier runs).",
        "Each checkpoint: tiny, random, made by transformers' own class, weights rounded to bfloat16; converted by "
        "`ckptconv convert --multimodal` and by MaxText's `to_maxtext` with `use_multimodal=true` (eager loader), "
        "both bfloat16; restored with Orbax and compared bit for bit. Chunk shapes differ (ckptconv's are finer, "
        "inside one device's shard); MaxText reads any. Leaf counts include MaxText's `step`. Export back (where "
        "shown): `ckptconv export` of ckptconv's checkpoint `--like` the source, every tensor written compared byte "
        "for byte with the source's.",
        "",
    ]
    gemma = results.get("gemma3")
    if gemma:
        lines += [
            "## Gemma 3 (SigLIP tower + multimodal projector)", "",
            "7 decoder layers (hidden 64: sqrt(64) is exact in bfloat16, see the driver); tower: 2 layers, hidden 32, 2 heads, MLP 64, an 896x896 image in 56x56 "
            "patches = 256 positions (MaxText's Gemma 3 vision path hard-codes 896x896 and 256 soft tokens). Stored "
            "with the releases' names (`language_model.model.*`, `vision_tower.vision_model.*`, "
            "`multi_modal_projector.*`); MaxText's `transformers` loader, as its Gemma 3 mapping expects.", "",
            *table(gemma["rows"]), "",
            "The tower and projector are 7 + 16 x 2 = 39 of the leaves; `encoderblock_{i}` are unscanned in both "
            "layouts, as MaxText's vision encoder has no scan.", ""]
        logits = gemma.get("logits")
        if logits is not None:
            lines += ["### MaxText's forward pass on ckptconv's checkpoint", "",
                      "ckptconv `--multimodal --dtype float32 --devices 1` (scanned); MaxText 0.2.5's "
                      "`model_creation_utils.from_pretrained` and one forward pass in float32 against transformers' "
                      "float32 logits (tolerance 1e-4). The image input: random pixels, its 256 placeholder tokens "
                      "between `<boi>` and `<eoi>`, bidirectional among themselves in both (`token_type_ids`; "
                      "MaxText's placeholder mask).", ""]
            if "error" in logits:
                lines.append(f"failed: `{logits['error']}`")
            else:
                lines += ["| input | tokens | max abs logit | max abs diff | within 1e-4 |", "|---|---|---|---|---|"]
                for name, r in logits.items():
                    what = "text" if name == "text" else "text + one image (256 image tokens)"
                    lines.append(f"| {what} | {r['tokens']} | {r['max_abs_logit']:.4f} | "
                                 f"{r['max_abs_logits_diff']:.2e} | {'yes' if r['ok'] else '**no**'} |")
            lines.append("")
    memory = results.get("memory")
    if memory:
        lines += ["### Memory at the release's tower widths", "",
                  "`convert --multimodal` of Gemma 3 4B's widths (2 decoder layers) with the release's whole SigLIP "
                  "tower (27 layers, hidden 1152, MLP 4304, 4096 positions: 0.83 GB of the checkpoint), peak RSS "
                  "as the report measures it against `plan`'s prediction:", "",
                  *memory_table(memory["rows"]), ""]
    qwen = results.get("qwen3_vl")
    if qwen:
        refused = qwen.get("refusal", {})
        lines += [
            "## Qwen3-VL (dense): vision tower, deepstack mergers, merger", "",
            "2 decoder layers (hidden 64); tower: 2 blocks, hidden 32, 2 heads, MLP 64, a deepstack merger after "
            "each (`deepstack_visual_indexes` [0, 1]), made by `Qwen3VLForConditionalGeneration` "
            "(`model.language_model.*`, `model.visual.*`). MaxText's model `qwen3-vl-2b`, its `safetensors` "
            "loader. MaxText runs this path unscanned only (its config check refuses `scan_layers` with deepstack "
            "indexes), so both rows are unscanned: on 16 devices and on 1.", "",
            *table(qwen["rows"]), "",
            f"`ckptconv convert --multimodal --scan-layers` on the same checkpoint: exit {refused.get('exit')}, "
            f"{'something' if refused.get('written') else 'nothing'} written, one line:", "",
            f"    {refused.get('stderr', '')}", "",
            "MaxText's forward pass with an image on Qwen3-VL (mRoPE positions from the image grid, deepstack "
            "injection): ``python -m bench qwen3-vl-image``, its section below.", ""]
    lines += by_hand.pop(QWEN3_VL_IMAGE, [])
    moe = results.get("qwen3_vl_moe")
    if moe:
        refused = moe.get("refusal", {})
        lines += [
            "## Qwen3-VL-MoE: the same tower beside the MoE decoder", "",
            "2 MoE decoder layers (hidden 64, 4 experts of width 48, the fused experts written back in the "
            "releases' layout) and the same tower as above (2 blocks, hidden 32, deepstack [0, 1]), made by "
            "`Qwen3VLMoeForConditionalGeneration`. MaxText's model `qwen3-vl-30b-a3b` (its converter takes "
            "Qwen3-VL's mapping and hooks for it, tower included), its `safetensors` loader; unscanned only, as "
            "for Qwen3-VL (deepstack), on 16 devices and on 1. ckptconv's `qwen3_vl_moe` takes the dense family's "
            "tower rules as they are.", "",
            *table(moe["rows"]), "",
            f"`ckptconv convert --multimodal --scan-layers`: exit {refused.get('exit')}, "
            f"{'something' if refused.get('written') else 'nothing'} written, one line:", "",
            f"    {refused.get('stderr', '')}", ""]
    qwen35 = results.get("qwen3_5_moe")
    if qwen35:
        lines += [
            "## Qwen3.5-MoE: the tower without deepstack, scanned and unscanned", "",
            "tests/hub_checkpoints.py's tiny Qwen3.5-35B-A3B (8 hybrid layers, hidden 64, 4 experts), made by "
            "`Qwen3_5MoeForConditionalGeneration` and stored as the hub ships it (three files and an index, experts "
            "fused, the linear-attention projections apart, `mtp.*` beside), with a 2-block tower (hidden 32, 2 "
            "heads, MLP 64, patch 4, 64 positions, no deepstack). MaxText's model `qwen3.5-35b-a3b` "
            "(`Qwen3_5MoeVisionEncoder_0`, `Qwen3_5MoeVisionProjector_0`), its `safetensors` loader. With no "
            "deepstack MaxText runs this vision path scanned as well as unscanned: scanned on 16 devices, unscanned "
            "on 1; the tower's `blocks_{i}` are unscanned in both. The `mtp.*` tensors are reported by ckptconv "
            "and ignored by MaxText.", "",
            *table(qwen35["rows"]), ""]
    memory35 = results.get("memory-qwen3_5_moe")
    if memory35:
        lines += ["### Memory at the release's tower widths", "",
                  "`convert --multimodal` of one period of Qwen3.5-35B-A3B's widths (4 layers, hidden 2048, 16 of "
                  "its 256 experts, a vocabulary of 8192) with the release's whole tower (27 blocks, hidden 1152, MLP "
                  "4304, 2304 positions: 0.89 GB of the checkpoint), the default layout (scanned), peak RSS as the "
                  "report measures it against `plan`'s prediction:", "",
                  *memory_table(memory35["rows"]), ""]
    gemma4_rows = [row for family in GEMMA4 for row in results.get(family, {}).get("rows", [])]
    if gemma4_rows:
        lines += [
            "## Gemma 4 (26B-A4B, 31B): vision tower + projector", "",
            "``python -m bench families``'s tiny 31B (dense, hidden 48) and 26B-A4B (4 experts, hidden 80), 12 decoder "
            "layers, made by transformers' `Gemma4ForConditionalGeneration` (`bench/hf_tiny.py`; what "
            "`save_pretrained` writes: `model.language_model.*`, `model.vision_tower.*`, `model.embed_vision.*`) "
            "with the releases' `config.json` form; tower: 2 layers, hidden 32, 2 heads of 16 (as many KV heads), "
            "MLP 64, patch 4, a 64-entry x / y position table, `standardize` (random `std_scale` / `std_bias`), "
            "no clipped linears, as the 26B-A4B and 31B releases. MaxText's `gemma4-31b` / `gemma4-26b`, "
            "`use_multimodal=true`, the tower's sizes as overrides, its `safetensors` loader.", "",
            *table(gemma4_rows), "",
            "The tower and projector are 5 + 13 x 2 = 31 of the leaves in every row; `layer_{i}` are unscanned in both "
            "layouts (MaxText's tower is a plain loop).", "", *GEMMA4_NOTE, ""]
        for family in GEMMA4:
            logits = results.get(family, {}).get("logits")
            if not logits:
                continue
            lines += [f"### MaxText's forward pass on ckptconv's checkpoint ({GEMMA4[family][1]})", "",
                      "``python -m bench logits``'s tiny Gemma 4 (hidden 64, 12 layers, sliding window 5"
                      f"{'' if family == 'gemma4_31b' else '; 4 experts of 32 beside the dense MLP'}) with the tower "
                      "above, made by transformers' class; ckptconv `--multimodal --dtype float32 --devices 1` "
                      "(scanned); MaxText 0.2.5's `from_pretrained` (`use_multimodal=true`, `vision_output_length` "
                      "4) and one float32 forward pass against transformers' float32 logits. The image: a random "
                      "16x16 picture, 16 patches pooled 2x2 into 4 soft tokens at MaxText's placeholder 258880 (the "
                      "releases' `image_token_id`), bidirectional among themselves in the sliding layers in both "
                      "(`mm_token_type_ids`; MaxText's placeholder mask).", ""]
            if "error" in logits:
                lines += [f"failed: `{logits['error']}`", ""]
                continue
            lines += ["| input | tokens | max abs logit | max abs diff | within 1e-4 |", "|---|---|---|---|---|"]
            for name, r in logits.items():
                what = "text" if name == "text" else "text + one image (4 soft tokens)"
                lines.append(f"| {what} | {r['tokens']} | {r['max_abs_logit']:.4f} | {r['max_abs_logits_diff']:.2e} | "
                             f"{'yes' if r['ok'] else '**no**'} |")
            effect = logits.get("image", {}).get("image_effect")
            if effect is not None:
                lines.append(f"\nThe picture moves transformers' logits by up to {effect:.2e} against a flat grey "
                             "one, so the image row really goes through the tower.")
            lines.append("")
    memory4 = results.get("memory_gemma4")
    if memory4:
        lines += ["### Memory at the release's tower widths (Gemma 4)", "",
                  "`convert --multimodal` of 26B-A4B's decoder widths (one block of 6 layers, 8 experts, vocabulary "
                  "262144) with the releases' whole tower (27 layers, hidden 1152 = 16 heads of 72, MLP 4304, patch "
                  "16, 10240 positions per axis: 1.1 GB), peak RSS as the report measures it against `plan`'s "
                  "prediction:", "",
                  *memory_table(memory4["rows"]), ""]
    omni = results.get("qwen3_omni")
    if omni:
        refused = omni.get("refusal", {})
        rows = omni["rows"]
        counts = next((r for r in rows if r.get("vision_leaves")), {})
        exports = [r for r in rows if "export_exit" in r]
        lines += [
            "## Qwen3-Omni-MoE thinker: vision tower and audio tower", "",
            "2 decoder layers (hidden 64, 4 experts); vision tower as Qwen3-VL's above (2 blocks, hidden 32, 2 heads, "
            "MLP 64, a deepstack merger after each); audio tower: 2 layers, d_model 32, 2 heads, FFN 64, 16 mel bins, "
            "16 channels in its three 3x3 stride-2 convolutions. Made by `Qwen3OmniMoeForConditionalGeneration` and "
            "saved as the release lays it out (`thinker.model.*`, `thinker.lm_head.*`, `thinker.visual.*`, "
            "`thinker.audio_tower.*`; no talker: `enable_audio_output` false). MaxText's model `qwen3-omni-30b-a3b` "
            "with `use_multimodal=true use_audio=true` (its model config sets both; its converter then writes both "
            "towers), its `safetensors` loader. Its vision path runs unscanned only (deepstack), so both rows are "
            "unscanned: on 16 devices and on 1.", "",
            *table(rows), "",
            f"Of the leaves, {counts.get('vision_leaves')} are the vision tower's (`vision_encoder/"
            f"Qwen3OmniMoeVisionEncoder_0`, `Qwen3OmniMoeVisionProjector_0`) and {counts.get('audio_leaves')} the "
            "audio tower's (`audio_encoder/Qwen3OmniAudioEncoder_0`, `Qwen3OmniAudioProjector_0`), every one "
            "compared bit for bit in both rows.", ""]
        for r in exports:
            if r.get("export_exit"):
                lines.append(f"`ckptconv export` of the {r['devices']}-device output failed: `{r.get('export_error')}`")
            else:
                verdict = "**every tensor bit-identical**" if r["export_identical"] else f"DIFFERENT: {r['export_differ']}"
                lines.append(f"`ckptconv export --like` the source, from the {r['devices']}-device output: "
                             f"{r['export_tensors']} of {r['source_tensors']} tensors written, {verdict} to the "
                             "source (the fused vision `qkv` joined back, the convolutions permuted back).")
            lines.append("")
        lines += [f"`ckptconv convert --multimodal --scan-layers` on the same checkpoint: exit {refused.get('exit')}, "
                  f"{'something' if refused.get('written') else 'nothing'} written, one line:", "",
                  f"    {refused.get('stderr', '')}", "",
                  ]
        towers = omni.get("towers")
        if towers:
            lines += ["### MaxText's towers on ckptconv's checkpoint", "",
                      "ckptconv `--multimodal --dtype float32 --devices 1` (unscanned); MaxText 0.2.5's "
                      "`model_creation_utils.from_pretrained` in float32, its `audio_encoder` and `vision_encoder` "
                      "called on their own, against transformers' `audio_tower` and `visual` (float32) on the same "
                      "inputs: one 100-frame chunk of random mel features (MaxText attends within a chunk, "
                      "transformers within `n_window_infer` frames: the same for one chunk), and one random image "
                      "of 4x4 patches (2x2 merged tokens; MaxText is given the processor's patch rows as one "
                      "(1, C, T, H, W) array, which its encoder cuts back into the same rows).", ""]
            if "error" in towers:
                lines.append(f"failed: `{towers['error']}`")
            else:
                lines += ["| output | shape | max abs | max abs diff | within 1e-4 | diff, transformers' GELUs in "
                          "MaxText's tanh form |", "|---|---|---|---|---|---|"]
                for name, r in towers.items():
                    if "error" in r:
                        lines.append(f"| {name} | - | - | {r['error']} | - |")
                        continue
                    lines.append(f"| {name} | {r['shape']} | {r['max_abs']:.4f} | {r['max_abs_diff']:.2e} | "
                                 f"{'yes' if r['ok'] else '**no**'} | {r['max_abs_diff_tanh_gelu']:.2e} |")
            lines.append("")
            lines += [OMNI_TOWERS_NOTE, ""]
    omni_memory = results.get("omni_memory")
    if omni and omni_memory:
        lines += ["### Memory at the release's tower widths", "",
                  "`convert --multimodal` with Qwen3-Omni-30B-A3B's whole towers (vision: 27 blocks, hidden 1152, "
                  "MLP 4304, 3 deepstack mergers; audio: 32 layers, d_model 1280, FFN 5120, 128 mel bins, 480 "
                  "channels) beside 2 decoder layers at the release's widths (8 experts), peak RSS as the report "
                  "measures it against `plan`'s prediction:", "",
                  *memory_table(omni_memory["rows"]), ""]
    for body in by_hand.values():  # any other hand-written section, at the end
        lines += body
    lines += ["Raw rows: `bench/work/vision/results.json`.", ""]
    path.write_text("\n".join(lines))



def memory_table(rows: list[dict]) -> list[str]:
    """A memory run's rows as a Markdown table: peak RSS as the report measures it against plan's prediction."""
    lines = ["| devices | source GB | leaves | predicted peak GiB | measured peak GiB |", "|---|---|---|---|---|"]
    for r in rows:
        measured = f"{r['measured'] / 2**30:.2f}" if r["measured"] else f"failed (exit {r['exit']})"
        lines.append(f"| {r['devices']} | {(r['source_bytes'] or 0) / 1e9:.2f} | {r['leaves']} | "
                     f"{r['predicted'] / 2**30:.2f} | {measured} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hf"]:
        make_hf(Path(argv[1]))
        return 0
    if argv[:1] == ["forward"]:
        print(json.dumps(forward(*argv[1:4])))
        return 0
    if argv[:1] == ["omni-towers"]:
        print(json.dumps(omni_towers(*argv[1:4])))
        return 0
    if argv[:1] == ["gemma4-hf"]:
        gemma4_image_logits(Path(argv[1]))
        return 0
    if argv[:1] == ["gemma4-forward"]:
        print(json.dumps(gemma4_forward(*argv[1:5])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join((*FAMILIES, "memory")),
                        help="families to run, and the memory runs (" + ", ".join((*MEMORY, "omni_memory")) +
                        "); the others kept from results.json")
    parser.add_argument("--keep", action="store_true", help="keep the work files")
    parser.add_argument("--no-logits", action="store_true", help="skip MaxText's forward pass")
    parser.add_argument("--out", default=str(DOCS / "VISION.md"))
    args = parser.parse_args(argv)
    unknown = [name for name in args.only.split(",") if name not in (*FAMILIES, *MEMORY, "omni_memory")]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}")
    WORK.mkdir(parents=True, exist_ok=True)
    saved = WORK / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    results = {k: v for k, v in results.items() if k in (*FAMILIES, *MEMORY, "omni_memory")}  # earlier formats dropped
    wanted = args.only.split(",")
    results["_ran"] = wanted
    ok = True
    for family in wanted:
        if family == "omni_memory":
            results["omni_memory"] = omni_memory_case()
            print(json.dumps(results["omni_memory"]), flush=True)
            ok &= all(r["measured"] and r["measured"] <= r["predicted"] for r in results["omni_memory"]["rows"])
            continue
        if family in MEMORY:
            results[family] = memory_case(MEMORY[family])
            print(json.dumps(results[family]), flush=True)
            ok &= all(r["measured"] and r["measured"] <= r["predicted"] for r in results[family]["rows"])
            continue
        hf = WORK / f"hf-{family}"
        shutil.rmtree(hf, ignore_errors=True)
        made = (run([MT_PYTHON, __file__, "hf", hf], WORK / "hf.log", env=MT_ENV) if family == "gemma3"
                else make_gemma4(family, hf) if family in GEMMA4 else make_qwen3_5(hf) if family == "qwen3_5_moe"
                else make_qwen3_omni(hf) if family == "qwen3_omni" else make_qwen3_vl(family, hf))
        if made.returncode:
            print(last_line(made), file=sys.stderr)
            return 1
        rows = []
        for name, case_family, scan, devices in CASES:
            if case_family == family:
                rows.append(compare_case(name, family, scan, devices, hf))
                print(json.dumps(rows[-1]), flush=True)
        entry = {"rows": rows}
        if family in ("gemma3", *GEMMA4) and not args.no_logits:
            entry["logits"] = forward_case(hf) if family == "gemma3" else gemma4_logits_case(family)
            print(json.dumps(entry["logits"]), flush=True)
            ok &= all(v.get("ok") for v in entry["logits"].values() if isinstance(v, dict))
        if family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni"):
            entry["refusal"] = refusal(hf, family)
            ok &= entry["refusal"]["exit"] == 2 and not entry["refusal"]["written"]
        if family == "qwen3_omni" and not args.no_logits:
            entry["towers"] = forward_case(hf, "omni-towers", "omni-towers")
            print(json.dumps(entry["towers"]), flush=True)
        results[family] = entry
        ok &= all(r.get("identical") and (family not in EXPORT_BACK or r.get("export_ok")) for r in rows)
        if not args.keep:
            for name, case_family, _, _ in CASES:
                if case_family == family:
                    shutil.rmtree(WORK / name / "maxtext", ignore_errors=True)
    saved.write_text(json.dumps(results, indent=2))
    write(results, Path(args.out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
