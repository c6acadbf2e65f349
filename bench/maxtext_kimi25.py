"""MaxText 0.2.5's standalone Kimi-K2.5 scripts on a tiny checkpoint, and the comparison (bench only; MaxText's venv).

    <maxtext-venv>/bin/python bench/maxtext_kimi25.py convert HF_DIR OUT_DIR scanned|unscanned DEVICES
    <maxtext-venv>/bin/python bench/maxtext_kimi25.py compare OURS THEIRS

``convert``: MaxText's scripts (``convert_deepseek_family_ckpt.py`` scanned, ``..._unscanned_ckpt.py``) take the
model's sizes from their own table (``MODEL_PARAMS_DICT["kimi-k2.5-text"]``: 61 layers, 384 experts...), so a
tiny model fails there; this puts the checkpoint's own ``text_config`` sizes into that one entry and runs the
script's ``main`` as its ``__main__`` does. Nothing else of MaxText is changed.

``compare``: every leaf of both checkpoints restored with Orbax's public API; MaxText's scripts write float16, so
ours (float32) must equal theirs upcast wherever float16 holds ours exactly, and round to theirs elsewhere;
prints one JSON line: leaves, elements, max |ours - theirs|, the largest relative difference, and how many
elements differ (each of them below float16's normal range or past its largest value).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def convert(hf: str, out: str, layout: str, devices: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    from maxtext.checkpoint_conversion.standalone_scripts import convert_deepseek_family_ckpt as scanned
    from maxtext.checkpoint_conversion.standalone_scripts import convert_deepseek_family_unscanned_ckpt as unscanned

    text = json.loads((Path(hf) / "config.json").read_text())["text_config"]
    scanned.MODEL_PARAMS_DICT["kimi-k2.5-text"] = {
        **scanned.MODEL_PARAMS_DICT["kimi-k2.5-text"], "num_layers": text["num_hidden_layers"],
        "first_num_dense_layers": text["first_k_dense_replace"], "base_num_query_heads": text["num_attention_heads"],
        "base_emb_dim": text["hidden_size"], "num_experts": text["n_routed_experts"],
        "q_lora_rank": text["q_lora_rank"], "kv_lora_rank": text["kv_lora_rank"],
        "qk_nope_head_dim": text["qk_nope_head_dim"], "qk_rope_head_dim": text["qk_rope_head_dim"],
        "v_head_dim": text["v_head_dim"]}
    sys.argv = ["convert", "--base_model_path", hf, "--maxtext_model_path", out, "--model_size", "kimi-k2.5-text",
                "--simulated_cpu_devices_count", devices]
    (scanned if layout == "scanned" else unscanned).main()


def compare(ours: str, theirs: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_outputs import items_dir, leaf_metadata, restore_leaf

    a_items, b_items = items_dir(ours), items_dir(theirs)
    a_meta, b_meta = leaf_metadata(a_items), leaf_metadata(b_items)
    result = {"leaves": len(a_meta), "only_in_ours": sorted("/".join(p) for p in set(a_meta) - set(b_meta)),
              "only_in_theirs": sorted("/".join(p) for p in set(b_meta) - set(a_meta)), "elements": 0,
              "max_abs_diff": 0.0, "max_rel_diff": 0.0, "differing": 0, "differing_outside_f16_range": 0,
              "not_f16_rounding": [], "dtypes": sorted({f"{np.dtype(a_meta[p].dtype)} vs {np.dtype(b_meta[p].dtype)}"
                                                       for p in set(a_meta) & set(b_meta)})}
    tiny = np.finfo(np.float16).tiny
    for path in sorted(set(a_meta) & set(b_meta)):
        a = restore_leaf(a_items, path, a_meta[path]).astype(np.float32)
        b = restore_leaf(b_items, path, b_meta[path])
        if a.shape != b.shape:
            result["not_f16_rounding"].append(f"{'/'.join(path)}: shape {list(a.shape)} vs {list(b.shape)}")
            continue
        result["elements"] += a.size
        upcast = b.astype(np.float32)
        diff = np.abs(a - upcast)
        if not np.array_equal(a.astype(np.float16), b):  # theirs is not ours rounded to float16
            result["not_f16_rounding"].append("/".join(path))
        differ = diff > 0
        result["differing"] += int(differ.sum())
        result["differing_outside_f16_range"] += int((differ & ((np.abs(a) < tiny)
                                                                | (np.abs(a) > np.finfo(np.float16).max))).sum())
        if a.size:
            result["max_abs_diff"] = max(result["max_abs_diff"], float(diff.max()))
            rel = diff / np.maximum(np.abs(a), tiny)
            result["max_rel_diff"] = max(result["max_rel_diff"], float(rel.max()))
    return result


if __name__ == "__main__":
    if sys.argv[1] == "convert":
        convert(*sys.argv[2:6])
    else:
        print(json.dumps(compare(sys.argv[2], sys.argv[3])))
