"""MaxText 0.2.5's own Llama 4 vision encoder on ckptconv's ``--multimodal`` checkpoint against transformers.

    .venv/bin/python -m bench llama4-vision

A tiny random ``Llama4ForConditionalGeneration`` made by transformers' own class (``bench/hf_tiny.py`` in
MaxText's venv; weights rounded to bfloat16; the synthetic vision model: hidden 32, 2 heads, 2 layers, MLP 128,
28x28 tiles of 14x14 patches, projector 48) and a random image of 2 tiles; transformers' image embeddings as its
``forward`` makes them (``get_image_features``, flattened, then ``multi_modal_projector``), float32;
``ckptconv convert --multimodal --dtype float32 --devices 1`` (unscanned); then, in a fresh process of MaxText's
venv, ``model_creation_utils.from_pretrained`` with MaxText's ``llama4-17b-128e`` config, ``use_multimodal=true``
and the vision sizes of the checkpoint's ``vision_config``, and its ``vision_encoder`` (Llama4VisionModel and
Llama4MultiModalProjector) on the same tiles: max abs difference (float32; tolerance 1e-4). The decoder's logits
on text are ``python -m bench llama4-logits``'s. Work files: bench/work/llama4-vision/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path as a step in MaxText's venv: bench, tests
from bench.maxtext_llama4_logits import MAVERICK, SMALL, TOLERANCE, maxtext_overrides  # noqa: E402
from bench.steps import (BENCH, MT_ENV, MT_PYTHON, REPO, convert_cmd, error_line, last_json, layout, mt_step,  # noqa: E402
                         run)

WORK = BENCH / "work" / "llama4-vision"

TILES = 2


def vision_overrides(config: dict) -> dict:
    v = config["vision_config"]
    return {"use_multimodal": True, "hidden_size_for_vit": v["hidden_size"],
            "intermediate_size_for_vit": v["intermediate_size"], "num_hidden_layers_for_vit": v["num_hidden_layers"],
            "num_attention_heads_for_vit": v["num_attention_heads"], "tile_size_for_vit": v["image_size"],
            "image_size_for_vit": v["image_size"], "patch_size_for_vit": v["patch_size"],
            "conv_stride_for_vit": v["patch_size"], "projector_input_dim_for_vit": v["projector_input_dim"],
            "projector_output_dim_for_vit": v["projector_output_dim"],
            "vision_output_dim_for_vit": v["vision_output_dim"], "pixel_shuffle_ratio_for_vit": v["pixel_shuffle_ratio"],
            "rope_theta_for_vit": v.get("rope_theta") or v.get("rope_parameters", {}).get("rope_theta", 10000),
            "dtype_mm": "float32"}


# --- in MaxText's venv -----------------------------------------------------------------------

def hf_embeddings(hf_dir: str) -> dict:
    """transformers' image embeddings of a random image (saved beside the model), as its forward computes them."""
    import numpy as np
    import torch
    import transformers

    model = transformers.Llama4ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    size = model.config.vision_config.image_size
    pixels = torch.from_numpy(np.random.default_rng(3).standard_normal((TILES, 3, size, size), dtype=np.float32))
    with torch.no_grad():
        features = model.get_image_features(pixel_values=pixels)
        features = getattr(features, "last_hidden_state", features)
        features = features.reshape(-1, features.shape[-1])
        embeddings = model.model.multi_modal_projector(features) if hasattr(model, "model") and hasattr(
            model.model, "multi_modal_projector") else model.multi_modal_projector(features)
    np.save(Path(hf_dir) / "hf_pixels.npy", pixels.numpy())
    np.save(Path(hf_dir) / "hf_image_embeddings.npy", embeddings.numpy())
    return {"embeddings": list(embeddings.shape), "max_abs_embedding": float(embeddings.abs().max())}


def maxtext_embeddings(ckpt: str, hf_dir: str, work: str) -> dict:
    import os

    import jax.numpy as jnp
    import maxtext
    import numpy as np
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    overrides = {
        "model_name": "llama4-17b-128e", "override_model_config": True, "hardware": "cpu",
        "skip_jax_distributed_system": True, "base_output_directory": work, "run_name": "vision",
        "load_parameters_path": ckpt, "scan_layers": False, "attention": "dot_product", "dtype": "float32",
        "weight_dtype": "float32", "matmul_precision": "highest", "per_device_batch_size": 1,
        "max_target_length": 16, "max_prefill_predict_length": 16, "enable_checkpointing": False,
        "sparse_matmul": False, "capacity_factor": -1, "enable_dropout": False,
        **maxtext_overrides(config), **vision_overrides(config),
    }
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    mt_config = pyconfig.initialize(["vision", base, *(f"{k}={v}" for k, v in overrides.items())])
    model, _ = model_creation_utils.from_pretrained(mt_config)
    pixels = np.load(Path(hf_dir) / "hf_pixels.npy")
    embeddings, _ = model.vision_encoder(input_images=jnp.asarray(pixels[None]), deterministic=True)
    got = np.asarray(embeddings, np.float32).reshape(-1, np.asarray(embeddings).shape[-1])
    want = np.load(Path(hf_dir) / "hf_image_embeddings.npy")
    if got.shape != want.shape:
        return {"error": f"MaxText embeddings {list(got.shape)}, transformers' {list(want.shape)}"}
    diff = float(np.abs(got - want).max())
    return {"embeddings": list(got.shape), "max_abs_embedding": float(np.abs(want).max()),
            "max_abs_diff": diff, "ok": diff <= TOLERANCE}


# --- the driver ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "hf":
        print(json.dumps(hf_embeddings(argv[1])), flush=True)
        return 0
    if argv and argv[0] == "maxtext":
        print(json.dumps(maxtext_embeddings(argv[1], argv[2], argv[3])), flush=True)
        return 0
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    from ckptconv.commands import synth

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    hf, dst = WORK / "hf", WORK / "ckptconv"
    config = WORK / "synth-config.json"
    config.write_text(json.dumps(synth.SynthModel(model_type="llama4", num_layers=4, config_overrides=MAVERICK,
                                                  **SMALL).config()))
    row: dict = {"case": "llama4-maverick-pattern, vision 2 layers", "tiles": TILES}
    chain = (mt_step("hf_tiny.py", config, hf, "--class", "Llama4ForConditionalGeneration"),
             (MT_PYTHON, __file__, "hf", hf),
             convert_cmd(hf, dst, *layout(False, 1, "float32"), "--multimodal"),
             (MT_PYTHON, __file__, "maxtext", dst / "0" / "items", hf, WORK / "mt"))
    for n, step in enumerate(chain):
        result = run(list(step), WORK / f"step{n}.log", env=MT_ENV | {"PYTHONPATH": str(REPO)})
        if result.returncode:
            row["error"] = f"step {n}: {error_line(result)}"
            break
        if n in (1, 3):
            row |= {("hf_" if n == 1 else "") + k: v for k, v in last_json(result).items()}
    print(json.dumps(row))
    (WORK / "result.json").write_text(json.dumps(row, indent=2))
    return 0 if row.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
