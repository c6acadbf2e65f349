"""A LoRA adapter of a family, derived from the family's own rules (never restated per family).

PEFT stores, per targeted projection ``W`` (HF ``(out, in)``), ``lora_A`` ``(r, in)`` and ``lora_B``
``(out, r)`` under the base name with ``base_model.model.`` in front. MaxText 0.2.5's converter
(``to_maxtext.py``: ``convert_lora_to_maxtext_adapter``, ``_process_and_stack_weights``) writes them
beside the base leaf's path as ``kernel_lora_a`` ``(in, r)`` and ``kernel_lora_b`` ``(r, out)``:
transposed, *flat* (heads are not split out), scanned layers stacked on axis 1, each under a
``value`` key. The out axis of ``lora_B`` is the base kernel's out axis, so the base rule's value
steps on it (Llama 3.1's RoPE order and query scaling, Mistral's query scaling) apply to ``lora_B``
head by head; steps on the in axis (the attention output's head split) and reshapes do not.

A rule is a LoRA target when it is a per-layer 2-D ``*.weight`` read through a transpose, one HF
tensor to one leaf: the linear projections. Its PEFT module name is the name's last component
before ``.weight`` (``q_proj``), as PEFT's ``target_modules`` names it.
"""

from __future__ import annotations

import dataclasses

from ckptconv.families.base import Family, Output, Rule, multimodal
from ckptconv.families.transforms import TRANSPOSE, PerHead, RopeInterleave, Scale, Split, Step

ADAPTER_PREFIX = "base_model.model."  # PEFT's PeftModel.base_model (LoraModel).model
A, B = "lora_A", "lora_B"  # PEFT's names
LEAF_A, LEAF_B = "kernel_lora_a", "kernel_lora_b"  # MaxText's
VALUE = "value"  # MaxText's converter stores each adapter leaf as {"value": array}
RANK = "lora_rank"  # the spec dimension the adapter's rank is known by
VALUE_STEPS = (RopeInterleave, Scale)  # steps that change values along the out axis, head by head


@dataclasses.dataclass(frozen=True)
class Target:
    """One LoRA-able projection of a family: its rule and PEFT module name."""

    module: str
    rule: Rule

    @property
    def base_name(self) -> str:
        return self.rule.hf

    def adapter_name(self, which: str) -> str:
        """``model.layers.{layer}.self_attn.q_proj.lora_A.weight`` (without PEFT's prefix, as aliases read it)."""
        return self.rule.hf.removesuffix(".weight") + f".{which}.weight"


def targets(family: Family) -> dict[str, tuple[Target, ...]]:
    """Module name -> the projections it names (one, or one per layer kind) in ``family``."""
    found: dict[str, list[Target]] = {}
    for r in family.rules:
        if not _is_projection(r):
            continue
        module = r.hf.removesuffix(".weight").rsplit(".", 1)[-1]
        found.setdefault(module, []).append(Target(module, r))
    return {module: tuple(rows) for module, rows in found.items()}


def _is_projection(r: Rule) -> bool:
    """A decoder's linear projection; an encoder's (``--multimodal`` only) never is: adapters convert for the text
    decoder alone, and a tower's module names (Gemma 4's ``linear``) must not stand for the decoder's."""
    return (r.per_layer and not r.per_expert and r.when is not multimodal and r.hf.endswith(".weight") and len(r.hf_shape) == 2
            and len(r.outputs) == 1 and r.outputs[0].steps[:1] == (TRANSPOSE,)
            and all(isinstance(s, (Split, *VALUE_STEPS)) for s in r.outputs[0].steps[1:]))


def b_steps(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """``lora_B``'s steps from the base kernel's: the transpose, then its value steps on the out axis,
    head by head (they follow the split of the out axis into heads; nothing else of the chain applies).
    Scaling is in float64, as MaxText's ``_process_and_stack_weights`` does it (``w * (1.0 / np.sqrt(head_dim))``
    with ``np.sqrt`` a float64)."""
    rest = steps[1:]
    split = next((i for i, s in enumerate(rest) if isinstance(s, Split) and s.axis == -1), None)
    values = tuple(dataclasses.replace(s, wide=True) if isinstance(s, Scale) else s
                   for s in rest[split + 1:] if isinstance(s, VALUE_STEPS)) if split is not None else ()
    return (TRANSPOSE, PerHead("per_head", values)) if values else (TRANSPOSE,)


def adapter_rules(chosen: tuple[Target, ...]) -> tuple[Rule, ...]:
    """Two rules per targeted projection: ``lora_A`` (r, in) and ``lora_B`` (out, r) to MaxText's leaves."""
    rows = []
    for t in chosen:
        out, into = t.rule.hf_shape
        output = t.rule.outputs[0]
        head = output.path[:-1]
        rows.append(Rule(t.adapter_name(A), (RANK, into), (Output((*head, LEAF_A, VALUE), (TRANSPOSE,)),),
                         t.rule.when, t.rule.kinds))
        rows.append(Rule(t.adapter_name(B), (out, RANK), (Output((*head, LEAF_B, VALUE), b_steps(output.steps)),),
                         t.rule.when, t.rule.kinds))
    return tuple(rows)


TEXT_LAYERS = "model.layers."  # a multimodal model's decoder, loaded alone (AutoModelForCausalLM) and trained so


def _text_model_aliases(chosen: tuple[Target, ...]) -> tuple[tuple[str, str], ...]:
    """A family whose rules name the decoder under another prefix (Qwen3.5's ``model.language_model.layers.``):
    an adapter trained on its text model alone names it ``model.layers.``; both are read."""
    prefixes = {t.rule.hf[: t.rule.hf.index("layers.")] for t in chosen if "layers." in t.rule.hf}
    return tuple((ADAPTER_PREFIX + TEXT_LAYERS, prefix + "layers.") for prefix in sorted(prefixes)
                 if prefix + "layers." != TEXT_LAYERS)


def adapter_family(family: Family, chosen: tuple[Target, ...]) -> Family:
    """The family whose rules read an adapter of ``family``: the base's layout, PEFT's names."""
    aliases = tuple((ADAPTER_PREFIX + stored, canonical) for stored, canonical in family.aliases)
    aliases += _text_model_aliases(chosen)

    def not_converted(spec) -> tuple[tuple[str, str], ...]:
        """What the base does not convert (a vision tower), its adapter tensors too: reported, not written."""
        return tuple((ADAPTER_PREFIX + prefix, f"{what} (LoRA)") for prefix, what in family.not_converted(spec))

    return dataclasses.replace(family, name=f"{family.name} LoRA adapter", rules=adapter_rules(chosen),
                               aliases=(*aliases, (ADAPTER_PREFIX, "")), joins=(), not_converted=not_converted)
