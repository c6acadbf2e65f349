"""Rows and config fields shared by sparse mixture-of-experts decoders (Qwen3-MoE, Mixtral).

MaxText stacks the experts of a layer on a leading axis: ``wi_0`` is ``(experts, emb, mlp)``
per layer, and ``(experts, layers, emb, mlp)`` scanned; the router kernel is ``(emb, experts)``.
The HF checkpoints keep one tensor per expert (``...experts.{expert}...``).
"""

from __future__ import annotations

from ckptconv.families.base import Rule, rule
from ckptconv.families.decoder import KERNEL, L
from ckptconv.read.spec import ConfigReader


def moe_rows(block: str, router: str, experts: str, names: tuple[str, str, str]) -> tuple[Rule, ...]:
    """Router and expert rows: ``block`` is MaxText's module name, ``router``/``experts`` the HF
    module paths below the layer, ``names`` HF's (gate, up, down) projections."""
    gate, up, down = names
    return (
        rule(L + f"{router}.weight", (block, "gate", "kernel"), ("experts", "emb"), KERNEL),
        rule(L + f"{experts}.{{expert}}.{gate}.weight", (block, "wi_0"), ("moe_mlp", "emb"), KERNEL),
        rule(L + f"{experts}.{{expert}}.{up}.weight", (block, "wi_1"), ("moe_mlp", "emb"), KERNEL),
        rule(L + f"{experts}.{{expert}}.{down}.weight", (block, "wo"), ("emb", "moe_mlp"), KERNEL),
    )


def read_experts(cfg: ConfigReader, count_fields: tuple[str, ...]) -> int:
    """The expert count, under whichever name this config uses for it (hub vs transformers 5).

    Both spellings may be present (transformers 5 maps one onto the other); they must agree.
    """
    counts = {name: cfg.int(name) for name in count_fields if cfg.has(name)}
    cfg.read.update(count_fields)
    if not counts:
        cfg.fail(f"required field {count_fields[0]!r} is missing")
    if len(set(counts.values())) > 1:
        cfg.fail(f"expert counts disagree: {counts}")
    return next(iter(counts.values()))
