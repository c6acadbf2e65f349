"""Qwen3-VL dense (``model_type: qwen3_vl``; Qwen3-VL-2B, -4B): MaxText ``decoder_block: qwen3``, text decoder only.

The text decoder of a multimodal checkpoint (``model.language_model.*``, its config in ``text_config``,
the head ``lm_head.weight`` at the top) is Qwen3's: q/k norms, run-time query scaling, half-split RoPE,
so the rules are :mod:`ckptconv.families.qwen3`'s, read through an alias. mRoPE sections are recorded,
not used (text positions make interleaved mRoPE plain RoPE). The wrapper's ``tie_word_embeddings``
decides the head, as in transformers (the ``text_config`` copy transformers writes is recorded).
The vision tower (``model.visual.*``) is named in the report; with ``--multimodal`` (MaxText's ``use_multimodal=true``)
it is converted as MaxText 0.2.5 does under ``vision_encoder/``: ``Qwen3VLVisionEncoder_0`` (the 3-D patch
convolution as a (t, kh, kw, in, out) kernel, the learned positions as stored, every ``blocks_{i}`` with the fused
``qkv`` cut into query/key/value kernels and biases split per head, the deepstack mergers ``merger_{j}``) and
``Qwen3VLVisionProjector_0`` (the final merger). MaxText's Qwen3-VL vision path (deepstack injection into the
decoder) runs unscanned only, so with ``--multimodal`` the layout is unscanned (:class:`UnscannedOnly`: the default
becomes unscanned and an explicit ``--scan-layers`` is refused).
"""

from __future__ import annotations

from ckptconv.families.qwen3 import FAMILY as QWEN3
from ckptconv.families.base import (
    MIB, Example, Family, LayerStack, MemoryExample, Output, Rule, Sizes, Synthetic, UnscannedOnly, multimodal, rule,
    uniform_layout,
)
from ckptconv.families.decoder import KERNEL, decoder_config, make_spec, read_dense_dims
from ckptconv.families.transforms import TRANSPOSE, Permute, TakeRanges, split_first, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

TEXT = "model.language_model."  # where the hub and transformers store the decoder (the rules say ``model.``)
ALIASES = ((TEXT, "model."),)
TOWER = (("model.visual.", "vision tower"),)  # Qwen3-VL-MoE's too: converted with --multimodal


def read_text(cfg: ConfigReader, text_type: str) -> tuple[ConfigReader, bool]:
    """The wrapper's ``text_config`` (of ``text_type``) and whether the head is tied (the wrapper's flag)."""
    cfg.runtime("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_config")
    tied = cfg.bool("tie_word_embeddings", False)
    text = cfg.nested("text_config")
    text.require("model_type", (text_type,), text_type)
    text.runtime("tie_word_embeddings")  # transformers writes its text config's default here; unused
    text.require("attention_bias", (False,), False)
    return text, tied


def read_spec(cfg: ConfigReader) -> ModelSpec:
    text, tied = read_text(cfg, "qwen3_vl_text")
    dims = read_dense_dims(text) | read_vision_dims(cfg.nested("vision_config"))
    return make_spec(cfg, "qwen3_vl", dims, {"tie_word_embeddings": tied, "interleave_rope": False},
                     text.int("num_hidden_layers"))


# transformers' Qwen3VLVisionConfig defaults (the releases give every field)
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                   "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584,
                   "num_position_embeddings": 2304}


def read_vision_dims(vision: ConfigReader, model_types: tuple[str, ...] = ("qwen3_vl_vision", "qwen3_vl"),
                     deepstack_default: tuple[int, ...] = (8, 16, 24), heads: str = "v_heads") -> dict[str, int]:
    """The tower's sizes (``v_*`` dims), read whether or not ``--multimodal`` asks for it, so its tensors are
    checked against them when it does (``model_types``: the tower's, the first its default;
    ``deepstack_default``: the deepstack indexes without the field, transformers' default; ``heads``: the name of
    its heads dim, another where the decoder's dims hold a ``v_heads`` already: Qwen3.5's linear attention)."""
    vision.require("model_type", model_types, model_types[0])
    vision.runtime("hidden_act", "rope_parameters")
    dims = {f"v_{key}": vision.int(field, VISION_DEFAULTS[field]) for key, field in (
        ("emb", "hidden_size"), ("mlp", "intermediate_size"), ("layers", "depth"),
        ("channels", "in_channels"), ("patch", "patch_size"), ("tpatch", "temporal_patch_size"),
        ("out", "out_hidden_size"), ("positions", "num_position_embeddings"))}
    dims[heads] = vision.int("num_heads", VISION_DEFAULTS["num_heads"])
    merge = vision.int("spatial_merge_size", VISION_DEFAULTS["spatial_merge_size"])
    deepstack = vision.raw("deepstack_visual_indexes")
    deepstack = list(deepstack_default) if deepstack is None else deepstack
    if not (isinstance(deepstack, list) and all(isinstance(i, int) and 0 <= i < dims["v_layers"] for i in deepstack)):
        vision.fail(f"deepstack_visual_indexes must be a list of layer indices below depth={dims['v_layers']}, "
                    f"got {deepstack!r}")
    if dims["v_emb"] % dims[heads]:
        vision.fail(f"hidden_size={dims['v_emb']} is not a multiple of num_heads={dims[heads]}")
    return dims | {"v_merged": dims["v_emb"] * merge * merge, "v_deepstack": len(deepstack),
                   "v_emb2": 2 * dims["v_emb"], "v_qkv": 3 * dims["v_emb"]}


# --- the vision tower (--multimodal), as MaxText 0.2.5's QWEN3_VL mapping and hooks with use_multimodal
ENCODER, PROJECTOR = ("vision_encoder", "Qwen3VLVisionEncoder_0"), ("vision_encoder", "Qwen3VLVisionProjector_0")
BLOCK_KIND, DEEPSTACK_KIND = "vision", "deepstack"
TOWER_NOTE = "vision tower (convert --multimodal: MaxText use_multimodal=true)"
# a patch merger's LayerNorm, fc1 and fc2 as Qwen3-VL stores them (Qwen3-Omni's: ln_q, mlp.0, mlp.2)
MERGER_NAMES = ("norm", "linear_fc1", "linear_fc2")
THIRDS = (("query", 0), ("key", "v_emb"), ("value", "v_emb2"))  # the fused qkv's parts and their first rows


def vision_rules(visual: str, encoder: tuple[str, ...], projector: tuple[str, ...], note: str,
                 merger_names: tuple[str, str, str] = MERGER_NAMES,
                 deepstack: str | None = "deepstack_merger_list.", heads: str = "v_heads") -> tuple[Rule, ...]:
    """The tower's rules: the stored tensors under ``visual``, MaxText's leaves under ``encoder`` (patch embedding,
    learned positions, ``blocks_{i}`` with the fused ``qkv`` cut into query/key/value kernels and biases split per
    head, the deepstack mergers ``merger_{j}``) and ``projector`` (the final merger). Qwen3-VL's and Qwen3-Omni's
    towers differ only in these names; ``deepstack``: the deepstack mergers' prefix, None without them (Qwen3.5);
    ``heads``: the heads dim, as :func:`read_vision_dims` names it."""

    def tower(hf: str, maxtext: tuple[str, ...], hf_shape: tuple[str, ...], steps=(), kind: str | None = None):
        return rule(visual + hf, maxtext, hf_shape, steps, when=multimodal,
                    kinds=frozenset({kind}) if kind else None, note=note)

    def merger(hf: str, maxtext: tuple[str, ...], norm: str, kind: str | None = None) -> tuple[Rule, ...]:
        """A patch merger: LayerNorm (over ``norm``), fc1 (v_merged -> v_merged), GELU, fc2 (-> v_out)."""
        ln, fc1, fc2 = (hf + name for name in merger_names)
        return (tower(ln + ".weight", (*maxtext, "ln_q", "scale"), (norm,), kind=kind),
                tower(ln + ".bias", (*maxtext, "ln_q", "bias"), (norm,), kind=kind),
                tower(fc1 + ".weight", (*maxtext, "mlp_0", "kernel"), ("v_merged", "v_merged"), KERNEL, kind),
                tower(fc1 + ".bias", (*maxtext, "mlp_0", "bias"), ("v_merged",), kind=kind),
                tower(fc2 + ".weight", (*maxtext, "mlp_2", "kernel"), ("v_out", "v_merged"), KERNEL, kind),
                tower(fc2 + ".bias", (*maxtext, "mlp_2", "bias"), ("v_out",), kind=kind))

    block = visual + "blocks.{layer}."
    return (
        tower("patch_embed.proj.weight", (*encoder, "patch_embed", "proj", "kernel"),
              ("v_emb", "v_channels", "v_tpatch", "v_patch", "v_patch"),
              (Permute("conv3d_to_thwio", (2, 3, 4, 1, 0)),)),
        tower("patch_embed.proj.bias", (*encoder, "patch_embed", "proj", "bias"), ("v_emb",)),
        tower("pos_embed.weight", (*encoder, "pos_embed_interpolate", "pos_embed"), ("v_positions", "v_emb")),
        *merger("merger.", (*projector, "merger"), "v_emb"),
        *(tower(f"blocks.{{layer}}.{hf}.{part}", (mx, leaf), ("v_emb",), kind=BLOCK_KIND)
          for hf, mx in (("norm1", "ln1"), ("norm2", "ln2")) for part, leaf in (("weight", "scale"), ("bias", "bias"))),
        Rule(block + "attn.qkv.weight", ("v_qkv", "v_emb"),
             tuple(_qkv(part, start, False, heads) for part, start in THIRDS),
             multimodal, frozenset({BLOCK_KIND}), note),
        Rule(block + "attn.qkv.bias", ("v_qkv",),
             tuple(_qkv(part, start, True, heads) for part, start in THIRDS),
             multimodal, frozenset({BLOCK_KIND}), note),
        tower("blocks.{layer}.attn.proj.weight", ("attn", "attn", "out", "kernel"), ("v_emb", "v_emb"),
              (TRANSPOSE, split_first(heads)), BLOCK_KIND),
        tower("blocks.{layer}.attn.proj.bias", ("attn", "attn", "out", "bias"), ("v_emb",), kind=BLOCK_KIND),
        tower("blocks.{layer}.mlp.linear_fc1.weight", ("mlp", "kernel"), ("v_mlp", "v_emb"), KERNEL, BLOCK_KIND),
        tower("blocks.{layer}.mlp.linear_fc1.bias", ("mlp", "bias"), ("v_mlp",), kind=BLOCK_KIND),
        tower("blocks.{layer}.mlp.linear_fc2.weight", ("mlp_out", "kernel"), ("v_emb", "v_mlp"), KERNEL, BLOCK_KIND),
        tower("blocks.{layer}.mlp.linear_fc2.bias", ("mlp_out", "bias"), ("v_emb",), kind=BLOCK_KIND),
        # the deepstack mergers' norm spans the merged patches (use_postshuffle_norm)
        *(merger(deepstack + "{layer}.", (), "v_merged", DEEPSTACK_KIND) if deepstack is not None else ()),
    )


def _qkv(part: str, start: str | int, bias: bool, heads: str) -> Output:
    """One of the fused ``qkv``'s thirds (rows ``[start, start + v_emb)``), heads on their own axis."""
    take = TakeRanges(f"take_{part}", 0, "v_qkv", start, "v_emb")
    steps = (take, split_last(heads)) if bias else (take, TRANSPOSE, split_last(heads))
    return Output(("attn", "attn", part, "bias" if bias else "kernel"), steps)


VISION_RULES = vision_rules("model.visual.", ENCODER, PROJECTOR, TOWER_NOTE)


def vision_stacks(spec: ModelSpec, encoder: tuple[str, ...] = ENCODER) -> tuple[LayerStack, ...]:
    """The tower's blocks and deepstack mergers under ``encoder``, one unscanned stack each (MaxText's tower is a
    plain loop)."""
    return (tuple(LayerStack((*encoder, f"blocks_{i}"), (i,), False, kind=BLOCK_KIND, encoder=True)
                  for i in range(spec.dim("v_layers")))
            + tuple(LayerStack((*encoder, f"merger_{j}"), (j,), False, kind=DEEPSTACK_KIND, encoder=True)
                    for j in range(spec.dim("v_deepstack"))))


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """The decoder's layers, and with ``--multimodal`` the tower's blocks and deepstack mergers, unscanned only."""
    if not multimodal(spec):
        return uniform_layout(spec, scan)
    if scan:
        raise UnscannedOnly("--multimodal: MaxText 0.2.5 runs Qwen3-VL's vision path (deepstack features injected "
                            "into decoder layers) unscanned only (it refuses scan_layers with deepstack indexes); "
                            "convert with --no-scan-layers")
    return uniform_layout(spec, False) + vision_stacks(spec, ENCODER)


def mrope_scaling(head_dim: int) -> dict:
    """Interleaved mRoPE over half the head dim (time, height, width), as the Qwen3-VL and Omni releases set it."""
    half = head_dim // 2
    return {"mrope_interleaved": True, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
            "rope_type": "default"}


def wrapper_config(m: Sizes, architecture: str, text: dict, **top: object) -> dict:
    """A Qwen3-VL ``config.json`` as the hub publishes it: the decoder in ``text_config`` (mRoPE sections over
    half the head dim, transformers 4's spelling), a small vision tower's settings beside it."""
    for key in ("architectures", "torch_dtype"):
        text.pop(key)
    text.update(model_type=f"{m.model_type}_text", rope_theta=5000000, attention_bias=False,
                rope_scaling=mrope_scaling(m.head_dim))
    return {"architectures": [architecture], "model_type": m.model_type, "text_config": text,
            "vision_config": {"deepstack_visual_indexes": [0], "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                              "model_type": f"{m.model_type}_vision", "num_heads": 2, "out_hidden_size": m.hidden_size},
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "tie_word_embeddings": m.tie_word_embeddings, "torch_dtype": m.dtype, **top}


def synthetic_config(m: Sizes) -> dict:
    return wrapper_config(m, "Qwen3VLForConditionalGeneration", decoder_config(m, ""))


SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("qwen3_vl", {"num_layers": 3}, devices=16),
                Example("qwen3_vl-untied", {"num_layers": 2, "tie_word_embeddings": False}),
                Example("qwen3_vl-multimodal", {"num_layers": 3}, devices=16, multimodal=True)),
    logits=(Example("qwen3_vl", {"tie_word_embeddings": True}, devices=4),
            Example("qwen3_vl-multimodal", {"tie_word_embeddings": True}, scan=False, devices=4, multimodal=True)),
    # 4x the layers (4x the bytes) at the same widths: the same peak
    memory=(MemoryExample("qwen3_vl-layers", {
        "vocab_size": 8192, "hidden_size": 1024, "num_layers": 24, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 128, "intermediate_size": 4096}, fewer={
        "vocab_size": 8192, "hidden_size": 1024, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 128, "intermediate_size": 4096}, more_bytes=500 * MIB),),
    hub_prefixes={"qwen3_vl": ("model.", TEXT)},
)

FAMILY = Family(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    decoder_block="qwen3",
    rules=QWEN3.rules + VISION_RULES,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    aliases=ALIASES,
    not_converted=lambda spec: () if multimodal(spec) else TOWER,
    encoders=("vision tower",),
)
