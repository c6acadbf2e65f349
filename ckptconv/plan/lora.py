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
import math

import numpy as np

from ckptconv import dtypes, settings
from ckptconv.errors import BadInputError
from ckptconv.families import family_for
from ckptconv.families.base import Family, applies
from ckptconv.families.inputs import LoraMerged, Plain
from ckptconv.families.lora import ADAPTER_PREFIX, LEAF_A, LEAF_B, RANK, VALUE, Target, adapter_family, targets
from ckptconv.plan.conversion import (
    PARAMS_ROOT, ConversionPlan, _check_devices_shard_something, _check_extra, _check_shapes_and_dtypes, _resolve,
    _sort_tensors, choose_layout, expected_tensors, layout_jobs, make_plan, read_config, read_spec,
)
from ckptconv.plan.export import PARAM_ROOT, ExportPlan, TensorEntry, _check_leaves
from ckptconv.plan.export import Target as ExportTarget
from ckptconv.read.adapter import ALL_LINEAR, CONFIG_FILE, AdapterConfig, read_adapter_config
from ckptconv.read.safetensors_io import TensorInfo, index_checkpoint
from ckptconv.read.sources import Source
from ckptconv.read.spec import ModelSpec, load_config
from ckptconv.read.stored import StoredLeaf


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
    stems = {_stem(str(a)) for a in architectures}
    if isinstance(trained_on, str) and architectures and _stem(trained_on) not in stems:
        raise BadInputError(f"{adapter.uri}/{CONFIG_FILE}: the adapter was trained on {trained_on}, but {base_where} "
                            f"is {', '.join(map(str, architectures))}")


HEADS = ("ForConditionalGeneration", "ForCausalLM", "Model")  # the same architecture with another head


def _stem(architecture: str) -> str:
    """``Qwen3_5MoeForConditionalGeneration`` and ``Qwen3_5MoeForCausalLM`` (its text model, which PEFT trains
    when the model is loaded with AutoModelForCausalLM) are one architecture; so are transformers' and the hub's
    spellings of one name (``Kimi_K25ForConditionalGeneration``, the release's ``KimiK25ForConditionalGeneration``)."""
    for head in HEADS:
        if architecture.endswith(head):
            return architecture[: -len(head)].lower().replace("_", "")
    return architecture.lower().replace("_", "")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """An adapter resolved against its base: config, derived family, spec, and its tensors by layer rule."""

    source: Source
    config: AdapterConfig
    config_text: str
    family: Family
    spec: ModelSpec
    tensors: dict[str, TensorInfo]  # canonical name (``model.layers.0.self_attn.q_proj.lora_A.weight``) -> stored
    not_converted: tuple[dict, ...]  # what the base does not convert either (a vision tower's LoRA): reported

    def identity(self) -> dict:
        """What a rerun's fingerprint must see of the adapter."""
        return {"provenance": self.source.provenance(), "config": self.config_text, "rank": self.config.rank,
                "alpha": self.config.alpha, "targets": list(self.config.targets),
                "tensors": sorted((t.name, t.file, t.dtype.str, t.shape, t.offset) for t in self.tensors.values())}


def open_adapter(base: Source, adapter: Source, scan_layers: bool | None) -> tuple[Adapter, str, Family]:
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
    tensors, skipped = _sort_tensors(adapter, lora_family, spec, stored)
    stacks, _ = choose_layout(where, family, spec, scan_layers)
    expected = expected_tensors(lora_family.active_rules(spec), stacks, spec)
    inputs, consumed = _resolve(adapter, expected, tensors, None, lora_family, spec)
    _check_extra(adapter, lora_family, tensors, consumed)
    _check_shapes_and_dtypes(expected, inputs, None)
    return Adapter(adapter, adapter_config, adapter_text, lora_family, spec, tensors, skipped), config_text, family


# Where an adapter's tree sits in ``items``: as MaxText's converter writes it (``params/params/decoder/...``), or
# at the root (``decoder/...``), which is what MaxText's ``lora.lora_restore_path`` restores (the paths of the
# model's own LoRA parameters; ``lora_utils.restore_lora_from_path``).
LORA_LAYOUTS = ("converter", "restore")


def make_adapter_plan(base: Source, adapter: Source, *, dtype: str = settings.DTYPE,
                      scan_layers: bool | None = settings.SCAN_LAYERS, devices: int = settings.DEVICES,
                      lora_layout: str = "converter") -> ConversionPlan:
    """The adapter alone, laid out as MaxText 0.2.5's ``to_maxtext`` writes it (adapter mode), or rooted where
    its LoRA training restores from (``lora_layout="restore"``)."""
    if lora_layout not in LORA_LAYOUTS:
        raise BadInputError(f"--lora-layout {lora_layout!r}: expected one of {', '.join(LORA_LAYOUTS)}")
    _check_options(dtype, devices)
    found, config_text, _ = open_adapter(base, adapter, scan_layers)
    spec, family = found.spec, found.family
    stacks, scan_layers = choose_layout(f"{base.uri}/config.json", family, spec, scan_layers)
    inputs = {name: Plain(found.tensors[name]) for name in expected_tensors(family.active_rules(spec), stacks, spec)}
    jobs = layout_jobs(family, spec, stacks, inputs, dtypes.OUTPUT[dtype], devices)
    _check_devices_shard_something(jobs, devices)
    if lora_layout == "restore":
        jobs = tuple(dataclasses.replace(job, leaves=tuple(dataclasses.replace(leaf, path=leaf.path[len(PARAMS_ROOT):])
                                                           for leaf in job.leaves)) for job in jobs)
    return ConversionPlan(adapter.uri, family, spec, dtypes.OUTPUT[dtype], scan_layers, devices, jobs,
                          found.tensors, config_text, found.not_converted, adapter=found.identity())


def make_merged_plan(base: Source, adapter: Source, *, dtype: str = settings.DTYPE,
                     scan_layers: bool | None = settings.SCAN_LAYERS, devices: int = settings.DEVICES) -> ConversionPlan:
    """The base's plan with the adapter folded into every targeted projection (MaxText's merged mode)."""
    plan = make_plan(base, dtype=dtype, scan_layers=scan_layers, devices=devices)
    found, _, _ = open_adapter(base, adapter, plan.scan_layers)
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
    return dataclasses.replace(plan, jobs=tuple(jobs), adapter=found.identity(),
                               not_converted=plan.not_converted + found.not_converted)


def _base_rule(adapter_rule: str) -> str:
    """``...q_proj.lora_A.weight`` -> ``...q_proj.weight``."""
    return adapter_rule.replace(".lora_A.weight", ".weight").replace(".lora_B.weight", ".weight")


def _check_options(dtype: str, devices: int) -> None:
    if dtype not in dtypes.OUTPUT:
        raise BadInputError(f"--dtype {dtype!r} is not supported (supported: {', '.join(dtypes.OUTPUT)})")
    if devices < 1:
        raise BadInputError(f"--devices must be >= 1, got {devices}")


# --- export: a MaxText adapter checkpoint -> a PEFT adapter -----------------------------------------

def is_adapter(stored: list[StoredLeaf]) -> bool:
    """A checkpoint of LoRA leaves (``.../kernel_lora_a/value``), not of a model."""
    return any(leaf.path[-2:] == (LEAF_A, VALUE) for leaf in stored)


def make_adapter_export_plan(like: Source, stored: list[StoredLeaf], alpha: float | None, *,
                             dtype: str = settings.DTYPE, where: str = "checkpoint") -> ExportPlan:
    """The conversion's adapter plan backwards: PEFT's tensors from MaxText's LoRA leaves, for the base ``like``.

    The rank is the leaves' (``kernel_lora_a``'s last axis); the targets are the projections that have leaves;
    ``alpha`` comes from the checkpoint's metadata (``custom_metadata["lora"]``) or the caller.
    """
    if dtype not in dtypes.OUTPUT:
        raise BadInputError(f"--dtype {dtype!r} is not supported (supported: {', '.join(dtypes.OUTPUT)})")
    out_dtype = dtypes.OUTPUT[dtype]
    config_text, config = read_config(like)
    family = family_for(config.get("model_type"), f"{like.uri}/config.json")
    spec = read_spec(family, config, f"{like.uri}/config.json")
    # the converter's root (params/params/...) or the restore layout's (decoder/...): planned as the former
    rooted = {leaf.path if leaf.path[:1] == (PARAM_ROOT,) else PARAMS_ROOT + leaf.path: leaf for leaf in stored
              if leaf.path[-2:] in ((LEAF_A, VALUE), (LEAF_B, VALUE))}
    params = {path: dataclasses.replace(leaf, path=path) for path, leaf in rooted.items()}
    every = tuple(t for rows in targets(family).values() for t in rows)
    a_leaf = next(leaf for leaf in params.values() if leaf.path[-2:] == (LEAF_A, VALUE))
    rank = a_leaf.shape[-1]
    spec = dataclasses.replace(spec, dims={**spec.dims, RANK: rank})
    chosen = tuple(t for t in every if _has_leaves(family, t, spec, params))
    if not chosen:
        raise BadInputError(f"{where}: its LoRA leaves are on no projection of family {family.name} "
                            f"({like.uri}/config.json); an adapter of another model?")
    if alpha is None:
        raise BadInputError(f"{where}: records no LoRA alpha (custom_metadata lora.lora_alpha); pass --lora-alpha")
    lora_family = adapter_family(family, chosen)
    leaf_dtype = np.dtype(a_leaf.dtype)
    devices = math.prod(a_leaf.mesh_shape) if a_leaf.mesh_shape else 1
    candidates = []
    for scan in (True, False):
        stacks = family.layout(spec, scan)
        expected = expected_tensors(lora_family.active_rules(spec), stacks, spec)
        pieces = {name: ExportTarget(name, shape, out_dtype) for name, (_, shape) in expected.items()}
        jobs = layout_jobs(lora_family, spec, stacks, pieces, leaf_dtype, devices)
        candidates.append((scan, jobs))
    scan, jobs = max(candidates, key=lambda c: len({leaf.path for job in c[1] for leaf in job.leaves} & params.keys()))
    _check_leaves(where, like.uri, jobs, params)
    jobs = tuple(dataclasses.replace(job, leaves=tuple(dataclasses.replace(leaf, path=rooted[leaf.path].path)
                                                       for leaf in job.leaves)) for job in jobs)  # read where stored
    names = {piece.name: ADAPTER_PREFIX + piece.name for job in jobs for piece in job.pieces}
    tensors = tuple(TensorEntry(names[piece.name], piece.dtype, piece.shape) for job in jobs for piece in job.pieces)
    modules = sorted({t.module for t in chosen})
    lora = AdapterConfig(rank, float(alpha), tuple(modules), like.uri)
    return ExportPlan(lora_family, spec, config, config_text, scan, out_dtype, jobs, names, tensors, (), adapter=lora)


def _has_leaves(family: Family, target: Target, spec: ModelSpec, params: dict) -> bool:
    """Whether the checkpoint holds ``target``'s LoRA leaves in either layout (the layer stacks decide the paths:
    Gemma 2's ``self_attention_local``)."""
    lora_family = adapter_family(family, (target,))
    for scan in (True, False):
        for stack in family.layout(spec, scan):
            for r in lora_family.active_rules(spec):
                if applies(r, stack):
                    if (*PARAMS_ROOT, *stack.path(r.outputs[0].path)) in params:
                        return True
    return False


def peft_config(plan: ExportPlan) -> dict:
    """``adapter_config.json`` as PEFT writes it for a plain LoRA (the fields its loader reads)."""
    lora = plan.adapter
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "target_modules": list(lora.targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
            "modules_to_save": None, "layers_to_transform": None, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": lora.base_model,
            "auto_mapping": {"base_model_class": (plan.config.get("architectures") or [None])[0]}}
