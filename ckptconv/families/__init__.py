"""What each family's tensors become: the family registry (one entry per family module, looked up by
``config.json``'s ``model_type``), and the transforms, inputs, tiles and sharding that carry it out.

Adding a family is one small module defining ``FAMILY`` (with its ``synthetic`` config and examples) plus a
line here: the tests are derived from this registry, and ``tests/test_families.py`` checks that every
registered family brings what they need.
"""

from __future__ import annotations

from ckptconv.errors import BadInputError
from ckptconv.families import (
    deepseek, deepseek_v4, gemma2, gemma3, gemma4, gpt_oss, kimi_k25, llama, llama4, mistral, mixtral, olmo3, qwen2,
    qwen3, qwen3_5_moe, qwen3_moe, qwen3_next, qwen3_omni_moe, qwen3_vl, qwen3_vl_moe,
)
from ckptconv.families.base import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, gemma2.FAMILY,
    gemma3.FAMILY, gemma4.FAMILY, deepseek.FAMILY, deepseek_v4.FAMILY, gpt_oss.FAMILY, olmo3.FAMILY, qwen3_next.FAMILY,
    qwen3_5_moe.FAMILY, kimi_k25.FAMILY, llama4.FAMILY, qwen3_vl.FAMILY, qwen3_vl_moe.FAMILY, qwen3_omni_moe.FAMILY,
)

BY_MODEL_TYPE: dict[str, Family] = {mt: family for family in FAMILIES for mt in family.model_types}


def family_for(model_type: object, where: str) -> Family:
    """The family for a ``model_type``, or a clear error listing what is supported."""
    family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise BadInputError(
            f"{where}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(BY_MODEL_TYPE))})"
        )
    return family
