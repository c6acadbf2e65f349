"""Kimi-K2.5 and Kimi-K2.6 (``model_type: kimi_k25``, ``KimiK25ForConditionalGeneration``): the text
decoder of the multimodal wrapper, MaxText ``decoder_block: deepseek``.

The text decoder is Kimi-K2-Thinking's (:mod:`ckptconv.families.deepseek`, its rows and layout
unchanged: the router bias under ``params``, the INT4 routed experts decoded per read unit); the
wrapper only moves it:

- its ``config.json`` is in ``text_config`` (``model_type`` ``kimi_k2``, or ``deepseek_v3`` as
  transformers rewrites it), read exactly as a Kimi-K2 ``config.json``; the compressed-tensors
  ``quantization_config`` sits in ``text_config`` (read at the top level too; both, as transformers 5.7 saves
  the release, only when the two are identical);
- its tensors carry a ``language_model.`` prefix (``language_model.model.layers.N.*``,
  ``language_model.lm_head.weight``; transformers 5.24's ``save_pretrained`` writes the layers as
  ``language_model.model.blocks.N``), stripped by aliases (export writes the names ``--like`` has);
- the vision tower (MoonViT, ``vision_tower.*``) and the projector (``mm_projector.*``) are not
  part of MaxText's text decoder: reported, not converted (MaxText's ``kimi-k2.5-text`` /
  ``kimi-k2.6-text`` scripts drop them too).

MaxText's scripts write every leaf in float16; here the leaves are written in the dtype asked for, and
``--dtype float32`` rounded to float16 is theirs (docs/bench/GIANTS.md).
"""

from __future__ import annotations

import json

from ckptconv.families.base import GIB, Example, Family, MemoryExample, Sizes, Synthetic
from ckptconv.families.deepseek import INT4_QUANTIZATION_CONFIG as K2_THINKING_INT4
from ckptconv.families.deepseek import ROWS, layout
from ckptconv.families.deepseek import not_converted as text_not_converted, read_spec as read_text_spec
from ckptconv.families.deepseek import synthetic_config as text_synthetic_config
from ckptconv.families.decoder import make_spec
from ckptconv.families.quantized import read_quantization
from ckptconv.read.spec import ConfigReader, ModelSpec

PREFIX = "language_model."  # every text tensor's prefix in the release
TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
# the hub's names, and transformers' (a PEFT adapter's)
VISION = (("vision_tower.", "vision tower (MoonViT)"), ("mm_projector.", "multimodal projector"),
          ("model.vision_tower.", "vision tower (MoonViT)"), ("model.mm_projector.", "multimodal projector"))
# The wrapper's own fields: the vision tower's and the media tokens' settings, none of them a text weight
WRAPPER_RUNTIME = ("vision_config", "media_placeholder_token_id", "use_unified_vision_chunk", "video_placeholder",
                   "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                   "projection_hidden_size", "projection_layer_norm_eps", "ignore_index")


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.runtime(*WRAPPER_RUNTIME)
    cfg.require("tie_word_embeddings", (False,), False)  # the release has its own lm_head
    outer = read_quantization(cfg, ("compressed-tensors",))
    text = cfg.nested("text_config")
    text.require("model_type", TEXT_MODEL_TYPES, None)
    inner = read_text_spec(text)
    if outer and inner.values["quantization"]:
        _check_same_copies(cfg, cfg.raw("quantization_config"), text.raw("quantization_config"))
    values = {**inner.values, "quantization": inner.values["quantization"] or outer}
    return make_spec(cfg, "kimi_k25", inner.dims, values, inner.num_layers)


def _check_same_copies(cfg: ConfigReader, outer: dict, inner: dict) -> None:
    """Two copies of ``quantization_config`` (the top level's and ``text_config``'s) are one setting when identical;
    differing, which one holds is unclear: refused, naming the first field they differ in and both values."""
    path, a, b = _first_difference(outer, inner)
    if path is not None:
        cfg.fail(f"quantization_config in both config.json and its text_config, and they differ at {path or 'the top'}:"
                 f" {_short(a)} at the top, {_short(b)} in text_config; which one holds is unclear")


def _first_difference(a: object, b: object, path: str = "") -> tuple[str | None, object, object]:
    """The first (sorted) key path where two JSON values differ, with both values there; (None, a, b) if equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{path}.{key}" if path else key)
            if found[0] is not None:
                return found
        return None, a, b
    return (None, a, b) if a == b and type(a) is type(b) else (path, a, b)


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def not_converted(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    return VISION + tuple((PREFIX + prefix, what) for prefix, what in text_not_converted(spec))


# The release's quantization_config: Kimi-K2-Thinking's, its ignore list naming the wrapper's modules too
INT4_QUANTIZATION_CONFIG = {**K2_THINKING_INT4,
                            "ignore": ["re:.*lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:vision_tower.*",
                                       "re:mm_projector.*"]}
# A small MoonViT in transformers' Kimi_K25VisionConfig fields (the projector's width is the tower's)
VISION_CONFIG = {"model_type": "kimi_k25_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4,
                 "pos_emb_time": 1, "merge_kernel_size": [2, 2]}


def synthetic_config(m: Sizes) -> dict:
    """Kimi-K2's ``config.json`` (``model_type: kimi_k2``) in ``text_config``, a small vision tower's beside it;
    ``int4``: the release's quantization_config, in ``text_config``."""
    text = text_synthetic_config(m)
    text.pop("quantization_config", None)
    text.update(model_type="kimi_k2")
    if m.quantization == "int4":
        text["quantization_config"] = json.loads(json.dumps(INT4_QUANTIZATION_CONFIG))
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "vision_config": dict(VISION_CONFIG), "projection_hidden_size": VISION_CONFIG["hidden_size"],
            "media_placeholder_token_id": 3, "tie_word_embeddings": False, "torch_dtype": m.dtype}


MOE = {"num_experts": 4, "moe_intermediate_size": 32}
# Kimi-K2.6's layer widths (hidden 7168, 64 heads, q_lora 1536, kv_lora 512, dense MLP 18432, experts of
# 2048 in INT4; a smaller vocabulary): one dense and one MoE layer with 16 of its 384 experts; ``full``: the
# whole release (61 layers, 384 experts, vocab 163840) planned from headers
K26_WIDTHS = {"quantization": "int4", "vocab_size": 16384, "hidden_size": 7168, "num_layers": 2, "num_heads": 64,
              "head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_experts": 16,
              "config_overrides": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                   "num_experts_per_tok": 8}}
K26_FULL = {**K26_WIDTHS, "vocab_size": 163840, "num_layers": 61, "num_experts": 384}

SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("kimi_k25", {"num_layers": 3, **MOE}),),
    logits=(Example("kimi_k25", {"num_layers": 3, **MOE}, devices=4),
            Example("kimi_k25-noscan", {"num_layers": 3, **MOE}, scan=False, devices=4)),
    memory=(MemoryExample("kimi-k2.6-int4", K26_WIDTHS, devices=(16, 1), bound=int(1.5 * GIB),
                          source_bytes=int(1.9 * GIB), full=K26_FULL, max_shard_bytes=5 * 10**9),),
    hub_prefixes={"kimi_k25": ("", PREFIX)},
)

FAMILY = Family(
    name="kimi_k25",
    model_types=("kimi_k25",),
    decoder_block="deepseek",
    rules=ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    # transformers 5.24's save_pretrained renames the text layers too when it undoes its vision tower's
    # blocks -> layers renaming (its own loader renames them back); then the hub's names; transformers'
    # in-memory ones (a PEFT adapter's): model.language_model.*
    aliases=((PREFIX + "model.blocks.", "model.layers."), (PREFIX, ""), ("model.language_model.", "model.")),
    not_converted=not_converted,
)
