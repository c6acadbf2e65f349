"""Plan an export (MaxText -> HF) from ``--like``'s ``config.json`` and the checkpoint's metadata alone.

The export runs the conversion's own plan backwards: the same family rules and layer stacks
give every job (a rule on a layer stack), its leaves and its tile plan, with the HF tensors as
the jobs' *outputs* instead of their inputs. Before a byte is written the checkpoint must hold
exactly the leaves that plan names, with the shapes ``config.json`` implies: a checkpoint of
another model (or another size) fails naming the first leaf that differs. Whether the layers
were scanned is read from the leaf names (``decoder/layers/...`` or ``decoder/layers_0/...``).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ckptconv import dtypes, settings
from ckptconv.errors import BadInputError
from ckptconv.families import family_for
from ckptconv.families.base import MULTIMODAL, Family, LayoutError
from ckptconv.families.inputs import FP8_KEPT, Joined, StackedExperts
from ckptconv.families.transforms import Resize
from ckptconv.plan.conversion import Job, expected_tensors, kept_spec, layout_jobs, read_config, read_spec
from ckptconv.read.safetensors_io import index_checkpoint
from ckptconv.read.sources import Source
from ckptconv.read.spec import ModelSpec
from ckptconv.read.stored import StoredLeaf

Box = tuple[tuple[int, int], ...]
@dataclass(frozen=True)
class TensorEntry:
    """One tensor an export writes: its HF name, dtype and shape (a safetensors header entry)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


PARAM_ROOT = "params"  # the items tree's TrainState field holding every collection MaxText's model reads


@dataclass(frozen=True)
class Target:
    """One HF tensor the export writes (a rule's piece seen from the other side): the conversion
    planner's :class:`~ckptconv.families.inputs.Input` questions, answered for a tensor not yet written."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    file: str = ""

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(range(len(self.shape)))

    @property
    def whole_axes(self) -> tuple[int, ...]:
        return ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def decode_bytes(self) -> int:
        return 0

    def read(self, source: Source, box: Box) -> np.ndarray:
        raise TypeError(f"{self.name}: an export target is written, not read")


@dataclass(frozen=True)
class ExportPlan:
    """What an export reads (the jobs' leaves) and writes (``tensors``, in writing order)."""

    family: Family
    spec: ModelSpec
    config: dict
    config_text: str
    scan_layers: bool
    dtype: np.dtype
    jobs: tuple[Job, ...]
    hf_names: dict[str, str]  # the rules' tensor names -> the names written (as --like stores them)
    tensors: tuple[TensorEntry, ...]
    not_exported: tuple[dict, ...]
    adapter: Any = None  # a LoRA adapter's export: its AdapterConfig (rank, alpha, targets); see ckptconv.plan.lora

    @property
    def output_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.tensors)


def make_export_plan(like: Source, stored: list[StoredLeaf], *, dtype: str = settings.DTYPE,
                     where: str = "checkpoint") -> ExportPlan:
    """Check the checkpoint's leaves against ``like``'s config and plan every HF tensor; raises
    :class:`BadInputError` naming the first leaf that is missing, unexpected or of another shape."""
    if dtype not in settings.OUTPUT_DTYPES:
        raise BadInputError(f"--dtype {dtype!r} is not supported (supported: {', '.join(settings.OUTPUT_DTYPES)})")
    out_dtype = dtypes.OUTPUT[dtype]
    config_text, config = read_config(like)
    family = family_for(config.get("model_type"), f"{like.uri}/config.json")
    spec = read_spec(family, config, f"{like.uri}/config.json")
    params = {leaf.path: leaf for leaf in stored if leaf.path[:1] == (PARAM_ROOT,)}
    if not params:
        raise BadInputError(f"{where}: no leaves under '{PARAM_ROOT}' (not a MaxText parameter checkpoint)")
    leaf_dtype = np.dtype(next(iter(params.values())).dtype)
    if any(np.dtype(leaf.dtype) == dtypes.E4M3 for leaf in params.values()):
        leaf_dtype = dtypes.E4M3  # written with --dtype float8_e4m3fn: each leaf in its HF tensor's dtype
        spec = kept_spec(family, spec) or spec  # DeepSeek's FP8 release, kept: its scales are leaves too
    # an FP8 release's block scales go back in the dtype it stores them in (Qwen3.5's bfloat16, DeepSeek's float32)
    scale_dtype = next((np.dtype(leaf.dtype) for path, leaf in params.items() if path[-1].endswith("_scale")),
                       dtypes.BF16)
    devices = _device_count(next(iter(params.values())))
    candidates = []
    # scanned or not, with the encoders or not (convert --multimodal): the layout whose leaves the checkpoint holds
    # a quantised release read dequantised is exported as its bf16 release stores it (Llama 4 Maverick FP8's
    # experts one by one become the fused tensors): its rules and joins are read without the quantisation
    release = spec.values.get("quantization")
    bf16 = {k: v for k, v in spec.values.items() if k != "quantization" or release == FP8_KEPT}
    for scan, encoders in itertools.product((True, False), (False, True) if family.encoders else (False,)):
        layout_spec = replace(spec, values={**bf16, MULTIMODAL: encoders})
        try:
            stacks = family.layout(layout_spec, scan)
        except LayoutError:  # a model MaxText cannot scan: only the unscanned layout is a candidate
            continue
        expected = expected_tensors(family.active_rules(layout_spec), stacks, layout_spec)
        targets = {name: _target(family, layout_spec, name, shape, expected, out_dtype, scale_dtype)
                   for name, (_, shape) in expected.items()}
        jobs = layout_jobs(family, layout_spec, stacks, targets, leaf_dtype, devices)
        candidates.append((scan, layout_spec, _where_stored(jobs, params)))
    scan, spec, jobs = max(candidates,
                           key=lambda c: len({leaf.path for job in c[2] for leaf in job.leaves} & params.keys()))
    if release is not None:
        spec = replace(spec, values={**spec.values, "quantization": release})  # the release's, for the report
    _check_leaves(where, like.uri, jobs, params)
    hf_names = _hf_names(like, family, [p.name for job in jobs for piece in job.pieces for p in written(piece)])
    tensors = tuple(TensorEntry(hf_names[p.name], p.dtype, p.shape)
                    for job in jobs for piece in job.pieces for p in written(piece))
    return ExportPlan(family, spec, config, config_text, scan, out_dtype, jobs, hf_names, tensors,
                      _not_exported(family, spec, jobs))


def _stored_dtype(spec: ModelSpec, name: str, expected: dict, dtype: np.dtype,
                  scale_dtype: np.dtype = dtypes.BF16) -> np.dtype:
    """The dtype an HF tensor is written in: ``--dtype``'s, except in an FP8 release MaxText keeps quantised,
    whose weights go back to e4m3 (the values are e4m3's) beside their block scales (``scale_dtype``: the leaves')."""
    if spec.values.get("quantization") != FP8_KEPT:
        return dtype
    if name.endswith("_scale_inv"):
        return scale_dtype
    return dtypes.SAFETENSORS["F8_E4M3"] if name + "_scale_inv" in expected else dtype


def _target(family: Family, spec: ModelSpec, name: str, shape: tuple[int, ...], expected: dict,
            dtype: np.dtype, scale_dtype: np.dtype = dtypes.BF16) -> Target | Joined | StackedExperts:
    """The tensor a rule's piece becomes: itself, or the parts this release stores it in. A part is
    e4m3 where its fused tensor has block scales (in_proj_qkvz) or it has its own (an FP8 expert)."""
    own = _stored_dtype(spec, name, expected, dtype, scale_dtype)
    join = family.join_for(name)
    if join is None or not join.in_parts(spec):
        return Target(name, shape, own)
    parts = tuple(Target(part, part_shape,
                         own if own != dtype else _stored_dtype(spec, part, expected, dtype, scale_dtype))
                  for part, part_shape in join.part_shapes(name, spec, shape))
    return join.compose(name, spec, parts)


def written(piece: Target | Joined | StackedExperts) -> tuple[Target, ...]:
    """The HF tensors a piece is written as, in order."""
    return piece.parts if isinstance(piece, (Joined, StackedExperts)) else (piece,)


def check_recorded_model(spec: ModelSpec, recorded: dict, like: str, report: str, same_tool: bool = True) -> None:
    """``--like``'s model must be the one the checkpoint records it was converted from (its report's
    ``model``): the leaves' shapes cannot tell a Llama 3 with ``rope_type llama3`` from one without,
    and an export would then ship the wrong config beside the right weights. A report written by
    another ckptconv version is held only to the fields it records (a newer version may record more)."""
    mine = json.loads(json.dumps(spec.to_json()))  # tuples as lists, as the report stores them
    field = _first_difference(recorded, mine, only_recorded=not same_tool)
    if field is not None:
        path, theirs, ours = field
        raise BadInputError(f"{like}/config.json: {path} is {_shown(ours)}, but the checkpoint was converted with "
                            f"{_shown(theirs)} ({report}); export --like the model it was converted from")


def _first_difference(recorded: Any, mine: Any, path: str = "", only_recorded: bool = False
                      ) -> tuple[str, Any, Any] | None:
    """(dotted field, recorded value, our value) of the first field that differs, else None."""
    if isinstance(recorded, dict) and isinstance(mine, dict):
        keys = set(recorded) if only_recorded else set(recorded) | set(mine)
        for key in sorted(keys, key=str):
            found = _first_difference(recorded.get(key), mine.get(key), f"{path}.{key}" if path else str(key),
                                      only_recorded)
            if found is not None:
                return found
        return None
    return None if recorded == mine else (path, recorded, mine)


def _shown(value: Any) -> str:
    text = "unset" if value is None else json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _where_stored(jobs: tuple[Job, ...], params: dict[tuple[str, ...], StoredLeaf]) -> tuple[Job, ...]:
    """``jobs`` reading each leaf the checkpoint lacks under ``params/params`` from another
    collection that holds it at the same path: earlier versions of ckptconv wrote DeepSeek's
    router bias in ``params/MoEBiasVar`` (MaxText's model declares it so; its inference loader
    reads only ``params/params``)."""
    elsewhere = {path[2:]: path for path in params if path[:2] != (PARAM_ROOT, "params")}
    moved = {leaf.path: elsewhere[leaf.path[2:]] for job in jobs for leaf in job.leaves
             if leaf.path not in params and leaf.path[2:] in elsewhere}
    if not moved:
        return jobs
    return tuple(replace(job, leaves=tuple(replace(leaf, path=moved.get(leaf.path, leaf.path)) for leaf in job.leaves))
                 for job in jobs)


def _device_count(leaf: StoredLeaf) -> int:
    """Devices the checkpoint was sharded over: the tile plan then reads whole stored chunks."""
    return math.prod(leaf.mesh_shape) if leaf.mesh_shape else 1


def _check_leaves(where: str, like: str, jobs: tuple[Job, ...], params: dict[tuple[str, ...], StoredLeaf]) -> None:
    planned = {leaf.path: leaf for job in jobs for leaf in job.leaves}
    for path, leaf in planned.items():
        found = params.get(path)
        if found is None:
            raise BadInputError(f"{where}: missing leaf {leaf.name!r}, which {like}/config.json implies "
                                f"(a checkpoint of another model?)")
        if found.shape != leaf.shape:
            raise BadInputError(f"{where}: leaf {leaf.name!r} has shape {list(found.shape)}, "
                                f"{like}/config.json implies {list(leaf.shape)}")
        if np.dtype(found.dtype).kind != "f" and np.dtype(found.dtype) not in (dtypes.BF16, dtypes.E4M3):
            raise BadInputError(f"{where}: leaf {leaf.name!r} has dtype {found.dtype}, expected a float dtype")
    extra = sorted(set(params) - set(planned))
    if extra:
        raise BadInputError(f"{where}: unexpected leaf {'/'.join(extra[0])!r} for {like}/config.json"
                            f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''} (a checkpoint of another model?)")


def _hf_names(like: Source, family: Family, names: list[str]) -> dict[str, str]:
    """The names to write: as ``--like`` stores them when it has weights (Gemma 3's hub checkpoints
    say ``language_model.model.*`` where the rules say ``model.*``), else the rules' own names."""
    try:
        stored = index_checkpoint(like)
    except BadInputError:  # --like may be a config-only directory
        stored = {}
    prefixes = [(canonical, alias) for alias, canonical in family.aliases
                if any(name.startswith(alias) for name in stored)]
    renamed = {}
    for name in names:
        if name in stored:  # stored under the rules' own name (Qwen3-VL's model.visual.* beside model.language_model.*)
            renamed[name] = name
            continue
        prefix = next(((c, a) for c, a in prefixes if name.startswith(c)), None)
        renamed[name] = prefix[1] + name[len(prefix[0]):] if prefix else name
    return renamed


def _not_exported(family: Family, spec: ModelSpec, jobs: tuple[Job, ...]) -> tuple[dict, ...]:
    """What the HF model has that the MaxText checkpoint cannot give back, named for the report."""
    prefixes: dict[str, list[str]] = {}
    for prefix, what in family.not_converted(spec):
        prefixes.setdefault(what, []).append(f"{prefix}*")
    notes = [{"what": f"{what}: not in a MaxText checkpoint, not exported", "tensors": names}
             for what, names in prefixes.items()]
    for job in jobs:
        for step in (s for leaf in job.leaves for s in leaf.steps if isinstance(s, Resize)):
            rows, kept = job.source_shape[step.axis], spec.dim(step.size)
            if rows > kept:
                notes.append({"what": f"rows {kept}..{rows - 1} are not in MaxText's vocabulary of {kept} rows: "
                                      "written as zeros", "tensors": [job.pieces[0].name]})
    if spec.values.get("quantization") not in (None, FP8_KEPT):
        notes.append({"what": f"quantised release ({spec.values['quantization']}): exported dequantised; "
                              "config.json without quantization_config", "tensors": []})
    return tuple(notes)


# --- parallelism -----------------------------------------------------------------------------

def read_held_bytes(job: Job) -> int:
    """What one export read of ``job`` holds at most: each leaf's region of it (in the leaf's dtype), the HF
    tensors made from it (every member, in the written dtype) and, where a step computes, the two float32 copies a
    step chain holds (as the conversion's ``estimate.work_bytes``). A read is one of the conversion's read units,
    ``job.tiling.unit_bytes`` of HF bytes."""
    itemsize = max(np.dtype(part.dtype).itemsize for piece in job.pieces for part in written(piece))
    elements = job.tiling.unit_bytes // itemsize
    computing = not all(step.exact for leaf in job.leaves for step in leaf.steps)
    per_element = sum(leaf.dtype.itemsize for leaf in job.leaves) + itemsize + (8 if computing else 0)
    return elements * per_element


def peak_terms(plan: ExportPlan, options: settings.RunOptions) -> dict[str, int]:
    """What an export's peak with ``options.workers`` is made of: the runtime's ``baseline``; for that many reads
    being made plus those made and queued for the writer (``prefetch``), the largest read's holdings
    (:func:`read_held_bytes`), ``reads``; on a sandboxed kernel also the freed buffers glibc's heap keeps there,
    ``heap``, counted as convert's estimate counts them (``estimate.SANDBOX_HEAP_SHARE`` of ``reads``: export sets the
    same 64 MiB mmap threshold, ``tune_malloc``, and trims that heap only past the rest, ``estimate.trim_line``)."""
    from ckptconv.plan import estimate

    baseline = estimate.BASELINE_SANDBOX_BYTES if options.sandboxed else estimate.BASELINE_BYTES
    held = max((read_held_bytes(job) for job in plan.jobs), default=0)
    reads = (options.workers + options.in_flight.prefetch) * held
    heap = int(reads * estimate.SANDBOX_HEAP_SHARE) if options.sandboxed else 0
    return {"baseline": baseline, "reads": reads, "heap": heap}


def predicted_peak_bytes(plan: ExportPlan, options: settings.RunOptions) -> int:
    """An export's predicted peak with ``options.workers``: the sum of :func:`peak_terms`."""
    return sum(peak_terms(plan, options).values())


def choose_workers(plan: ExportPlan, options: settings.RunOptions) -> settings.RunOptions:
    """``options`` with the workers an export uses, and why, by convert's rule
    (:func:`ckptconv.plan.estimate.workers_within_budget`) on :func:`predicted_peak_bytes`."""
    from ckptconv.plan import estimate

    return estimate.workers_within_budget(options, functools.partial(predicted_peak_bytes, plan))
