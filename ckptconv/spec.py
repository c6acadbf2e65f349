"""``config.json`` -> :class:`ModelSpec`, field by field.

The architecture comes from the checkpoint itself, never from a table of known model
names, so any size of a supported family converts. A field that could change the weights'
meaning must have a value we support; a field we have never seen is an error that names it
(a new field may mean new semantics, and converting silently wrong is the worst outcome).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptconv.errors import BadInputError

# Fields that never change how weights map (bookkeeping, generation and training knobs).
IGNORED_FIELDS = frozenset(
    {
        "_name_or_path", "architectures", "attention_dropout", "bos_token_id", "chunk_size_feed_forward",
        "dtype", "eos_token_id", "id2label", "initializer_range", "is_encoder_decoder", "label2id",
        "model_type", "output_attentions", "output_hidden_states", "pad_token_id", "problem_type",
        "return_dict", "tokenizer_class", "torch_dtype", "transformers_version", "use_cache",
        "max_position_embeddings", "rms_norm_eps", "sliding_window", "use_sliding_window",
        "max_window_layers", "layer_types", "rope_theta", "rope_scaling", "rope_parameters",
        "pretraining_tp", "tie_word_embeddings", "head_dim", "num_key_value_heads", "hidden_act",
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "attention_bias", "mlp_bias", "use_qk_norm", "qkv_bias", "generation_config", "tie_embeddings",
        "attn_logit_softcapping", "final_logit_softcapping",
    }
)


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model that decides its MaxText layout, read from ``config.json``."""

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    interleave_rope: bool  # MaxText rotates pairs for this model: the q/k weights get permuted
    max_position_embeddings: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_config(text: str, where: str) -> dict[str, Any]:
    """Parse config.json text, naming the file on error."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadInputError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise BadInputError(f"{where}: expected a JSON object")
    return config


class ConfigReader:
    """Typed, named access to config.json fields; every error names the file and field."""

    def __init__(self, config: dict[str, Any], where: str, extra_known: frozenset[str] = frozenset()) -> None:
        self.config = config
        self.where = where
        unknown = sorted(set(config) - IGNORED_FIELDS - extra_known)
        if unknown:
            raise BadInputError(
                f"{where}: unknown field(s) {', '.join(map(repr, unknown))} for model_type "
                f"{config.get('model_type')!r}; ckptconv does not know whether they change the weights"
            )

    def int(self, name: str, default: int | None = None) -> int:
        value = self.config.get(name, default)
        if value is None and default is None and name not in self.config:
            raise BadInputError(f"{self.where}: required field {name!r} is missing")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BadInputError(f"{self.where}: field {name!r} must be a positive integer, got {value!r}")
        return value

    def optional_int(self, name: str) -> int | None:
        value = self.config.get(name)
        return None if value is None else self.int(name)

    def float(self, name: str, default: float) -> float:
        value = self.config.get(name, default)
        if value is None:
            value = default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise BadInputError(f"{self.where}: field {name!r} must be a number, got {value!r}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.config.get(name, default)
        if not isinstance(value, bool):
            raise BadInputError(f"{self.where}: field {name!r} must be true or false, got {value!r}")
        return value

    def require(self, name: str, allowed: tuple[Any, ...], default: Any) -> Any:
        """A field whose value changes the weights: only ``allowed`` values are supported."""
        value = self.config.get(name, default)
        if value not in allowed:
            raise BadInputError(
                f"{self.where}: field {name!r} = {value!r} is not supported (supported: {list(allowed)})"
            )
        return value

    def rope(self) -> tuple[float, str, dict[str, Any]]:
        """RoPE theta, type and scaling, from ``rope_parameters`` (transformers 5) or the older fields."""
        params = self.config.get("rope_parameters") or {}
        scaling = self.config.get("rope_scaling") or {}
        if not isinstance(params, dict) or not isinstance(scaling, dict):
            raise BadInputError(f"{self.where}: rope_parameters / rope_scaling must be objects")
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", self.config.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        if not isinstance(theta, (int, float)) or not isinstance(rope_type, str):
            raise BadInputError(f"{self.where}: invalid rope settings {merged!r}")
        return float(theta), rope_type, {k: v for k, v in merged.items() if k not in ("rope_theta",)}
