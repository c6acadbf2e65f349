"""MaxText's forward pass on ckptconv's Qwen3-VL ``--multimodal`` checkpoint, on text around one image, against
transformers' logits (float32, tolerance 1e-4).

    .venv/bin/python -m bench qwen3-vl-image [--family qwen3_vl|qwen3_vl_moe|qwen3_5_moe|qwen3_omni_moe] [--scan]
                                             [--keep]

``--family qwen3_vl_moe``: the same, with a MoE decoder (4 experts of width 48) by
``Qwen3VLMoeForConditionalGeneration``, its fused experts written back in the releases' layout
(bench/hf_tiny.py), MaxText's ``qwen3-vl-30b-a3b``. ``--family qwen3_5_moe``: tests/hub_checkpoints.py's tiny
Qwen3.5-35B-A3B (8 hybrid layers, hidden 64, 4 experts; the release's vocabulary of 248320, its vision tokens
248053 / 248054 / 248056) with a 2-block tower without deepstack, by ``Qwen3_5MoeForConditionalGeneration``,
stored as the hub ships it; MaxText's ``qwen3.5-35b-a3b``; ``--scan``: both conversions scanned (MaxText runs
this vision path scanned too). ``--family qwen3_omni_moe``: Qwen3-Omni's thinker (``python -m bench vision``'s tiny model, 3
MoE decoder layers, the same 2-block tower, a 2-layer audio tower, the release's vocabulary and token ids) by
``Qwen3OmniMoeForConditionalGeneration`` (its thinker's logits), saved as the release lays it out (bench/hf_tiny.py);
MaxText's ``qwen3-omni-30b-a3b`` (audio on, as its config has it), unscanned (deepstack); a third input, text around
one 100-frame chunk of random mel features (13 ``<|audio_pad|>`` tokens between ``<|audio_start|>`` and
``<|audio_end|>``), given to transformers as ``input_features`` and to MaxText as ``encoder_audios``.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path as a step in MaxText's venv: bench, tests
from bench.steps import (BENCH, CONVERT_ENV, MT_ENV, MT_PYTHON, REPO, compare_outputs, convert_cmd,  # noqa: E402
                         maxtext_convert_cmd, run)

WORK = BENCH / "work" / "qwen3-vl-image"  # qwen3_vl; the others: qwen3-vl-image-<family>[-scan]
TOLERANCE = 1e-4
# family -> (transformers class, MaxText model, (<|vision_start|>, <|vision_end|>, <|image_pad|>): MaxText's
# QwenTokens for the model, and the releases')
FAMILIES = {"qwen3_vl": ("Qwen3VLForConditionalGeneration", "qwen3-vl-2b", (151652, 151653, 151655)),
            "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "qwen3-vl-30b-a3b", (151652, 151653, 151655)),
            "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "qwen3.5-35b-a3b", (248053, 248054, 248056)),
            "qwen3_omni_moe": ("Qwen3OmniMoeForConditionalGeneration", "qwen3-omni-30b-a3b", (151652, 151653, 151655))}
OMNI_AUDIO = (151669, 151670, 151675)  # <|audio_start|>, <|audio_end|>, <|audio_pad|>: MaxText's and the release's
AUDIO_FRAMES = 100  # one chunk (n_window * 2): 13 audio tokens after the tower's three stride-2 convolutions
GRID = (1, 4, 4)  # (t, h, w) patches: 16 patches, 4 image tokens after the 2 x 2 merge
PREFIX, SUFFIX = [3, 17, 101, 42], [7, 200, 9, 64, 5]
TEXT = [3, 17, 101, 42, 7, 200, 9, 64, 5, 33, 250, 11]


def image_pad(family: str) -> int:
    return FAMILIES[family][2][2]


def image_tokens(family: str = "qwen3_vl") -> list[int]:
    t, h, w = GRID
    start, end, pad = FAMILIES[family][2]
    return PREFIX + [start] + [pad] * (t * h * w // 4) + [end] + SUFFIX


def audio_tokens() -> list[int]:
    start, end, pad = OMNI_AUDIO
    return PREFIX + [start] + [pad] * 13 + [end] + SUFFIX


def inputs(family: str) -> dict:
    """input name -> tokens: text, text around the image, and (Qwen3-Omni) text around the audio."""
    return {"text": TEXT, "image": image_tokens(family)} | ({"audio": audio_tokens()} if family == "qwen3_omni_moe"
                                                            else {})


def config(family: str = "qwen3_vl") -> dict:
    from ckptconv.commands import synth

    if family == "qwen3_omni_moe":  # ``python -m bench vision``'s tiny thinker, 3 layers, the release's vocabulary and ids
        from bench.vision import QWEN3_OMNI_AUDIO, QWEN3_VL_VISION

        cfg = synth.SynthModel(model_type=family, num_layers=3, num_experts=4, moe_intermediate_size=48,
                               tie_word_embeddings=False, vocab_size=151936).config()
        thinker = cfg["thinker_config"]
        thinker["vision_config"].update(QWEN3_VL_VISION)
        thinker["audio_config"].update(QWEN3_OMNI_AUDIO)
        thinker.update(image_token_id=FAMILIES[family][2][2], vision_start_token_id=FAMILIES[family][2][0],
                       audio_start_token_id=OMNI_AUDIO[0], audio_token_id=OMNI_AUDIO[2])
        return cfg
    if family == "qwen3_5_moe":
        sys.path.insert(0, str(REPO))
        from tests import hub_checkpoints

        cfg = hub_checkpoints.qwen3_5_moe_config(vocab_size=248320)
        cfg["vision_config"].update(depth=2)
        return cfg
    moe = {"num_experts": 4, "moe_intermediate_size": 48} if family == "qwen3_vl_moe" else {}
    cfg = synth.SynthModel(model_type=family, num_layers=3, vocab_size=151936, tie_word_embeddings=False,
                           **moe).config()
    cfg["vision_config"].update(depth=2, deepstack_visual_indexes=[0, 1])
    return cfg


def work_dir(family: str, scan: bool) -> Path:
    return WORK if family == "qwen3_vl" else WORK.with_name(f"{WORK.name}-{family}{'-scan' if scan else ''}")


def maxtext_sizes(cfg: dict, scan: bool) -> list[str]:
    """MaxText's model given the checkpoint's text and tower sizes, use_multimodal=true."""
    from bench.vision import qwen3_omni_sizes, qwen3_vl_sizes

    if cfg["model_type"] == "qwen3_omni_moe":
        return qwen3_omni_sizes(cfg) + [f"n_window_for_audio={cfg['thinker_config']['audio_config'].get('n_window', 50)}"]
    text, vision = cfg["text_config"], cfg["vision_config"]
    if cfg["model_type"] == "qwen3_5_moe":  # ``python -m bench hybrid``'s decoder sizes, and the tower's
        from maxtext_hybrid import overrides

        values = overrides(cfg, scan) | {
            "use_multimodal": "true", "hidden_size_for_vit": vision["hidden_size"],
            "intermediate_size_for_vit": vision["intermediate_size"], "num_attention_heads_for_vit": vision["num_heads"],
            "num_hidden_layers_for_vit": vision["depth"], "out_hidden_size_for_vit": vision["out_hidden_size"],
            "num_position_embeddings_for_vit": vision["num_position_embeddings"],
            "patch_size_for_vit": vision["patch_size"], "temporal_patch_size_for_vit": vision["temporal_patch_size"],
            "spatial_merge_size_for_vit": vision["spatial_merge_size"]}
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
    if cfg["model_type"] == "qwen3_vl":
        return qwen3_vl_sizes(cfg)
    moe = text["moe_intermediate_size"]
    return qwen3_vl_sizes({**cfg, "text_config": {**text, "intermediate_size": moe}}) + [
        f"num_experts={text['num_experts']}", f"num_experts_per_tok={text['num_experts_per_tok']}",
        f"base_moe_mlp_dim={moe}"]


# --- in MaxText's venv -----------------------------------------------------------------------

def make_hf(out: Path) -> None:
    import numpy as np
    import torch
    import transformers

    fields = json.loads((out / "synth-config.json").read_text())
    family = fields["model_type"]
    if family == "qwen3_omni_moe":
        return make_omni(out)
    if family == "qwen3_5_moe":  # the hub's layout (tests/hub_checkpoints.py: experts fused, mtp.* beside)
        sys.path.insert(0, str(REPO))
        from tests import hub_checkpoints

        model = hub_checkpoints.build(fields)
        hub_checkpoints.write_hub(str(out), hub_checkpoints.hub_tensors(model, fields), fields)
    else:
        torch.manual_seed(0)
        model = getattr(transformers, FAMILIES[family][0])(transformers.AutoConfig.for_model(**fields))
        model = model.to(torch.float32).eval()
        with torch.no_grad():
            for tensor in model.parameters():
                noise = torch.randn(tensor.shape) * (0.05 if tensor.ndim > 1 else 0.1)
                tensor.copy_((tensor + noise if tensor.ndim == 1 else noise).to(torch.bfloat16).to(torch.float32))
        model.save_pretrained(str(out))
        if family == "qwen3_vl_moe":  # the releases' fused-expert layout, as bench/hf_tiny.py writes it
            sys.path.insert(0, str(BENCH))
            from hf_tiny import hub_expert_layout

            hub_expert_layout(out)
    vision = model.config.vision_config
    t, h, w = GRID
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = np.random.default_rng(7).uniform(-1, 1, (t * h * w, patch)).astype(np.float32)
    grid = torch.tensor([GRID])
    result = {}
    with torch.no_grad():
        for name, ids in (("text", TEXT), ("image", image_tokens(family))):
            tokens = torch.tensor([ids])
            kinds = (tokens == image_pad(family)).int()  # mm_token_type_ids: 1 on image tokens, as the processor marks them
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


def make_omni(out: Path) -> None:
    """Qwen3-Omni: bench/hf_tiny.py's model and files (the release's layout), then the thinker's float32 logits and
    3-D positions on text, text around the image, and text around one chunk of audio."""
    import numpy as np
    import torch
    import transformers

    made = subprocess.run([sys.executable, str(BENCH / "hf_tiny.py"), str(out / "synth-config.json"), str(out)],
                          capture_output=True, text=True)
    if made.returncode:
        raise SystemExit(f"hf_tiny.py: {made.stderr.strip().splitlines()[-1:]}")
    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    thinker = model.thinker
    vision, audio = thinker.config.vision_config, thinker.config.audio_config
    t, h, w = GRID
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = np.random.default_rng(7).uniform(-1, 1, (t * h * w, patch)).astype(np.float32)
    mel = np.random.default_rng(8).normal(size=(1, audio.num_mel_bins, AUDIO_FRAMES)).astype(np.float32)
    grid = torch.tensor([GRID])
    extra = {"text": {}, "image": {"pixel_values": torch.from_numpy(pixels), "image_grid_thw": grid},
             "audio": {"input_features": torch.from_numpy(mel),
                       "feature_attention_mask": torch.ones(1, AUDIO_FRAMES, dtype=torch.long)}}
    with torch.no_grad():
        for name, ids in inputs("qwen3_omni_moe").items():
            tokens = torch.tensor([ids])
            mask = torch.ones_like(tokens)
            logits = thinker(input_ids=tokens, attention_mask=mask, **extra[name]).logits[0].numpy()
            positions, _ = thinker.model.get_rope_index(
                tokens, extra[name].get("image_grid_thw"), None, attention_mask=mask,
                audio_seqlens=torch.tensor([AUDIO_FRAMES]) if name == "audio" else None)
            np.save(out / f"{name}_positions.npy", positions[:, 0].T.numpy().astype(np.int64))  # (tokens, 3)
            np.save(out / f"{name}_logits.npy", logits)
    np.save(out / "pixels.npy", pixels)
    np.save(out / "mel.npy", mel)


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
    family = json.loads((hf / "synth-config.json").read_text())["model_type"]
    if family == "qwen3_omni_moe":
        return imitate_omni(hf, Path(work))
    model = getattr(transformers, FAMILIES[family][0]).from_pretrained(str(hf), dtype=torch.float32).eval()
    visual = model.model.visual
    ids = torch.tensor([image_tokens(family)])
    inputs = {"input_ids": ids, "pixel_values": torch.from_numpy(np.load(hf / "pixels.npy")),
              "image_grid_thw": torch.tensor([GRID]), "mm_token_type_ids": (ids == image_pad(family)).int()}
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
    for merger in (visual.merger, *getattr(visual, "deepstack_merger_list", [])):  # Qwen3.5: no deepstack
        merger.act_fn = torch.nn.GELU(approximate="tanh")
    result["mergers' GELU tanh-approximated"] = diff()
    visual.blocks[0].register_forward_pre_hook(bf16_positions, with_kwargs=True)
    result["and position embeddings rounded to bfloat16"] = diff()
    return result


def imitate_omni(hf: Path, work: Path) -> dict:
    """Qwen3-Omni: the thinker's image and audio logits with MaxText's GELU (tanh-approximated, ``jax.nn.gelu``) in
    place of transformers' exact one wherever transformers uses it (the vision mergers; the audio tower's
    convolutions, MLPs and projector), then (image) the interpolated position embeddings rounded to bfloat16."""
    import numpy as np
    import torch
    import transformers

    thinker = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(hf), dtype=torch.float32).eval().thinker
    visual = thinker.model.visual
    feeds = {"image": {"pixel_values": torch.from_numpy(np.load(hf / "pixels.npy")),
                       "image_grid_thw": torch.tensor([GRID])},
             "audio": {"input_features": torch.from_numpy(np.load(hf / "mel.npy")),
                       "feature_attention_mask": torch.ones(1, AUDIO_FRAMES, dtype=torch.long)}}
    ids = inputs("qwen3_omni_moe")

    def diff(name: str) -> float:
        tokens = torch.tensor([ids[name]])
        with torch.no_grad():
            logits = thinker(input_ids=tokens, attention_mask=torch.ones_like(tokens), **feeds[name]).logits[0]
        theirs = np.load(work / f"maxtext_{name}_logits.npy")
        return float(np.abs(theirs[:, : logits.shape[-1]] - logits.numpy()).max())

    result = {name: {"as is": diff(name)} for name in feeds}
    exact = torch.nn.functional.gelu

    def tanh_gelu(x, approximate="none"):
        return exact(x, approximate="tanh")

    bound = [m for m in thinker.modules() if getattr(m, "act", None) is exact]  # GELUActivation keeps its own
    torch.nn.functional.gelu = tanh_gelu  # nn.GELU (the mergers) calls it at run time
    for module in bound:
        module.act = tanh_gelu
    try:
        for name in feeds:
            result[name]["GELUs tanh-approximated"] = diff(name)
        patches = {}

        def bf16_positions(module, args, kwargs):  # the first block's input is patches + positions
            positions = (args[0] - patches["embedded"]).to(torch.bfloat16).to(torch.float32)
            return (patches["embedded"] + positions, *args[1:]), kwargs

        visual.patch_embed.register_forward_hook(lambda module, inputs, out: patches.__setitem__("embedded", out))
        visual.blocks[0].register_forward_pre_hook(bf16_positions, with_kwargs=True)
        result["image"]["and position embeddings rounded to bfloat16"] = diff("image")
    finally:
        torch.nn.functional.gelu = exact
        for module in bound:
            module.act = exact
    return result


def forward(ckpt: str, hf_dir: str, work: str, scan: str = "false") -> dict:
    import jax.numpy as jnp
    import maxtext
    import numpy as np
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    hf = Path(hf_dir)
    cfg = json.loads((hf / "synth-config.json").read_text())
    family = cfg["model_type"]
    text = cfg.get("thinker_config", cfg)["text_config"]  # Qwen3-Omni: the thinker's
    length = max(len(ids) for ids in inputs(family).values())
    overrides = {
        "model_name": FAMILIES[family][1], "override_model_config": True, "hardware": "cpu",
        "skip_jax_distributed_system": True, "base_output_directory": work, "run_name": "logits",
        "load_parameters_path": ckpt, "attention": "dot_product", "dtype": "float32", "weight_dtype": "float32",
        "matmul_precision": "highest", "per_device_batch_size": 1, "max_target_length": length,
        "max_prefill_predict_length": length, "enable_checkpointing": False,
        "enable_dropout": False, "use_mrope": "true", "normalization_layer_epsilon": text["rms_norm_eps"],
        "logits_via_embedding": "false", "dtype_mm": "float32", "sparse_matmul": False, "capacity_factor": -1,
    }
    if "rope_theta" in text:  # Qwen3.5: in rope_parameters (``python -m bench hybrid``'s overrides)
        overrides["rope_max_timescale"] = text["rope_theta"]
    settings = [f"{k}={v}" for k, v in overrides.items()] + maxtext_sizes(cfg, scan == "true")
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(["logits", base, *settings])
    model, _ = model_creation_utils.from_pretrained(config)
    vision = cfg.get("thinker_config", cfg)["vision_config"]
    t, h, w = GRID
    tp, p, c = vision.get("temporal_patch_size", 2), vision.get("patch_size", 16), vision.get("in_channels", 3)
    pixels = np.load(hf / "pixels.npy").reshape(1, c, t * tp, h * p, w * p)  # the same patches, in order
    result = {}
    media = {"text": {}, "image": {"encoder_images": jnp.asarray(pixels, jnp.float32)}}
    if (hf / "mel.npy").exists():  # Qwen3-Omni: (batch, mel bins, frames), as MaxText's audio tower reads it
        media["audio"] = {"encoder_audios": jnp.asarray(np.load(hf / "mel.npy"), jnp.float32)}
    for name, ids in inputs(family).items():
        tokens = jnp.asarray(np.array(ids)[None], jnp.int32)
        positions = jnp.asarray(np.load(hf / f"{name}_positions.npy")[None], jnp.int32)
        kwargs = media[name]
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

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hf"]:
        make_hf(Path(argv[1]))
        return 0
    if argv[:1] == ["forward"]:
        print(json.dumps(forward(*argv[1:5])))
        return 0
    if argv[:1] == ["imitate"]:
        print(json.dumps(imitate(*argv[1:3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_vl")
    parser.add_argument("--scan", action="store_true", help="scanned conversions (Qwen3.5 only: no deepstack)")
    parser.add_argument("--keep", action="store_true", help="keep the work files")
    args = parser.parse_args(argv)
    if args.scan and args.family != "qwen3_5_moe":
        parser.error("--scan: MaxText runs Qwen3-VL's vision path (deepstack) unscanned only")
    work, scan = work_dir(args.family, args.scan), str(args.scan).lower()
    shutil.rmtree(work, ignore_errors=True)
    hf, ours = work / "hf", work / "ckptconv-f32"
    hf.mkdir(parents=True)
    cfg = config(args.family)
    (hf / "synth-config.json").write_text(json.dumps(cfg))
    theirs = work / "maxtext-f32"
    layout = "--scan-layers" if args.scan else "--no-scan-layers"

    chain = [([MT_PYTHON, __file__, "hf", hf], "hf.log", MT_ENV),
             (convert_cmd(hf, ours, "--devices", "1", "--dtype", "float32", "--multimodal", layout), "ckptconv.log",
              CONVERT_ENV),
             ([MT_PYTHON, __file__, "forward", ours / "0" / "items", hf, work, scan], "forward.log", MT_ENV),
             # MaxText's own conversion of the same checkpoint, and its forward on it: the comparison's floor
             (maxtext_convert_cmd(FAMILIES[args.family][1], hf, theirs,
                                  [*maxtext_sizes(cfg, args.scan), "logits_via_embedding=false"],
                                  ["--lazy_load_tensors=false", "--eager_load_method=safetensors",
                                   "--simulated_cpu_devices_count=1", "--save_dtype=float32"]),
              "maxtext-convert.log", {**MT_ENV, "HF_HOME": str(work / "hf-home")}),
             ([MT_PYTHON, __file__, "forward", theirs / "0" / "items", hf, work / "own", scan], "forward-own.log",
              MT_ENV)]
    outputs = []
    for cmd, log, env in chain:
        (work / "own").mkdir(exist_ok=True)
        done = run(cmd, work / log, env)
        if done.returncode:
            print(f"{log}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        outputs.append(done.stdout)
    result = json.loads(outputs[2].strip().splitlines()[-1])
    result["on MaxText's own conversion"] = json.loads(outputs[4].strip().splitlines()[-1])
    done = run([MT_PYTHON, __file__, "imitate", hf, work], work / "imitate.log", MT_ENV)
    if done.returncode == 0:
        result["transformers imitating MaxText (image)"] = json.loads(done.stdout.strip().splitlines()[-1])
    compared, leaves = compare_outputs(ours, theirs, work / "compare.json", work / "compare.log")
    result["leaves"] = {"identical": leaves["identical"], "compared": leaves["leaves_compared"],
                        "only_in_ckptconv": leaves["only_in_a"], "only_in_maxtext": leaves["only_in_b"],
                        "exit": compared.returncode}
    (work / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    if not args.keep:
        shutil.rmtree(ours, ignore_errors=True)
        shutil.rmtree(theirs, ignore_errors=True)
    return 0 if all(result[name]["ok"] for name in inputs(args.family)) and result["leaves"]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
