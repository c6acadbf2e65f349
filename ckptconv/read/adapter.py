"""A PEFT LoRA adapter directory: ``adapter_config.json`` read into what MaxText's layout can hold.

MaxText 0.2.5's converter (``to_maxtext`` with ``hf_lora_adapter_path``) keeps one rank and one alpha
for the whole adapter and plain ``W + (alpha / r) B A``. Whatever PEFT can express beyond that
(rsLoRA's ``alpha / sqrt(r)``, DoRA's magnitudes, per-module ranks or alphas, LoRA biases, extra
trained modules, a subset of layers) would be silently dropped there; here it is refused with one
line naming the field, before anything is read or written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptconv.errors import BadInputError
from ckptconv.read.sources import Source
from ckptconv.read.spec import load_config

CONFIG_FILE = "adapter_config.json"
PICKLES = (".bin", ".pt", ".pth", ".ckpt")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head

# Fields whose non-default value changes what the adapter computes, and what MaxText's layout lacks for it.
# (field, the values it may take, why another value is refused)
REFUSED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("use_rslora", (False, None), "rsLoRA scales by alpha/sqrt(r); MaxText's LoRA scales by alpha/r"),
    ("use_dora", (False, None), "DoRA's magnitude vectors have no place in MaxText's LoRA layout"),
    ("rank_pattern", ({}, None), "per-module ranks: MaxText's LoRA has one rank"),
    ("alpha_pattern", ({}, None), "per-module alphas: MaxText's LoRA has one alpha"),
    ("bias", ("none", None), "LoRA biases have no place in MaxText's LoRA layout"),
    ("lora_bias", (False, None), "LoRA biases have no place in MaxText's LoRA layout"),
    ("modules_to_save", (None, []), "fully trained extra modules are not LoRA; merge them into the base first"),
    ("layers_to_transform", (None, []), "an adapter on some layers only: MaxText's layout has every layer"),
    ("layer_replication", (None, []), "replicated layers change the base model's layer count"),
    ("fan_in_fan_out", (False, None), "Conv1D-style (fan_in, fan_out) weights are not a family ckptconv converts"),
    ("use_qalora", (False, None), "QA-LoRA pools the input; MaxText's LoRA does not"),
    ("target_parameters", (None, []), "LoRA on raw parameters (MoE experts) is not in MaxText's adapter layout"),
    ("trainable_token_indices", (None, {}, []), "trained token rows are not LoRA"),
    ("use_bdlora", (None, False), "block-diagonal LoRA is not MaxText's LoRA"),
)


@dataclass(frozen=True)
class AdapterConfig:
    """What MaxText's LoRA keeps of a PEFT adapter: one rank, one alpha, the modules it targets."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # module names (``q_proj``) or ``all-linear``
    base_model: str | None  # ``base_model_name_or_path``, for messages only

    @property
    def scaling(self) -> float:
        """PEFT's (and MaxText's) ``alpha / r``."""
        return self.alpha / self.rank


def read_adapter_config(source: Source) -> AdapterConfig:
    """``adapter_config.json`` of ``source``, checked; refuses what MaxText's LoRA cannot represent."""
    where = f"{source.uri}/{CONFIG_FILE}"
    if not source.exists(CONFIG_FILE):
        raise BadInputError(f"{where}: missing (a PEFT adapter directory holds adapter_config.json and "
                            "adapter_model.safetensors)")
    check_weights_file(source)
    text = bytes(source.read_range(CONFIG_FILE, 0, source.size(CONFIG_FILE))).decode("utf-8", "replace")
    config = load_config(text, where)
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise BadInputError(f"{where}: peft_type {peft_type!r}; only LORA adapters convert to MaxText's layout")
    for name, allowed, why in REFUSED:
        if name in config and config[name] not in allowed:
            raise BadInputError(f"{where}: {name}={config[name]!r} is refused: {why}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BadInputError(f"{where}: r={rank!r}, expected a positive integer")
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise BadInputError(f"{where}: lora_alpha={alpha!r}, expected a positive number")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise BadInputError(f"{where}: target_modules={targets!r} is a regular expression; list the module names "
                            f"(q_proj, ...) or use {ALL_LINEAR!r}")
    targets = (targets,) if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise BadInputError(f"{where}: target_modules={targets!r}, expected a non-empty list of module names")
    base = config.get("base_model_name_or_path")
    return AdapterConfig(rank, float(alpha), tuple(sorted(set(targets))), base if isinstance(base, str) else None)


def check_weights_file(source: Source) -> None:
    """Adapters are read from safetensors only: a pickled ``adapter_model.bin`` is refused, never loaded."""
    names = source.list_names()
    if any(n.endswith(".safetensors") for n in names):
        return
    pickled = sorted(n for n in names if n.endswith(PICKLES))
    if pickled:
        raise BadInputError(f"{source.uri}/{pickled[0]}: a pickled adapter; ckptconv never unpickles. Save it with "
                            "safetensors (PEFT's save_pretrained(..., safe_serialization=True))")
    raise BadInputError(f"{source.uri}: no adapter_model.safetensors found")
