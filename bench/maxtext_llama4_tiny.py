"""Run MaxText 0.2.5's own Llama 4 converters on a tiny Llama 4 hub checkpoint (bench only; MaxText's venv).

    <maxtext-venv>/bin/python bench/maxtext_llama4_tiny.py HF_DIR OUT_DIR [--scanned]

Unscanned: ``llama4_ckpt_unscanned.py``; ``--scanned``: ``llama_or_mistral_ckpt.py`` (its scanned route, which
for Llama 4 takes hub safetensors only). Both take the model's sizes from a built-in table keyed by
``--model-size`` (``MODEL_PARAMS_DICT``: Scout's and Maverick's), so a tiny model fails there. This runner adds
one entry, ``llama4-tiny``, with the sizes of the checkpoint's own ``config.json`` (and the table's own
settings for Llama 4: ``rope_type`` llama3.1, ``scale_query`` false, a layer cycle of 4), then runs the script
as its ``__main__`` does, with ``--huggingface-checkpoint true`` (its route for hub files; both write on 16
simulated devices): the unscanned one itself (it reads the table from ``llama_or_mistral_ckpt``), the scanned
one's ``__main__`` steps called in order (run as ``__main__`` it would define its table afresh).
Nothing else of MaxText is changed.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def main() -> None:
    hf_dir, out_dir, *flags = sys.argv[1:]
    script = "llama_or_mistral_ckpt" if "--scanned" in flags else "llama4_ckpt_unscanned"
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    from maxtext.checkpoint_conversion.standalone_scripts import llama_or_mistral_ckpt

    llama_or_mistral_ckpt.MODEL_PARAMS_DICT["llama4-tiny"] = {
        "num_layers": text["num_hidden_layers"], "num_heads": text["num_attention_heads"],
        "num_kv_heads": text["num_key_value_heads"], "dims_per_head": text["head_dim"],
        "vocab": text["vocab_size"], "base_emb_dim": text["hidden_size"], "num_experts": text["num_local_experts"],
        "rope_type": "llama3.1", "scale_query": False,
        "interleave_moe_layer_step": text.get("interleave_moe_layer_step", 1),
        "inhomogeneous_layer_cycle_interval": 4, "num_layers_vit": vision["num_hidden_layers"],
        "num_att_head_vit": vision["num_attention_heads"], "hidden_size_vit": vision["hidden_size"],
    }
    if script == "llama_or_mistral_ckpt":  # its __main__: the device count, then convert and save
        import os

        from maxtext.checkpoint_conversion.utils.utils import save_weights_to_checkpoint

        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={llama_or_mistral_ckpt.SIMULATED_CPU_DEVICES_COUNT}"
        weights = llama_or_mistral_ckpt.convert_to_jax_weights(hf_dir, "llama4-tiny", True)
        save_weights_to_checkpoint(out_dir, weights, llama_or_mistral_ckpt.SIMULATED_CPU_DEVICES_COUNT, True, True)
        return
    sys.argv = [script, "--base-model-path", hf_dir, "--maxtext-model-path", out_dir,
                "--model-size", "llama4-tiny", "--huggingface-checkpoint", "true"]
    runpy.run_module(f"maxtext.checkpoint_conversion.standalone_scripts.{script}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
