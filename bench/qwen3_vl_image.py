"""MaxText's forward pass on ckptconv's Qwen3-VL ``--multimodal`` checkpoint, on text around one image, against
transformers' logits (float32, tolerance 1e-4).

    .venv/bin/python bench/qwen3_vl_image.py [--keep]

1. ``hf`` (in MaxText's venv): a tiny random ``Qwen3VLForConditionalGeneration`` by transformers' own class
   (3 decoder layers, hidden 64; a 2-block tower, hidden 32, 2 heads, deepstack after both blocks), weights rounded
   to bfloat16 and norms/biases perturbed, saved by ``save_pretrained``; the vocabulary is the release's (151936)
   so MaxText's Qwen special tokens (``<|vision_start|>`` 151652, ``<|image_pad|>`` 151655, ``<|vision_end|>``
   151653) are inside it. The image: random patches on a 1 x 4 x 4 grid (16 patches of 3 x 2 x 16 x 16, merged
   2 x 2 into 4 image tokens), in the patch order transformers' processor writes ``pixel_values``. transformers'
   float32 logits on ``<text> <|vision_start|> 4 x <|image_pad|> <|vision_end|> <text>``, and its 3-D mRoPE
   positions (``get_rope_index``) for the same sequence.
2. ``ckptconv convert --multimodal --dtype float32 --devices 1`` (unscanned: the only layout MaxText runs the
   deepstack path in).
3. ``forward`` (in MaxText's venv): ``model_creation_utils.from_pretrained`` with ``qwen3-vl-2b`` at the checkpoint's
   sizes, ``use_multimodal=true use_mrope=true scan_layers=false``, float32; the patches given as MaxText's tower
   reads them (``(batch, channels, T * t_patch, H * patch, W * patch)``, which it reshapes back into the same
   patches in the same order), the positions as (batch, tokens, 3); its logits against transformers'.
4. MaxText's own float32 conversion of the same checkpoint (``to_maxtext``, ``logits_via_embedding=false``: the
   model is untied) and its forward on it; its leaves against ckptconv's, bit for bit.
5. ``imitate`` (in MaxText's venv): transformers' image logits again, with two of MaxText's run-time choices
   imitated (:func:`imitate`), against MaxText's: where the image difference comes from.

Work files under bench/work/qwen3-vl-image/; the result as JSON on the last line and in ``result.json`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORK = BENCH / "work" / "qwen3-vl-image"
MT_PYTHON = Path(os.environ.get("MAXTEXT_PYTHON", BENCH / ".maxtext-venv" / "bin" / "python"))
MT_ENV = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
TOLERANCE = 1e-4
VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655  # MaxText's QwenTokens (and the releases')
GRID = (1, 4, 4)  # (t, h, w) patches: 16 patches, 4 image tokens after the 2 x 2 merge
PREFIX, SUFFIX = [3, 17, 101, 42], [7, 200, 9, 64, 5]
TEXT = [3, 17, 101, 42, 7, 200, 9, 64, 5, 33, 250, 11]


def image_tokens() -> list[int]:
    t, h, w = GRID
    return PREFIX + [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END] + SUFFIX


def config() -> dict:
    from ckptconv.commands import synth

    cfg = synth.SynthModel(model_type="qwen3_vl", num_layers=3, vocab_size=151936, tie_word_embeddings=False).config()
    cfg["vision_config"].update(depth=2, deepstack_visual_indexes=[0, 1])
    return cfg


# --- in MaxText's venv -----------------------------------------------------------------------

def make_hf(out: Path) -> None:
    import numpy as np
    import torch
    import transformers

    fields = json.loads((out / "synth-config.json").read_text())
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(transformers.AutoConfig.for_model(**fields))
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        for tensor in model.parameters():
            noise = torch.randn(tensor.shape) * (0.05 if tensor.ndim > 1 else 0.1)
            tensor.copy_((tensor + noise if tensor.ndim == 1 else noise).to(torch.bfloat16).to(torch.float32))
    model.save_pretrained(str(out))
    vision = model.config.vision_config
    t, h, w = GRID
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = np.random.default_rng(7).uniform(-1, 1, (t * h * w, patch)).astype(np.float32)
    grid = torch.tensor([GRID])
    result = {}
    with torch.no_grad():
        for name, ids in (("text", TEXT), ("image", image_tokens())):
            tokens = torch.tensor([ids])
            kinds = (tokens == IMAGE_PAD).int()  # mm_token_type_ids: 1 on image tokens, as the processor marks them
            if name == "text":
                result[name] = model(input_ids=tokens).logits[0].numpy()
                positions = np.repeat(np.arange(len(ids))[:, None], 3, axis=1)
            else:
                result[name] = model(input_ids=tokens, pixel_values=torch.from_numpy(pixels), image_grid_thw=grid,
                                     mm_token_type_ids=kinds).logits[0].numpy()
                positions, _ = model.model.get_rope_index(tokens, kinds, grid, None,
                                                          attention_mask=torch.ones_like(tokens))
                positions = positions[:, 0].T.numpy()  # (3, batch, tokens) -> (tokens, 3)
            np.save(out / f"{name}_positions.npy", positions)
            np.save(out / f"{name}_logits.npy", result[name])
    np.save(out / "pixels.npy", pixels)


def imitate(hf_dir: str, work: str) -> dict:
    """transformers' image logits with two of MaxText's run-time choices imitated, against MaxText's logits on
    ckptconv's checkpoint: its patch mergers' GELU (tanh-approximated, ``jax.nn.gelu``; transformers' mergers use
    the exact one, ``nn.GELU()``), then its interpolated position embeddings rounded to bfloat16 (MaxText's
    ``Qwen3OmniMoeVisionPosEmbedInterpolate`` casts its output to its default ``fprop_dtype``, bfloat16, in a
    float32 run too)."""
    import numpy as np
    import torch
    import transformers

    hf = Path(hf_dir)
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(hf), dtype=torch.float32).eval()
    visual = model.model.visual
    ids = torch.tensor([image_tokens()])
    inputs = {"input_ids": ids, "pixel_values": torch.from_numpy(np.load(hf / "pixels.npy")),
              "image_grid_thw": torch.tensor([GRID]), "mm_token_type_ids": (ids == IMAGE_PAD).int()}
    theirs = np.load(Path(work) / "maxtext_image_logits.npy")
    patches = {}

    def diff() -> float:
        with torch.no_grad():
            logits = model(**inputs).logits[0].numpy()
        return float(np.abs(theirs[:, : logits.shape[-1]] - logits).max())

    def bf16_positions(module, args, kwargs):  # the first block's input is patches + positions
        positions = (args[0] - patches["embedded"]).to(torch.bfloat16).to(torch.float32)
        return (patches["embedded"] + positions, *args[1:]), kwargs

    visual.patch_embed.register_forward_hook(lambda module, inputs, out: patches.__setitem__("embedded", out))
    result = {"as is": diff()}
    for merger in (visual.merger, *visual.deepstack_merger_list):
        merger.act_fn = torch.nn.GELU(approximate="tanh")
    result["mergers' GELU tanh-approximated"] = diff()
    visual.blocks[0].register_forward_pre_hook(bf16_positions, with_kwargs=True)
    result["and position embeddings rounded to bfloat16"] = diff()
    return result


def forward(ckpt: str, hf_dir: str, work: str) -> dict:
    import jax.numpy as jnp
    import maxtext
    import numpy as np
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    sys.path.insert(0, str(BENCH))
    from vision import qwen3_vl_sizes

    hf = Path(hf_dir)
    cfg = json.loads((hf / "synth-config.json").read_text())
    text = cfg["text_config"]
    length = len(image_tokens())
    overrides = {
        "model_name": "qwen3-vl-2b", "override_model_config": True, "hardware": "cpu",
        "skip_jax_distributed_system": True, "base_output_directory": work, "run_name": "logits",
        "load_parameters_path": ckpt, "attention": "dot_product", "dtype": "float32", "weight_dtype": "float32",
        "matmul_precision": "highest", "per_device_batch_size": 1, "max_target_length": max(length, len(TEXT)),
        "max_prefill_predict_length": max(length, len(TEXT)), "enable_checkpointing": False,
        "enable_dropout": False, "use_mrope": "true", "normalization_layer_epsilon": text["rms_norm_eps"],
        "rope_max_timescale": text["rope_theta"], "logits_via_embedding": "false", "dtype_mm": "float32",
    }
    settings = [f"{k}={v}" for k, v in overrides.items()] + qwen3_vl_sizes(cfg)
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(["logits", base, *settings])
    model, _ = model_creation_utils.from_pretrained(config)
    vision = cfg["vision_config"]
    t, h, w = GRID
    tp, p, c = vision.get("temporal_patch_size", 2), vision.get("patch_size", 16), vision.get("in_channels", 3)
    pixels = np.load(hf / "pixels.npy").reshape(1, c, t * tp, h * p, w * p)  # the same patches, in order
    result = {}
    for name, ids in (("text", TEXT), ("image", image_tokens())):
        tokens = jnp.asarray(np.array(ids)[None], jnp.int32)
        positions = jnp.asarray(np.load(hf / f"{name}_positions.npy")[None], jnp.int32)
        kwargs = {} if name == "text" else {"encoder_images": jnp.asarray(pixels, jnp.float32)}
        logits = np.asarray(model(tokens, positions, jnp.ones_like(tokens), enable_dropout=False, **kwargs),
                            np.float32)[0]
        want = np.load(hf / f"{name}_logits.npy")
        np.save(Path(work) / f"maxtext_{name}_logits.npy", logits)
        per_token = np.abs(logits[:, : want.shape[-1]] - want).max(axis=-1)
        diff = float(per_token.max())
        result[name] = {"tokens": len(ids), "max_abs_logit": float(np.abs(want).max()), "max_abs_logits_diff": diff,
                        "per_token": [float(f"{d:.2e}") for d in per_token], "ok": diff <= TOLERANCE}
    return result


# --- in ckptconv's venv ----------------------------------------------------------------------

def run(cmd: list, log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, **(env or {})})
    log.write_text(result.stdout + result.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hf"]:
        make_hf(Path(argv[1]))
        return 0
    if argv[:1] == ["forward"]:
        print(json.dumps(forward(*argv[1:4])))
        return 0
    if argv[:1] == ["imitate"]:
        print(json.dumps(imitate(*argv[1:3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the work files")
    args = parser.parse_args(argv)
    shutil.rmtree(WORK, ignore_errors=True)
    hf, ours = WORK / "hf", WORK / "ckptconv-f32"
    hf.mkdir(parents=True)
    (hf / "synth-config.json").write_text(json.dumps(config()))
    theirs = WORK / "maxtext-f32"
    sys.path.insert(0, str(BENCH))
    from vision import qwen3_vl_sizes

    steps = [([MT_PYTHON, __file__, "hf", hf], "hf.log", MT_ENV),
             ([sys.executable, "-m", "ckptconv", "convert", hf, ours, "--progress", "none", "--devices", "1",
               "--dtype", "float32", "--multimodal"], "ckptconv.log", None),
             ([MT_PYTHON, __file__, "forward", ours / "0" / "items", hf, WORK], "forward.log", MT_ENV),
             # MaxText's own conversion of the same checkpoint, and its forward on it: the comparison's floor
             ([MT_PYTHON, BENCH / "maxtext_convert_tiny.py", "qwen3-vl-2b", hf, theirs, *qwen3_vl_sizes(config()),
               "logits_via_embedding=false", "--", "--lazy_load_tensors=false", "--eager_load_method=safetensors",
               "--simulated_cpu_devices_count=1", "--save_dtype=float32"], "maxtext-convert.log",
              {**MT_ENV, "HF_HOME": str(WORK / "hf-home")}),
             ([MT_PYTHON, __file__, "forward", theirs / "0" / "items", hf, WORK / "own"], "forward-own.log", MT_ENV)]
    outputs = []
    for cmd, log, env in steps:
        (WORK / "own").mkdir(exist_ok=True)
        done = run(cmd, WORK / log, env)
        if done.returncode:
            print(f"{log}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        outputs.append(done.stdout)
    result = json.loads(outputs[2].strip().splitlines()[-1])
    result["on MaxText's own conversion"] = json.loads(outputs[4].strip().splitlines()[-1])
    done = run([MT_PYTHON, __file__, "imitate", hf, WORK], WORK / "imitate.log", MT_ENV)
    if done.returncode == 0:
        result["transformers imitating MaxText (image)"] = json.loads(done.stdout.strip().splitlines()[-1])
    compared = run([MT_PYTHON, BENCH / "compare_outputs.py", ours, theirs, "--json", WORK / "compare.json"],
                   WORK / "compare.log", MT_ENV)
    leaves = json.loads((WORK / "compare.json").read_text())
    result["leaves"] = {"identical": leaves["identical"], "compared": leaves["leaves_compared"],
                        "only_in_ckptconv": leaves["only_in_a"], "only_in_maxtext": leaves["only_in_b"],
                        "exit": compared.returncode}
    (WORK / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    if not args.keep:
        shutil.rmtree(ours, ignore_errors=True)
        shutil.rmtree(theirs, ignore_errors=True)
    return 0 if result["text"]["ok"] and result["image"]["ok"] and result["leaves"]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
