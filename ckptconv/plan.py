"""Plan a conversion from ``config.json`` and the safetensors headers alone.

The plan checks key coverage both ways and every shape before a byte of weights is read or
written, so bad input fails fast with the offending names and ``DST`` is never touched. It
lists every MaxText leaf with the HF tensors that feed it and the steps that transform them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ckptconv.errors import BadInputError
from ckptconv.families import family_for
from ckptconv.families.base import Family, Rule, dimensions
from ckptconv.safetensors_io import TensorInfo, index_checkpoint
from ckptconv.sharding import shard_shape
from ckptconv.sources import Source
from ckptconv.spec import ConfigReader, ModelSpec, load_config
from ckptconv.transforms import TRANSPOSE, Shape, Step, output_shape

OUTPUT_DTYPES: dict[str, np.dtype] = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
FLOAT_SOURCE_DTYPES = {np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)}
PARAMS_ROOT = ("params", "params")
SCAN_AXIS = 1  # MaxText's param_scan_axis: layers stack on axis 1
# Beside the params MaxText's converter saves its TrainState's other fields: step 0, no optimizer.
MAXTEXT_EXTRA_ITEMS = {"step": 0, "opt_state": {}}


@dataclass(frozen=True)
class LeafPlan:
    """One MaxText leaf: its path in the ``items`` tree, shape, dtype and where its data comes from.

    ``stacked`` leaves take one source tensor per layer, placed at index ``i`` of axis 1.
    Otherwise there is one source tensor; ``row_axis`` is the output axis that the source's
    rows land on (0 when copied, 1 when transposed) or None when it must be read whole.
    """

    path: tuple[str, ...]
    shape: Shape
    dtype: np.dtype
    sources: tuple[TensorInfo, ...]
    steps: tuple[Step, ...]
    stacked: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_axis(self) -> int | None:
        if self.stacked:
            return None
        return {(): 0, (TRANSPOSE,): 1}.get(self.steps)

    @property
    def name(self) -> str:
        return "/".join(self.path)


@dataclass(frozen=True)
class ConversionPlan:
    source_uri: str
    family: Family
    spec: ModelSpec
    dtype: np.dtype
    scan_layers: bool
    devices: int
    leaves: tuple[LeafPlan, ...]
    tensors: dict[str, TensorInfo]
    config_text: str

    @property
    def tensor_count(self) -> int:
        return sum(len(leaf.sources) for leaf in self.leaves)

    @property
    def source_bytes(self) -> int:
        return sum(info.nbytes for leaf in self.leaves for info in leaf.sources)

    @property
    def output_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def largest_shard_bytes(self) -> int:
        return max(math.prod(shard_shape(leaf.shape, self.devices)) * leaf.dtype.itemsize for leaf in self.leaves)


def read_config(source: Source) -> tuple[str, dict]:
    where = f"{source.uri}/config.json"
    if not source.exists("config.json"):
        raise BadInputError(f"{where}: missing (ckptconv reads the architecture from config.json)")
    text = bytes(source.read_range("config.json", 0, source.size("config.json"))).decode("utf-8", "replace")
    return text, load_config(text, where)


def make_plan(source: Source, *, dtype: str = "bfloat16", scan_layers: bool = True, devices: int = 16) -> ConversionPlan:
    """Build and check the whole conversion plan; raises :class:`BadInputError` naming what is wrong."""
    if dtype not in OUTPUT_DTYPES:
        raise BadInputError(f"--dtype {dtype!r} is not supported (supported: {', '.join(OUTPUT_DTYPES)})")
    if devices < 1:
        raise BadInputError(f"--devices must be >= 1, got {devices}")
    config_text, config = read_config(source)
    where = f"{source.uri}/config.json"
    family = family_for(config.get("model_type"), where)
    spec = family.read_spec(ConfigReader(config, where, family.extra_config_fields))
    tensors = index_checkpoint(source)
    rules = family.active_rules(spec)
    expected = _expected_tensors(rules, spec)
    _check_coverage(source, family, expected, tensors)
    _check_shapes_and_dtypes(expected, tensors)
    out_dtype = OUTPUT_DTYPES[dtype]
    leaves = tuple(leaf for rule in rules for leaf in _leaves(rule, spec, tensors, out_dtype, scan_layers))
    return ConversionPlan(source.uri, family, spec, out_dtype, scan_layers, devices, leaves, tensors, config_text)


def _hf_names(rule: Rule, spec: ModelSpec) -> list[str]:
    if rule.per_layer:
        return [rule.hf.format(layer=i) for i in range(spec.num_layers)]
    return [rule.hf]


def _expected_tensors(rules: tuple[Rule, ...], spec: ModelSpec) -> dict[str, tuple[Rule, Shape]]:
    dims = dimensions(spec)
    return {name: (rule, tuple(dims[d] for d in rule.hf_shape)) for rule in rules for name in _hf_names(rule, spec)}


def _check_coverage(source: Source, family: Family, expected: dict, tensors: dict[str, TensorInfo]) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        rule = expected[missing[0]][0]
        raise BadInputError(
            f"{source.uri}: missing tensor {missing[0]!r} (needed for MaxText leaf "
            f"{'/'.join(rule.maxtext)}){f' and {len(missing) - 1} more' if len(missing) > 1 else ''}"
        )
    extra = sorted(
        name for name in set(tensors) - set(expected)
        if not name.endswith(family.ignored_hf_suffixes) and not _tied_head(name, expected)
    )
    if extra:
        raise BadInputError(
            f"{source.uri}/{tensors[extra[0]].file}: unexpected tensor {extra[0]!r} for family "
            f"{family.name}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}"
        )


def _tied_head(name: str, expected: dict) -> bool:
    """Tied checkpoints sometimes still store lm_head.weight; MaxText ignores it (logits use the embedding)."""
    return name == "lm_head.weight" and "lm_head.weight" not in expected


def _check_shapes_and_dtypes(expected: dict, tensors: dict[str, TensorInfo]) -> None:
    for name, (_, shape) in expected.items():
        info = tensors[name]
        if info.shape != shape:
            raise BadInputError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, config.json implies {list(shape)}"
            )
        if info.dtype not in FLOAT_SOURCE_DTYPES:
            raise BadInputError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, expected a float dtype")


def _leaves(rule: Rule, spec: ModelSpec, tensors: dict[str, TensorInfo], dtype: np.dtype, scan: bool) -> list[LeafPlan]:
    sources = [tensors[name] for name in _hf_names(rule, spec)]
    per_tensor = output_shape(sources[0].shape, rule.steps, spec)
    if not rule.per_layer:
        return [LeafPlan(PARAMS_ROOT + rule.maxtext, per_tensor, dtype, (sources[0],), rule.steps, False)]
    if scan:
        stacked = (*per_tensor[:SCAN_AXIS], spec.num_layers, *per_tensor[SCAN_AXIS:])
        path = PARAMS_ROOT + ("decoder", "layers") + rule.maxtext
        return [LeafPlan(path, stacked, dtype, tuple(sources), rule.steps, True)]
    return [
        LeafPlan(PARAMS_ROOT + ("decoder", f"layers_{i}") + rule.maxtext, per_tensor, dtype, (info,), rule.steps, False)
        for i, info in enumerate(sources)
    ]


