"""``config.json`` -> :class:`ModelSpec`, field by field, each family reading its own fields.

The architecture comes from the checkpoint itself, never from a table of known model names,
so any size of a supported family converts. A family's ``read_spec`` reads every field it
understands through a :class:`ConfigReader`; whatever it did not read, and is not plain
bookkeeping, is an error that names the field: a field we have never seen may mean new
semantics, and converting silently wrong is the worst outcome.

Three kinds of fields exist:
- *dims*: the named sizes the family's rules use for shapes (``emb``, ``heads``, ``experts``...);
- *values*: settings that change how weights are transformed (query scale, RoPE layout,
  MaxText's vocabulary size), also read by transform steps;
- *runtime*: inference settings that do not change a weight (RoPE theta, sliding window,
  soft caps, epsilon): accepted, reported, and needed when configuring MaxText.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn

from ckptconv.errors import BadInputError
from ckptconv.read.strict_json import JsonError, loads

# Fields that never change weights nor how a model runs: bookkeeping, tokens, training knobs.
BOOKKEEPING_FIELDS = frozenset(
    {
        "_name_or_path", "architectures", "attention_dropout", "bos_token_id", "chunk_size_feed_forward",
        "dtype", "eos_token_id", "id2label", "initializer_range", "is_encoder_decoder", "label2id",
        "model_type", "output_attentions", "output_hidden_states", "pad_token_id", "problem_type",
        "return_dict", "tokenizer_class", "torch_dtype", "transformers_version", "use_cache",
        "generation_config", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
        "auto_map",
    }
)
# transformers' PretrainedConfig writes its generic settings into every config it saves (a nested ``text_config``
# saved by an older transformers, or printed by a newer one, holds them all: Kimi-K2.5's). Generation defaults,
# naming and framework switches change no weight.
BOOKKEEPING_FIELDS |= frozenset(
    {
        "torchscript", "use_bfloat16", "tf_legacy_loss", "finetuning_task", "prefix", "sep_token_id",
        "decoder_start_token_id", "task_specific_params", "max_length", "min_length", "do_sample", "early_stopping",
        "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
        "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
        "begin_suppress_tokens",
    }
)
# The generic settings that would change the weights (cross-attention layers, pruned heads, a tied encoder) are
# accepted only at the inert value transformers writes by default; any other value is refused by name.
INERT_DEFAULTS: dict[str, tuple] = {
    "add_cross_attention": (False,), "cross_attention_hidden_size": (None,), "tie_encoder_decoder": (False,),
    "pruned_heads": ({},), "is_decoder": (False,),
}
# No size or count in a checkpoint exceeds what a 64-bit signed index can address.
MAX_INT = 2**63 - 1


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model that decides its MaxText layout, read from ``config.json``."""

    family: str
    model_type: str
    num_layers: int
    dims: dict[str, int]
    values: dict[str, Any] = field(default_factory=dict)
    runtime: dict[str, Any] = field(default_factory=dict)

    def dim(self, name: str) -> int:
        return self.dims[name]

    def value(self, name: str) -> Any:
        return self.values[name]

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "model_type": self.model_type, "num_layers": self.num_layers,
                "dims": dict(self.dims), "values": dict(self.values), "runtime": dict(self.runtime)}


def load_config(text: str, where: str) -> dict[str, Any]:
    """Parse config.json text, naming the file on error; every value is finite and strict JSON."""
    try:
        config = loads(text)  # strict: NaN, Infinity, out-of-range numbers and deep nesting refused
    except JsonError as err:
        raise BadInputError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise BadInputError(f"{where}: expected a JSON object")
    return config


def _short(value: Any) -> str:
    """A value for a one-line message: a 300-digit number or a huge list is cut."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


class ConfigReader:
    """Typed, named access to config.json fields; remembers what was read.

    Every error names the file and the field. :meth:`runtime` accepts a field that does not
    change weights and records it for the report; :meth:`unread` lists what nobody read.
    """

    def __init__(self, config: dict[str, Any], where: str, name: str = "") -> None:
        self.config = config
        self.where = where
        self.name = name  # the field this reader reads, for a nested object (``text_config``)
        self.read: set[str] = set()
        self.runtime_values: dict[str, Any] = {}
        self.children: list[ConfigReader] = []
        self._rope: tuple[float, str, dict[str, Any]] | None = None
        self.model_type = config.get("model_type")  # for messages (a nested object has its root's)

    def _get(self, name: str, default: Any) -> Any:
        self.read.add(name)
        value = self.config.get(name, default)
        return default if value is None else value

    def count(self, name: str, default: int) -> int:
        """A non-negative integer field (a number of layers that may be 0)."""
        value = self._get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
            raise BadInputError(f"{self.where}: field {name!r} must be an integer >= 0 (and < 2**63), got {_short(value)}")
        return value

    def raw(self, name: str) -> Any:
        """A field's value as stored (None if absent), for checks no typed getter expresses."""
        return self._get(name, None)

    def has(self, name: str) -> bool:
        return self.config.get(name) is not None

    def int(self, name: str, default: int | None = None) -> int:
        value = self._get(name, default)
        if value is None:
            raise BadInputError(f"{self.where}: required field {name!r} is missing")
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_INT:
            raise BadInputError(f"{self.where}: field {name!r} must be an integer >= 1 (and < 2**63), got {_short(value)}")
        return value

    def bool(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise BadInputError(f"{self.where}: field {name!r} must be true or false, got {value!r}")
        return value

    def require(self, name: str, allowed: tuple[Any, ...], default: Any) -> Any:
        """A field whose value changes the weights or layout: only ``allowed`` values are supported."""
        value = self._get(name, default)
        if value not in allowed:
            raise BadInputError(
                f"{self.where}: field {name!r} = {value!r} is not supported (supported: {list(allowed)})"
            )
        return value

    def object(self, name: str) -> dict[str, Any]:
        value = self._get(name, {})
        if not isinstance(value, dict):
            raise BadInputError(f"{self.where}: field {name!r} must be an object, got {type(value).__name__}")
        return value

    def nested(self, name: str) -> "ConfigReader":
        """A reader for an object-valued field (e.g. Gemma 3's ``text_config``), errors naming it."""
        child = ConfigReader(self.object(name), f"{self.where}: {name}", name)
        child.model_type = self.model_type
        self.children.append(child)
        return child

    def runtime(self, *names: str) -> None:
        """Accept fields that do not change any weight; their values go to the report."""
        for name in names:
            self.read.add(name)
            if name in self.config:
                self.runtime_values[name] = self.config[name]

    def fail(self, message: str) -> NoReturn:
        raise BadInputError(f"{self.where}: {message}")

    def unread(self) -> list[str]:
        """Fields nobody read; transformers' generic settings at their inert defaults are read here."""
        for name in sorted(set(self.config) & INERT_DEFAULTS.keys() - self.read):
            self.require(name, INERT_DEFAULTS[name], INERT_DEFAULTS[name][0])
        return sorted(set(self.config) - self.read - BOOKKEEPING_FIELDS)

    def check_all_read(self) -> None:
        """Refuse any field the family did not read: it might change the weights' meaning."""
        for child in self.children:
            child.check_all_read()
        unknown = self.unread()
        if unknown:
            raise BadInputError(
                f"{self.where}: unknown field(s) {', '.join(map(repr, unknown))} for model_type "
                f"{self.model_type!r}; ckptconv does not know whether they change the weights"
            )

    def rope(self) -> tuple[float, str, dict[str, Any]]:
        """RoPE theta, type and scaling, from ``rope_parameters`` (transformers 5) or the older fields.

        RoPE is applied at run time; only its *type* can change a weight layout (Llama 3.1+).
        All RoPE fields are recorded as runtime settings.
        """
        if self._rope is not None:
            return self._rope
        self.runtime("rope_parameters", "rope_scaling", "rope_theta")
        params = self.config.get("rope_parameters") or {}
        scaling = self.config.get("rope_scaling") or {}
        if not isinstance(params, dict) or not isinstance(scaling, dict):
            raise BadInputError(f"{self.where}: rope_parameters / rope_scaling must be objects")
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", self.config.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not isinstance(rope_type, str):
            raise BadInputError(f"{self.where}: invalid rope settings {merged!r}")
        self._rope = (float(theta), rope_type, {k: v for k, v in merged.items() if k != "rope_theta"})
        return self._rope
