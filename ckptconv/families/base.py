"""The vocabulary model families are written in: a :class:`Rule` per tensor, a :class:`Family` per model type.

A rule says which HF tensor feeds which MaxText leaf, the HF shape it must have (in named
dimensions taken from the config) and the transform steps. Layer rules are written once;
the planner derives both the scanned (stacked on axis 1) and unscanned (``layers_{i}``)
layouts from them, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ckptconv.spec import ConfigReader, ModelSpec
from ckptconv.transforms import Step

LAYER = "{layer}"


def always(spec: ModelSpec) -> bool:
    return True


def untied(spec: ModelSpec) -> bool:
    return not spec.tie_word_embeddings


@dataclass(frozen=True)
class Rule:
    """HF tensor ``hf`` (with ``{layer}`` for per-layer tensors) -> MaxText leaf ``maxtext``.

    ``hf_shape`` names dimensions (see :func:`dimensions`); ``maxtext`` is the path below
    ``decoder/layers`` for layer rules and below ``params/params`` for global ones.
    """

    hf: str
    maxtext: tuple[str, ...]
    hf_shape: tuple[str, ...]
    steps: tuple[Step, ...] = ()
    when: Callable[[ModelSpec], bool] = always

    @property
    def per_layer(self) -> bool:
        return LAYER in self.hf


def dimensions(spec: ModelSpec) -> dict[str, int]:
    """Named dimensions the rules' ``hf_shape`` refer to."""
    return {
        "vocab": spec.vocab_size,
        "emb": spec.hidden_size,
        "mlp": spec.intermediate_size,
        "hd": spec.head_dim,
        "q": spec.num_heads * spec.head_dim,
        "kv": spec.num_kv_heads * spec.head_dim,
    }


@dataclass(frozen=True)
class Family:
    """One model family: how its config reads and how its tensors map."""

    name: str
    model_types: tuple[str, ...]
    decoder_block: str  # MaxText's ``decoder_block`` for this family (for the report and README)
    rules: tuple[Rule, ...]
    read_spec: Callable[[ConfigReader], ModelSpec]
    extra_config_fields: frozenset[str] = frozenset()
    ignored_hf_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def active_rules(self, spec: ModelSpec) -> tuple[Rule, ...]:
        return tuple(rule for rule in self.rules if rule.when(spec))
