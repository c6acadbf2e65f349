"""Gemma 3's vision tower (``convert --multimodal``) against MaxText 0.2.5 with ``use_multimodal=true``; writes
``bench/VISION.md``.

    .venv/bin/python bench/gemma3_vision.py [--keep] [--no-logits]

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

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORK = BENCH / "work" / "vision"
MT_PYTHON = Path(os.environ.get("MAXTEXT_PYTHON", BENCH / ".maxtext-venv" / "bin" / "python"))
TOLERANCE = 1e-4
MT_ENV = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

PLACEHOLDER = 262144  # MaxText's GEMMA_TOKEN_PLACEHOLDER, and transformers' default image_token_index
TEXT = {"vocab_size": 96, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 7,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24, "query_pre_attn_scalar": 24,
        "sliding_window": 512, "rms_norm_eps": 1e-6,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "image_size": 896, "patch_size": 56, "vision_use_head": False}
TOP = {"mm_tokens_per_image": 256, "boi_token_index": 3, "eoi_token_index": 4, "image_token_index": PLACEHOLDER}
TEXT_TOKENS = [2, 17, 41, 9, 33, 60, 5, 88, 12, 70, 21, 6]
PREFIX, SUFFIX = [2, 17, 41, 3], [4, 33, 60, 5, 88, 12]  # around <boi> 256 x image <eoi>

CASES = [("gemma3-vision", True, 16), ("gemma3-vision-noscan-1dev", False, 1)]


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


# --- in ckptconv's venv ----------------------------------------------------------------------

def run(cmd: list, log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    log.write_text(result.stdout + result.stderr)
    return result


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1][:200] if lines else f"exit {result.returncode}"


def compare_case(name: str, scan: bool, devices: int, hf: Path) -> dict:
    root = WORK / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ours, theirs = root / "ckptconv", root / "maxtext"
    layout = ["--devices", str(devices), "--scan-layers" if scan else "--no-scan-layers", "--multimodal"]
    mine = run([sys.executable, "-m", "ckptconv", "convert", hf, ours, "--progress", "none", *layout],
               root / "ckptconv.log")
    mt = run([MT_PYTHON, BENCH / "maxtext_convert_tiny.py", "gemma3-4b", hf, theirs, *maxtext_sizes(scan), "--",
              "--lazy_load_tensors=false", "--eager_load_method=transformers",
              f"--simulated_cpu_devices_count={devices}", "--save_dtype=bfloat16"],
             root / "maxtext.log", env={**MT_ENV, "HF_HOME": str(WORK / "hf-home")})
    row = {"case": name, "scan": scan, "devices": devices, "ckptconv_exit": mine.returncode,
           "maxtext_exit": mt.returncode}
    if mine.returncode or mt.returncode:
        return row | {"error": last_line(mine if mine.returncode else mt)}
    compared = run([MT_PYTHON, BENCH / "compare_outputs.py", ours, theirs, "--json", root / "compare.json"],
                   root / "compare.log", env=MT_ENV)
    result = json.loads((root / "compare.json").read_text())
    tower = [leaf for leaf in result.get("compared", result.get("leaves", [])) if "vision_encoder" in str(leaf)]
    return row | {"identical": result["identical"], "leaves": result["leaves_compared"],
                  "vision_leaves": len(tower) or None, "bytes": result["bytes_compared"],
                  "value_mismatches": result["value_mismatches"][:3], "only_in_ckptconv": result["only_in_a"],
                  "only_in_maxtext": result["only_in_b"], "compare_exit": compared.returncode,
                  "metadata_differences": sorted({d["field"] for d in result["metadata_differences"]})}


def logits_case(hf: Path) -> dict:
    root = WORK / "logits"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ours = root / "ckptconv-f32"
    mine = run([sys.executable, "-m", "ckptconv", "convert", hf, ours, "--progress", "none", "--devices", "1",
                "--dtype", "float32", "--multimodal"], root / "ckptconv.log")
    if mine.returncode:
        return {"error": last_line(mine)}
    fwd = run([MT_PYTHON, __file__, "forward", ours / "0" / "items", hf, root], root / "forward.log", env=MT_ENV)
    if fwd.returncode:
        return {"error": last_line(fwd)}
    return json.loads(fwd.stdout.strip().splitlines()[-1])


def write(rows: list[dict], logits: dict | None, path: Path) -> None:
    lines = [
        "# Vision encoders: ckptconv `--multimodal` vs MaxText 0.2.5 `use_multimodal=true`",
        "",
        f"Written by `bench/gemma3_vision.py` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
        "## Gemma 3 (SigLIP tower + multimodal projector)",
        "",
        "A tiny random `Gemma3ForConditionalGeneration` made by transformers' own class (7 decoder layers, hidden 48; "
        "tower: 2 layers, hidden 32, 2 heads, MLP 64, 896x896 image in 56x56 patches = 256 positions), weights "
        "rounded to bfloat16, stored with the releases' names (`language_model.model.*`, "
        "`vision_tower.vision_model.*`, `multi_modal_projector.*`). Converted by `ckptconv convert --multimodal` and "
        "by MaxText's `to_maxtext` with `use_multimodal=true` (eager `transformers` loader, as its Gemma 3 mapping "
        "expects), both bfloat16; restored with Orbax and compared bit for bit.",
        "",
        "| case | scan | devices | leaves | MiB | result | metadata that differs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['scan']} | {r['devices']} | - | - | failed (ckptconv exit "
                         f"{r['ckptconv_exit']}, MaxText exit {r['maxtext_exit']}: `{r['error']}`) | - |")
            continue
        result = "**identical**" if r["identical"] else (
            f"DIFFERENT: {r['value_mismatches'] or r['only_in_ckptconv'] or r['only_in_maxtext']}")
        lines.append(f"| {r['case']} | {r['scan']} | {r['devices']} | {r['leaves']} | {r['bytes'] / 2**20:.1f} | "
                     f"{result} | {', '.join(r['metadata_differences']) or 'none'} |")
    lines += ["", "Leaves include MaxText's `step`; the tower and projector are 7 + 16 x 2 = 39 of them (the "
              "`encoderblock_{i}` unscanned in both layouts, as MaxText's vision encoder has no scan).", ""]
    if logits is not None:
        lines += ["### MaxText's forward pass on ckptconv's checkpoint", "",
                  "ckptconv `--multimodal --dtype float32 --devices 1` (scanned); MaxText 0.2.5's "
                  "`model_creation_utils.from_pretrained` and one forward pass in float32 against transformers' "
                  "float32 logits (tolerance 1e-4).", ""]
        if "error" in logits:
            lines.append(f"failed: `{logits['error']}`")
        else:
            lines += ["| input | tokens | max abs logit | max abs diff | within 1e-4 |", "|---|---|---|---|---|"]
            for name, r in logits.items():
                what = "text" if name == "text" else "text + one image (256 image tokens)"
                lines.append(f"| {what} | {r['tokens']} | {r['max_abs_logit']:.4f} | {r['max_abs_logits_diff']:.2e} "
                             f"| {'yes' if r['ok'] else '**no**'} |")
    lines += ["", "Raw rows: `bench/work/vision/results.json`.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hf"]:
        make_hf(Path(argv[1]))
        return 0
    if argv[:1] == ["forward"]:
        print(json.dumps(forward(*argv[1:4])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the work files")
    parser.add_argument("--no-logits", action="store_true", help="skip MaxText's forward pass")
    parser.add_argument("--out", default=str(BENCH / "VISION.md"))
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    hf = WORK / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    made = run([MT_PYTHON, __file__, "hf", hf], WORK / "hf.log", env=MT_ENV)
    if made.returncode:
        print(last_line(made), file=sys.stderr)
        return 1
    rows = []
    for name, scan, devices in CASES:
        rows.append(compare_case(name, scan, devices, hf))
        print(json.dumps(rows[-1]), flush=True)
    logits = None if args.no_logits else logits_case(hf)
    print(json.dumps(logits), flush=True)
    (WORK / "results.json").write_text(json.dumps({"rows": rows, "logits": logits}, indent=2))
    write(rows, logits, Path(args.out))
    if not args.keep:
        for name, _, _ in CASES:
            shutil.rmtree(WORK / name / "maxtext", ignore_errors=True)
    ok = all(r.get("identical") for r in rows) and (logits is None or all(
        v.get("ok") for v in logits.values() if isinstance(v, dict)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
