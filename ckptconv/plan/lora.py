"""Plan a LoRA conversion: the adapter alone in MaxText's layout, or folded into the base.

Both are ordinary conversion plans, so they are checked, streamed, sharded, written and committed
like any other:

- **adapter** (``convert BASE DST --lora ADAPTER``): the base's ``config.json`` and family decide the
  layout; the jobs read the adapter's tensors through rules derived from the family's
  (:mod:`ckptconv.families.lora`). The base's weights are not read.
- **merged** (``--lora ADAPTER --merge-lora``): the base's plan, where each targeted projection's
  pieces read ``W + (alpha / r) B A`` (:class:`~ckptconv.families.inputs.LoraMerged`), region by
  region, so the base still streams in bounded memory.

Every adapter tensor's shape is checked against the base's ``config.json`` before anything is read:
an adapter of another model is one line, exit 2.
"""

from __future__ import annotations

import dataclasses

from ckptconv import dtypes, settings
from ckptconv.errors import BadInputError
from ckptconv.families import family_for
from ckptconv.families.base import Family
from ckptconv.families.inputs import LoraMerged, Plain
from ckptconv.families.lora import RANK, Target, adapter_family, targets
from ckptconv.plan.conversion import (
    ConversionPlan, _check_devices_shard_something, _check_extra, _check_shapes_and_dtypes, _resolve, _sort_tensors,
    expected_tensors, layout_jobs, make_plan, read_config, read_spec,
)
from ckptconv.read.adapter import ALL_LINEAR, CONFIG_FILE, AdapterConfig, read_adapter_config
from ckptconv.read.safetensors_io import TensorInfo, index_checkpoint
from ckptconv.read.sources import Source
from ckptconv.read.spec import ModelSpec, load_config


def choose_targets(family: Family, config: AdapterConfig, where: str) -> tuple[Target, ...]:
    """The family's projections ``target_modules`` names (PEFT matches a name or a dotted suffix of one)."""
    available = targets(family)
    every = tuple(t for rows in available.values() for t in rows)
    if ALL_LINEAR in config.targets:
        return every
    chosen: list[Target] = []
    for name in config.targets:
        hit = tuple(t for t in every if t.base_name.removesuffix(".weight").endswith("." + name))
        if not hit:
            raise BadInputError(f"{where}: target module {name!r} is not a projection MaxText's LoRA layout holds for "
                                f"family {family.name} (it has: {', '.join(sorted(available))})")
        chosen.extend(t for t in hit if t not in chosen)
    return tuple(t for t in every if t in chosen)  # the family's order, whatever the config's


def _check_base_class(adapter: Source, adapter_config: dict, config: dict, base_where: str) -> None:
    """PEFT records the class the adapter was trained on; a base of another architecture is refused."""
    mapping = adapter_config.get("auto_mapping")
    trained_on = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    architectures = config.get("architectures") or []
    if isinstance(trained_on, str) and architectures and trained_on not in architectures:
        raise BadInputError(f"{adapter.uri}/{CONFIG_FILE}: the adapter was trained on {trained_on}, but {base_where} "
                            f"is {', '.join(map(str, architectures))}")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """An adapter resolved against its base: config, derived family, spec, and its tensors by layer rule."""

    source: Source
    config: AdapterConfig
    config_text: str
    family: Family
    spec: ModelSpec
    tensors: dict[str, TensorInfo]  # canonical name (``model.layers.0.self_attn.q_proj.lora_A.weight``) -> stored

    def identity(self) -> dict:
        """What a rerun's fingerprint must see of the adapter."""
        return {"provenance": self.source.provenance(), "config": self.config_text, "rank": self.config.rank,
                "alpha": self.config.alpha, "targets": list(self.config.targets),
                "tensors": sorted((t.name, t.file, t.dtype.str, t.shape, t.offset) for t in self.tensors.values())}


def open_adapter(base: Source, adapter: Source, scan_layers: bool) -> tuple[Adapter, str, Family]:
    """Read and check the adapter against ``base``: every tensor its targets need is there, with the shape
    the base's ``config.json`` implies, and nothing else is."""
    config_text, config = read_config(base)
    where = f"{base.uri}/config.json"
    family = family_for(config.get("model_type"), where)
    adapter_config = read_adapter_config(adapter)
    adapter_text = bytes(adapter.read_range(CONFIG_FILE, 0, adapter.size(CONFIG_FILE))).decode("utf-8", "replace")
    _check_base_class(adapter, load_config(adapter_text, f"{adapter.uri}/{CONFIG_FILE}"), config, where)
    chosen = choose_targets(family, adapter_config, f"{adapter.uri}/{CONFIG_FILE}")
    spec = read_spec(family, config, where)
    spec = dataclasses.replace(spec, dims={**spec.dims, RANK: adapter_config.rank})
    lora_family = adapter_family(family, chosen)
    stored = index_checkpoint(adapter)
    tensors, _ = _sort_tensors(adapter, lora_family, spec, stored)
    stacks = family.layout(spec, scan_layers)
    expected = expected_tensors(lora_family.active_rules(spec), stacks, spec)
    inputs, consumed = _resolve(adapter, expected, tensors, None, lora_family, spec)
    _check_extra(adapter, lora_family, tensors, consumed)
    _check_shapes_and_dtypes(expected, inputs, None)
    return Adapter(adapter, adapter_config, adapter_text, lora_family, spec, tensors), config_text, family


def make_adapter_plan(base: Source, adapter: Source, *, dtype: str = settings.DTYPE,
                      scan_layers: bool = settings.SCAN_LAYERS, devices: int = settings.DEVICES) -> ConversionPlan:
    """The adapter alone, laid out as MaxText 0.2.5's ``to_maxtext`` writes it (adapter mode)."""
    _check_options(dtype, devices)
    found, config_text, _ = open_adapter(base, adapter, scan_layers)
    spec, family = found.spec, found.family
    stacks = family.layout(spec, scan_layers)
    inputs = {name: Plain(found.tensors[name]) for name in expected_tensors(family.active_rules(spec), stacks, spec)}
    jobs = layout_jobs(family, spec, stacks, inputs, dtypes.OUTPUT[dtype], devices)
    _check_devices_shard_something(jobs, devices)
    return ConversionPlan(adapter.uri, family, spec, dtypes.OUTPUT[dtype], scan_layers, devices, jobs,
                          found.tensors, config_text, (), adapter=found.identity())


def make_merged_plan(base: Source, adapter: Source, *, dtype: str = settings.DTYPE,
                     scan_layers: bool = settings.SCAN_LAYERS, devices: int = settings.DEVICES) -> ConversionPlan:
    """The base's plan with the adapter folded into every targeted projection (MaxText's merged mode)."""
    plan = make_plan(base, dtype=dtype, scan_layers=scan_layers, devices=devices)
    found, _, _ = open_adapter(base, adapter, scan_layers)
    out_dtype = dtypes.OUTPUT[dtype]
    scaling = found.config.scaling
    merged_rules = {r.hf for r in plan.family.rules} & {_base_rule(r.hf) for r in found.family.rules}

    def merged(piece, name: str):
        stem = name.removesuffix(".weight")
        a, b = found.tensors[stem + ".lora_A.weight"], found.tensors[stem + ".lora_B.weight"]
        return LoraMerged(piece, a, b, adapter, scaling, out_dtype)

    jobs = []
    for job in plan.jobs:
        if job.rule.hf not in merged_rules:
            jobs.append(job)
            continue
        pieces = tuple(merged(piece, plan.family.canonical(piece.name)) for piece in job.pieces)
        jobs.append(dataclasses.replace(job, pieces=pieces))
    return dataclasses.replace(plan, jobs=tuple(jobs), adapter=found.identity())


def _base_rule(adapter_rule: str) -> str:
    """``...q_proj.lora_A.weight`` -> ``...q_proj.weight``."""
    return adapter_rule.replace(".lora_A.weight", ".weight").replace(".lora_B.weight", ".weight")


def _check_options(dtype: str, devices: int) -> None:
    if dtype not in dtypes.OUTPUT:
        raise BadInputError(f"--dtype {dtype!r} is not supported (supported: {', '.join(dtypes.OUTPUT)})")
    if devices < 1:
        raise BadInputError(f"--devices must be >= 1, got {devices}")
