"""Gemma 4's vision tower and projector under ``--multimodal`` (MaxText 0.2.5's ``use_multimodal=true``), for
:mod:`ckptconv.families.gemma4`'s 26B-A4B and 31B (``gemma4-26b``, ``gemma4-31b``), after its ``GEMMA4_*`` mapping
and hooks and ``models/gemma4_vision.py``. Everything lands under ``vision_encoder/``:

- ``Gemma4VisionEncoderLayer_0/vision_entry``: ``input_projection/kernel`` (the patch projection, transposed: both
  flatten a patch as (row, column, channel)) and ``pos_emb_param`` (the hub's (2, positions, hidden) x / y table
  with its first two axes swapped: (positions, 2, hidden));
- ``Gemma4VisionEncoderLayer_0/std_scale``, ``std_bias``: the output standardisation, as stored;
- ``Gemma4VisionEncoderLayer_0/layer_{i}``: every tower layer on its own, whatever ``--scan-layers`` (MaxText's
  tower is a plain loop): ``attention/{query,key,value}/kernel`` (hidden, heads, head dim), ``attention/out/kernel``
  (heads, head dim, hidden), q / k norms, four RMSNorms, ``mlp/wi_0, wi_1, wo`` (the hub's ``*.linear.weight``
  of ``Gemma4ClippableLinear``); the norms are stored as used (Gemma 4 folds the ``1 +`` in): copied;
- ``Gemma4VisionProjector_0/projection/kernel``: ``embed_vision.embedding_projection``, transposed (its pre-norm
  has no scale).

What MaxText's tower cannot be, ``--multimodal`` refuses (one line, nothing written): a tower without
``standardize`` (MaxText's mapping reads ``std_scale`` / ``std_bias``), with clipped linears (MaxText's layers have no
clamps: E2B / E4B's towers), with fewer KV heads than heads or a head dim other than hidden / heads (MaxText builds
the tower's attention from ``hidden_size_for_vit`` and ``num_attention_heads_for_vit`` alone); and E2B / E4B
altogether (MaxText 0.2.5's converter marks gemma4-small multimodal unsupported, and their towers clip).
"""

from __future__ import annotations

from ckptconv.families.base import LayerStack, LayoutError, Rule, multimodal, rule
from ckptconv.families.decoder import KERNEL
from ckptconv.families.transforms import TRANSPOSE, Permute, split_first, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

KIND = "vision"
KINDS = frozenset({KIND})
ENCODER = ("vision_encoder", "Gemma4VisionEncoderLayer_0")
PROJECTOR = ("vision_encoder", "Gemma4VisionProjector_0")
T = "model.vision_tower."
L = T + "encoder.layers.{layer}."
TOWER_NOTE = "vision tower (convert --multimodal: MaxText use_multimodal=true)"
PROJECTOR_NOTE = "vision projector (convert --multimodal: MaxText use_multimodal=true)"
QKV = (TRANSPOSE, split_last("v_heads"))  # (heads * hd, hidden) -> (hidden, heads, hd)
OUT = (TRANSPOSE, split_first("v_heads"))  # (hidden, heads * hd) -> (heads, hd, hidden)
SWAP_XY = (Permute("xy_table_to_positions_first", (1, 0, 2)),)  # (2, positions, hidden) -> (positions, 2, hidden)
# transformers' Gemma4VisionConfig defaults (the releases give every size)
DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 12,
            "patch_size": 16, "position_embedding_size": 10240}
PROBLEM = "vision_problem"  # spec value: why MaxText cannot hold this tower (refused only with --multimodal)


def _tower(hf: str, maxtext: tuple[str, ...], shape: tuple[str, ...], steps=(), note: str = TOWER_NOTE) -> Rule:
    per_layer = "{layer}" in hf
    return rule(hf, maxtext if per_layer else (*ENCODER, *maxtext), shape, steps, when=multimodal,
                kinds=KINDS if per_layer else None, note=note)


def _layer_rows() -> tuple[Rule, ...]:
    rows = [_tower(L + f"self_attn.{hf}_proj.linear.weight", ("attention", mx, "kernel"), ("v_q", "v_emb"), QKV)
            for hf, mx in (("q", "query"), ("k", "key"), ("v", "value"))]
    rows.append(_tower(L + "self_attn.o_proj.linear.weight", ("attention", "out", "kernel"), ("v_emb", "v_q"), OUT))
    rows += [_tower(L + f"self_attn.{hf}_norm.weight", ("attention", f"{mx}_norm", "scale"), ("v_hd",))
             for hf, mx in (("q", "query"), ("k", "key"))]
    rows += [_tower(L + f"{hf}.weight", (mx, "scale"), ("v_emb",)) for hf, mx in (
        ("input_layernorm", "pre_attention_norm"), ("post_attention_layernorm", "post_attention_norm"),
        ("pre_feedforward_layernorm", "pre_ffw_norm"), ("post_feedforward_layernorm", "post_ffw_norm"))]
    rows += [_tower(L + f"mlp.{hf}.linear.weight", ("mlp", mx, "kernel"), shape, KERNEL) for hf, mx, shape in (
        ("gate_proj", "wi_0", ("v_mlp", "v_emb")), ("up_proj", "wi_1", ("v_mlp", "v_emb")),
        ("down_proj", "wo", ("v_emb", "v_mlp")))]
    return tuple(rows)


RULES = (
    _tower(T + "patch_embedder.input_proj.weight", ("vision_entry", "input_projection", "kernel"),
           ("v_emb", "v_patch_in"), KERNEL),
    _tower(T + "patch_embedder.position_embedding_table", ("vision_entry", "pos_emb_param"),
           ("two", "v_positions", "v_emb"), SWAP_XY),
    _tower(T + "std_scale", ("std_scale",), ("v_emb",)),
    _tower(T + "std_bias", ("std_bias",), ("v_emb",)),
    rule("model.embed_vision.embedding_projection.weight", (*PROJECTOR, "projection", "kernel"), ("emb", "v_emb"),
         KERNEL, when=multimodal, note=PROJECTOR_NOTE),
) + _layer_rows()


def read_dims(cfg: ConfigReader, small: bool) -> tuple[dict[str, int], str | None]:
    """The tower's sizes (``v_*`` dims) from ``vision_config`` (read whether or not ``--multimodal`` asks for the
    tower, so its tensors are checked against them when it does), and why MaxText 0.2.5 cannot hold it, if so
    (None: it can). No ``vision_config``: no dims, and the reason."""
    if not cfg.has("vision_config"):
        cfg.runtime("vision_config")
        return {}, "this config has no vision_config (no vision tower)"
    vision = cfg.nested("vision_config")
    vision.require("model_type", ("gemma4_vision",), "gemma4_vision")
    vision.runtime("hidden_activation", "rms_norm_eps", "max_position_embeddings", "attention_dropout",
                   "rope_parameters", "pooling_kernel_size", "default_output_length", "global_head_dim",
                   "initializer_range")
    vision.require("attention_bias", (False,), False)
    dims = {f"v_{key}": vision.int(field, DEFAULTS[field]) for key, field in (
        ("emb", "hidden_size"), ("mlp", "intermediate_size"), ("layers", "num_hidden_layers"),
        ("heads", "num_attention_heads"), ("patch", "patch_size"), ("positions", "position_embedding_size"))}
    kv_heads = vision.int("num_key_value_heads", dims["v_heads"])
    dims["v_hd"] = vision.int("head_dim", 64)
    dims["v_q"], dims["v_patch_in"], dims["two"] = dims["v_heads"] * dims["v_hd"], 3 * dims["v_patch"] ** 2, 2
    standardize, clipped = vision.bool("standardize", False), vision.bool("use_clipped_linears", False)
    problem = None
    if small:
        problem = ("MaxText 0.2.5 does not convert Gemma 4 E2B / E4B's vision tower (its gemma4-small multimodal "
                   "mapping is marked unsupported) and its tower has no clipped linears, which E2B / E4B's use")
    elif clipped:
        problem = ("vision_config.use_clipped_linears is true: MaxText 0.2.5's Gemma 4 tower has no input / output "
                   "clamps")
    elif not standardize:
        problem = ("vision_config.standardize is false: MaxText 0.2.5's gemma4 mapping reads the tower's std_scale "
                   "and std_bias, which such a checkpoint does not hold")
    elif kv_heads != dims["v_heads"] or dims["v_hd"] * dims["v_heads"] != dims["v_emb"]:
        problem = (f"vision_config has {kv_heads} KV heads of {dims['v_hd']} for {dims['v_heads']} heads over "
                   f"hidden {dims['v_emb']}: MaxText 0.2.5's Gemma 4 tower has as many KV heads as heads, each "
                   f"hidden / heads wide")
    return dims, problem


def layout(spec: ModelSpec) -> tuple[LayerStack, ...]:
    """With ``--multimodal``, the tower's layers, each ``layer_{i}`` on its own; the reason MaxText cannot hold this
    tower, refused."""
    if not multimodal(spec):
        return ()
    if spec.values.get(PROBLEM):
        raise LayoutError(f"--multimodal: {spec.values[PROBLEM]}; convert without --multimodal (the text decoder)")
    return tuple(LayerStack((*ENCODER, f"layer_{i}"), (i,), False, kind=KIND, encoder=True)
                 for i in range(spec.dim("v_layers")))


NOT_CONVERTED = (("model.vision_tower.", "vision tower"), ("model.embed_vision.", "vision projector"))
AUDIO = (("model.audio_tower.", "audio tower"), ("model.embed_audio.", "audio projector"))


def not_converted(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    return AUDIO if multimodal(spec) else NOT_CONVERTED + AUDIO
