"""Gemma 4 E2B / E4B (``gemma4`` configs with ``hidden_size_per_layer_input`` or ``num_kv_shared_layers``): MaxText
``decoder_block: gemma4_small`` (``gemma4-e2b``, ``gemma4-e4b``). The rows and config checks the small models add to
:mod:`ckptconv.families.gemma4` (one family: the releases share ``model_type: gemma4``), after MaxText 0.2.5's
``GEMMA4_SMALL_*`` mapping and hooks and ``models/gemma4_small.py``:

- the pattern is 4 sliding + 1 full (E2B, MaxText's ``gemma4-e2b``) or 5 + 1 (E4B and any other model name);
  global layers have their own head dim (``global_head_dim``) but the local layers' KV heads, and values of their
  own (``attention_k_eq_v`` false);
- per-layer inputs: ``embed_tokens_per_layer`` (vocab, layers * ple) copied as stored (both scale it at run time),
  ``per_layer_model_projection`` and ``per_layer_projection_norm`` under ``decoder/per_layer_embedder``; in every
  layer ``per_layer_input_gate``, ``per_layer_projection`` and ``post_per_layer_input_norm``;
- the last ``num_kv_shared_layers`` layers reuse an earlier layer's keys and values: no k/v projections, no
  ``k_norm`` (transformers builds none, MaxText holds none); with ``use_double_wide_mlp`` (E2B) their MLP is twice
  as wide. The releases as shipped still store those layers' ``k_proj``, ``v_proj`` and ``k_norm`` (E2B's layers
  15-34): nothing reads them and MaxText 0.2.5's converter skips them, so they are reported, not written
  (:data:`UNREAD`).

MaxText threads the per-layer inputs and the shared keys and values through an unscanned loop only, so these models
are laid out unscanned (``decoder/layers_{i}``); a scanned layout is refused (:class:`UnscannedOnly`).
"""

from __future__ import annotations

from ckptconv.families.base import LayerStack, UnscannedOnly, never, rule
from ckptconv.families.decoder import KERNEL, KV_KERNEL
from ckptconv.read.spec import ConfigReader, ModelSpec

P = "model.layers.{layer}."
SLIDING, FULL = "sliding_attention", "full_attention"
PERIODS = {5: "gemma4-e2b", 6: "gemma4-e4b"}  # MaxText picks the pattern by model name (5 + 1 unless gemma4-e2b)

# layer kinds: local or global; with keys and values of their own, or sharing an earlier layer's (narrow or wide MLP)
LOCAL = frozenset({"local_ple", "local_ple_shared", "local_ple_wide"})
GLOBAL = frozenset({"global_ple", "global_ple_shared", "global_ple_wide"})
OWN_KV_LOCAL, OWN_KV_GLOBAL = frozenset({"local_ple"}), frozenset({"global_ple"})
NARROW = frozenset({"local_ple", "global_ple", "local_ple_shared", "global_ple_shared"})
WIDE = frozenset({"local_ple_wide", "global_ple_wide"})
ALL = LOCAL | GLOBAL
SHARED_LOCAL, SHARED_GLOBAL = LOCAL - OWN_KV_LOCAL, GLOBAL - OWN_KV_GLOBAL

ROWS = (
    # the global layers' values (the large models' global layers have none: keys serve as values)
    rule(P + "self_attn.v_proj.weight", ("self_attention", "value", "kernel"), ("gkv", "emb"), KV_KERNEL,
         kinds=OWN_KV_GLOBAL),
    rule(P + "per_layer_input_gate.weight", ("per_layer_input_gate", "kernel"), ("ple", "emb"), KERNEL, kinds=ALL),
    rule(P + "per_layer_projection.weight", ("per_layer_projection", "kernel"), ("emb", "ple"), KERNEL, kinds=ALL),
    rule(P + "post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "scale"), ("emb",), kinds=ALL),
) + tuple(
    rule(P + f"mlp.{hf}.weight", ("mlp", maxtext, "kernel"), shape, KERNEL, kinds=WIDE)
    for hf, maxtext, shape in (("gate_proj", "wi_0", ("wide_mlp", "emb")), ("up_proj", "wi_1", ("wide_mlp", "emb")),
                               ("down_proj", "wo", ("emb", "wide_mlp"))))


SHARED_KV_NOTE = ("keys and values of a KV-shared layer: stored in the release, never read (the layer reuses an "
                  "earlier layer's; transformers builds no such weight and MaxText 0.2.5's converter skips it)")
# what a KV-shared layer of the release still stores: never active, so reported where present, never required
UNREAD = tuple(
    rule(P + f"self_attn.{hf}.weight", ("self_attention", maxtext, *leaf), shape, kinds=kinds, when=never,
         note=SHARED_KV_NOTE)
    for kinds, kv, hd in ((SHARED_LOCAL, "kv", "hd"), (SHARED_GLOBAL, "gkv", "ghd"))
    for hf, maxtext, leaf, shape in (("k_proj", "key", ("kernel",), (kv, "emb")),
                                     ("v_proj", "value", ("kernel",), (kv, "emb")),
                                     ("k_norm", "key_norm", ("scale",), (hd,))))


def is_small_spec(spec: ModelSpec) -> bool:
    return "small_period" in spec.values


EMBEDDER = ("decoder", "per_layer_embedder")
NO_PLE = "E2B / E4B's per-layer embedder: config.json has no per-layer inputs"
GLOBAL_ROWS = (
    # stored unscaled, as transformers' and MaxText's models both scale it by sqrt(ple) at run time
    rule("model.embed_tokens_per_layer.weight", (*EMBEDDER, "embed_tokens_per_layer"), ("ple_vocab", "ple_all"),
         when=is_small_spec, note=NO_PLE),
    rule("model.per_layer_model_projection.weight", (*EMBEDDER, "per_layer_model_projection", "kernel"),
         ("ple_all", "emb"), KERNEL, when=is_small_spec, note=NO_PLE),
    rule("model.per_layer_projection_norm.weight", (*EMBEDDER, "per_layer_projection_norm", "scale"), ("ple",),
         when=is_small_spec, note=NO_PLE),
)


def is_small(text: ConfigReader) -> bool:
    return bool(text.raw("hidden_size_per_layer_input") or text.raw("num_kv_shared_layers"))


def read_small(text: ConfigReader, dims: dict[str, int], layers: int) -> dict:
    """The small models' sizes into ``dims``; returns the spec values the layout reads."""
    types = text.raw("layer_types")
    if not isinstance(types, list) or not types or len(types) != layers:
        text.fail(f"field 'layer_types' = {repr(types)[:80]}: Gemma 4 E2B / E4B need one entry per layer "
                  f"(MaxText runs 4 sliding + 1 full as gemma4-e2b, 5 + 1 otherwise)")
    period = next((i + 1 for i, kind in enumerate(types) if kind != SLIDING), 0)
    if (period not in PERIODS or layers % period
            or any(kind != (FULL if i % period == period - 1 else SLIDING) for i, kind in enumerate(types))):
        text.fail(f"field 'layer_types' = {repr(types)[:120]} is not a whole number of blocks of 4 or 5 sliding "
                  f"layers and 1 full one (the patterns MaxText's gemma4_small runs)")
    text.require("attention_k_eq_v", (False,), False)
    text.require("enable_moe_block", (False,), False)
    text.runtime("num_experts", "top_k_experts", "moe_intermediate_size", "expert_intermediate_size",
                 # transformers uses the global layers' KV heads only with attention_k_eq_v
                 "num_global_key_value_heads")
    shared = text.count("num_kv_shared_layers", 0)
    first_shared = layers - shared
    if shared and (shared >= layers or first_shared < period):
        text.fail(f"num_kv_shared_layers={shared} of {layers} layers: the shared layers reuse the last earlier "
                  f"sliding and full layers' keys and values, so at least one block of {period} must own its own")
    wide = text.bool("use_double_wide_mlp", False)
    if not text.raw("hidden_size_per_layer_input"):
        text.fail(f"num_kv_shared_layers={shared} without per-layer inputs (hidden_size_per_layer_input=0): not a "
                  f"Gemma 4 release's form (E2B / E4B have both)")
    ple = text.int("hidden_size_per_layer_input")
    dims["ple"], dims["ple_all"] = ple, ple * layers
    dims["ple_vocab"] = text.int("vocab_size_per_layer_input", 262144)
    dims["wide_mlp"] = 2 * dims["mlp"]
    dims["global_kv_heads"] = dims["kv_heads"]
    return {"small_period": period, "first_shared": first_shared if shared else layers, "wide_mlp": wide,
            "maxtext_model": PERIODS[period]}


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    if scan:
        raise UnscannedOnly("Gemma 4 E2B / E4B (per-layer inputs, shared KV layers) run unscanned only in MaxText's "
                            "gemma4_small decoder; convert without --scan-layers")
    period, first_shared = spec.value("small_period"), spec.value("first_shared")

    def kind(i: int) -> str:
        attention = "global" if i % period == period - 1 else "local"
        if i < first_shared:
            return f"{attention}_ple"
        return f"{attention}_ple_{'wide' if spec.value('wide_mlp') else 'shared'}"

    return tuple(LayerStack(("decoder", f"layers_{i}"), (i,), False, kind=kind(i)) for i in range(spec.num_layers))


def synthetic_fields(layers: int, period: int, shared: int, ple: int, wide: bool, vocab: int) -> dict:
    """``text_config`` fields of a small model (the synthetic config's ``config_overrides``)."""
    return {"attention_k_eq_v": False, "num_global_key_value_heads": None, "hidden_size_per_layer_input": ple,
            "vocab_size_per_layer_input": vocab, "num_kv_shared_layers": shared, "use_double_wide_mlp": wide,
            "layer_types": [FULL if i % period == period - 1 else SLIDING for i in range(layers)]}
