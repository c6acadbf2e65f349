"""Plan a conversion from ``config.json`` and the safetensors headers alone.

The plan checks key coverage both ways and every shape before a byte of weights is read or
written, so bad input fails fast with the offending names and ``DST`` is never touched. It
lists every *job* (a rule applied to one layer stack): the HF tensors it reads, the MaxText
leaves it makes, and its tile plan (:mod:`ckptconv.families.tiles`). What the checkpoint holds that
MaxText's layout does not (a vision tower, a tied head, dropped vocabulary rows) is listed
in ``not_converted`` for the report, never silently dropped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np

from ckptconv import dtypes, settings
from ckptconv.errors import BadInputError
from ckptconv.families import family_for
from ckptconv.families.base import MULTIMODAL, Family, LayerStack, LayoutError, Rule, UnscannedOnly, applies
from ckptconv.families.inputs import (
    FP8_BLOCK, FP8_CHANNEL, FP8_KEPT, INT4_SCHEME, MXFP4_SCHEME, Input, join_input, resolve,
)
from ckptconv.families.sharding import MESH_AXIS, partition_spec, shard_shape
from ckptconv.families.tiles import LeafShape, ReadUnit, Tiling, plan_tiling, read_units
from ckptconv.families.transforms import Misaligned, Resize, Shape, Step, output_shape
from ckptconv.read.safetensors_header import collector_paused
from ckptconv.read.safetensors_io import TensorInfo, index_checkpoint
from ckptconv.read.sources import Source
from ckptconv.read.spec import ConfigReader, ModelSpec, load_config

PARAMS_ROOT = ("params", "params")
# Beside the params MaxText's converter saves its TrainState's other fields: step 0, no optimizer.
MAXTEXT_EXTRA_ITEMS = {"step": 0, "opt_state": {}}


@dataclass(frozen=True)
class LeafPlan:
    """One MaxText leaf: its path in the ``items`` tree, shape, dtype, stack axes and chunks."""

    path: tuple[str, ...]
    shape: Shape
    dtype: np.dtype
    stack_axes: tuple[int, ...]
    steps: tuple[Step, ...]
    chunk_shape: Shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def name(self) -> str:
        return "/".join(self.path)


@dataclass(frozen=True)
class Job:
    """One rule on one layer stack: its source pieces (one per layer and expert), read once,
    and the leaves its outputs make."""

    rule: Rule
    pieces: tuple[Input, ...]
    positions: tuple[tuple[int, ...], ...]  # each piece's index on the leaves' stack axes
    source_shape: Shape
    leaves: tuple[LeafPlan, ...]
    tiling: Tiling

    @property
    def shapes(self) -> tuple[LeafShape, ...]:
        return tuple(LeafShape(leaf.shape, leaf.stack_axes, leaf.steps, leaf.dtype.itemsize) for leaf in self.leaves)

    def units(self, spec: ModelSpec) -> Iterator[ReadUnit]:
        return read_units(self.tiling, self.source_shape, self.shapes, self.positions, spec)

    def sample_units(self, spec: ModelSpec) -> list[ReadUnit]:
        """Read units of every size this job has, without walking the model: every piece is cut
        alike (only its last band differs), and groups differ only at the end of a run of pieces."""
        if self.tiling.band_axis is not None or not self.positions[0]:
            run = self.positions[:1]
        else:
            run = tuple(p for p in self.positions if p[:-1] == self.positions[0][:-1])
        return list(read_units(self.tiling, self.source_shape, self.shapes, run, spec))

    @property
    def source_bytes(self) -> int:
        return sum(info.nbytes for info in self.pieces)


@dataclass(frozen=True)
class ConversionPlan:
    source_uri: str
    family: Family
    spec: ModelSpec
    dtype: np.dtype
    scan_layers: bool
    devices: int
    jobs: tuple[Job, ...]
    tensors: dict[str, TensorInfo]
    config_text: str
    not_converted: tuple[dict, ...]
    adapter: dict | None = None  # a LoRA conversion: what its fingerprint sees of the adapter (ckptconv.plan.lora)

    @property
    def leaves(self) -> tuple[LeafPlan, ...]:
        return tuple(leaf for job in self.jobs for leaf in job.leaves)

    @property
    def tensor_count(self) -> int:
        """The HF tensors read: a fused input counts the parts it is read from (Qwen3.5's in_proj_qkv, in_proj_z)."""
        return sum(len(getattr(piece, "parts", (piece,))) for job in self.jobs for piece in job.pieces)

    @property
    def source_bytes(self) -> int:
        return sum(job.source_bytes for job in self.jobs)

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


def read_spec(family: Family, config: dict, where: str) -> ModelSpec:
    """The family's typed spec; any config field it did not read is an error."""
    reader = ConfigReader(config, where)
    spec = family.read_spec(reader)
    reader.check_all_read()
    return spec


MAX_DEVICES = 16384


def _check_devices_shard_something(jobs: tuple[Job, ...], devices: int) -> None:
    """A device count that shards no leaf (MaxText's rule: dim 0, else dim 1, divisible by it) only
    replicates everything: refuse it and name the largest power of two that does shard."""
    shapes = [leaf.shape for job in jobs for leaf in job.leaves]
    if devices == 1 or any(MESH_AXIS in partition_spec(shape, devices) for shape in shapes):
        return
    useful = next((2**k for k in range(devices.bit_length(), 0, -1) if 2**k <= devices
                   and any(MESH_AXIS in partition_spec(shape, 2**k) for shape in shapes)), 1)
    raise BadInputError(f"--devices {devices} shards none of the {len(shapes)} leaves (each would be replicated "
                        f"{devices} times); the largest power of two that shards some leaf is {useful}")


@collector_paused()  # no cyclic GC while a plan is made (its objects live until it is): Kimi-K2.6's plan -26% CPU
def make_plan(source: Source, *, dtype: str = settings.DTYPE, scan_layers: bool | None = settings.SCAN_LAYERS,
              devices: int = settings.DEVICES, multimodal: bool = False) -> ConversionPlan:
    """Build and check the whole conversion plan; raises :class:`BadInputError` naming what is wrong.

    ``multimodal``: also the encoders (vision, audio) MaxText converts with ``use_multimodal=true``.
    ``scan_layers`` None: scanned unless the model runs unscanned only (:func:`choose_layout`)."""
    if dtype not in settings.CONVERT_DTYPES:
        raise BadInputError(f"--dtype {dtype!r} is not supported (supported: {', '.join(settings.CONVERT_DTYPES)})")
    if devices < 1:
        raise BadInputError(f"--devices must be >= 1, got {devices}")
    if devices > MAX_DEVICES:
        raise BadInputError(f"--devices {devices}: at most {MAX_DEVICES} (the largest TPU slices; each device is "
                            "simulated in one process, so more would take minutes before the first byte)")
    config_text, config = read_config(source)
    where = f"{source.uri}/config.json"
    family = family_for(config.get("model_type"), where)
    spec = with_encoders(where, family, read_spec(family, config, where), multimodal)
    if dtype == settings.KEEP_FP8:
        spec = _keep_fp8(where, family, spec)
    stored = index_checkpoint(source)
    _check_claims(where, spec, len(stored))
    tensors, not_converted = _sort_tensors(source, family, spec, stored)
    stacks, scan_layers = choose_layout(where, family, spec, scan_layers)
    _check_piece_count(where, family.active_rules(spec), stacks, spec, len(stored))
    _check_layer_kinds(source, family.active_rules(spec), stacks, tensors,
                       tuple(r for r in family.rules if not r.when(spec)))
    expected = expected_tensors(family.active_rules(spec), stacks, spec)
    # rules whose sizes config.json does not give (Gemma 3's vision rules for a gemma3_text config) name nothing
    sized = tuple(r for r in family.rules if set(r.hf_shape) <= spec.dims.keys())
    inactive = expected_tensors(tuple(r for r in sized if not r.when(spec)), stacks, spec)
    scheme = spec.values.get("quantization")
    inputs, consumed = _resolve(source, expected, tensors, scheme, family, spec)
    # an inactive rule's tensor that an active input reads (DeepSeek's block scales, decoded with their weights
    # unless kept) is converted, not unused
    unused, unused_consumed = _resolve_present({n: r for n, r in inactive.items() if n not in consumed}, tensors,
                                               scheme)
    _check_extra(source, family, tensors, consumed | unused_consumed)
    by_note: dict[str, list[Input]] = defaultdict(list)  # one entry per reason (E2B's 60 KV-shared keys: one)
    for name in sorted(unused):
        by_note[inactive[name][0].note].append(unused[name])
    not_converted += tuple({"what": note, "tensors": [found.name for found in unread],
                            "bytes": sum(found.nbytes for found in unread)} for note, unread in by_note.items())
    _check_shapes_and_dtypes(expected, inputs, scheme)
    out_dtype = dtypes.OUTPUT[dtype]
    jobs = layout_jobs(family, spec, stacks, inputs, out_dtype, devices)
    _check_devices_shard_something(jobs, devices)
    not_converted += _dropped_rows(jobs, spec)
    return ConversionPlan(source.uri, family, spec, out_dtype, scan_layers, devices, jobs, tensors, config_text,
                          not_converted)


# Why a source cannot be kept FP8 (--dtype float8_e4m3fn), by its quantisation scheme: MaxText 0.2.5 keeps a
# tensor e4m3 only when the source stores it so, and dequantises it only by a scale stored beside it.
NOT_KEEPABLE = {
    None: "has no FP8 weights to keep (no quantization_config): the scales would have to be guessed",
    FP8_BLOCK: "is an FP8 release, but ckptconv's {family} rules have no leaves for its block scales",
    FP8_CHANNEL: "is an FP8 release with a scale per row, which MaxText's {family} model has no leaves for",
    MXFP4_SCHEME: "has no FP8 weights to keep (its experts are MXFP4)",
    INT4_SCHEME: "has no FP8 weights to keep (its experts are INT4)",
}


def kept_spec(family: Family, spec: ModelSpec) -> ModelSpec | None:
    """An FP8 release read dequantised by default whose family also has rules for its scales (DeepSeek's), read
    kept instead (``--dtype float8_e4m3fn``; export of such a checkpoint); None for any other spec."""
    if spec.values.get("quantization") == FP8_BLOCK and any(r.hf.endswith("_scale_inv") for r in family.rules):
        return replace(spec, values={**spec.values, "quantization": FP8_KEPT})
    return None


def choose_layout(where: str, family: Family, spec: ModelSpec,
                  scan_layers: bool | None) -> tuple[tuple[LayerStack, ...], bool]:
    """The layer stacks and whether they are scanned: as asked, or (``None``) scanned unless the family says the
    model runs unscanned only (:class:`UnscannedOnly`); a layout MaxText cannot hold is one line naming config.json."""
    try:
        if scan_layers is None:
            try:
                return family.layout(spec, True), True
            except UnscannedOnly:
                return family.layout(spec, False), False
        return family.layout(spec, scan_layers), scan_layers
    except LayoutError as err:
        raise BadInputError(f"{where}: {err}") from None


def with_encoders(where: str, family: Family, spec: ModelSpec, multimodal: bool) -> ModelSpec:
    """The spec with ``--multimodal`` recorded (rules read it); refused for a family with no encoder rules, whose
    tensors beyond the decoder would otherwise be dropped while the user asked for them."""
    if multimodal and not family.encoders:
        raise BadInputError(f"{where}: --multimodal converts the encoders MaxText converts with use_multimodal=true; "
                            f"ckptconv's {family.name} rules convert the text decoder only; convert without "
                            "--multimodal")
    return replace(spec, values={**spec.values, MULTIMODAL: multimodal})


def _keep_fp8(where: str, family: Family, spec: ModelSpec) -> ModelSpec:
    """``--dtype float8_e4m3fn`` keeps an FP8 release's weights and scales as stored: an FP8 release whose family
    has rules for its scales (DeepSeek's, read dequantised otherwise) is read kept; a source whose weights MaxText
    cannot hold that way is refused rather than quantised with made-up scales."""
    scheme = spec.values.get("quantization")
    kept = kept_spec(family, spec)
    if kept is not None:
        return kept
    if scheme != FP8_KEPT:
        reason = NOT_KEEPABLE[scheme].format(family=family.name)
        raise BadInputError(f"{where}: --dtype {settings.KEEP_FP8} keeps an FP8 release's weights as stored; "
                            f"this checkpoint {reason}; convert with --dtype bfloat16")
    return spec


# --- claims the headers must be able to back, checked before anything is enumerated ---------

# Counts in config.json that the plan iterates over before it names tensors, each needing at
# least one stored tensor apiece: checked against the headers first, so the plan's cost follows
# the checkpoint, not the config (a config claiming 10**9 layers is refused at once, not
# enumerated). Experts are bounded with the tensors the rules need (_check_piece_count): gpt-oss
# stores all experts of a layer in one tensor.
CLAIMED_COUNTS: tuple[tuple[str, Callable[[ModelSpec], int]], ...] = (
    ("layers", lambda spec: spec.num_layers),
    ("multi-token-prediction layers", lambda spec: spec.values.get("mtp_layers", 0)),
)


NAMED_MARGIN = 1024  # tensors the plan may name beyond twice the stored ones (a cheap, exact missing-tensor message)


def _check_claims(where: str, spec: ModelSpec, stored: int) -> None:
    for what, count in CLAIMED_COUNTS:
        if count(spec) > stored:
            raise BadInputError(f"{where}: claims {_short(count(spec))} {what}, but the safetensors headers hold "
                                f"only {stored} tensors")


def _check_piece_count(where: str, rules: tuple[Rule, ...], stacks: tuple[LayerStack, ...], spec: ModelSpec,
                       stored: int) -> None:
    """The number of tensors the rules will name, by arithmetic, before they are named one by one.

    Up to twice what the headers hold (plus a margin) they are named, so that a checkpoint
    missing a few tensors is told which; beyond that the config cannot be this checkpoint's.
    """
    needed = 0
    for r in rules:
        layers = sum(len(s.layers) for s in stacks if applies(r, s)) if r.per_layer else 1
        needed += (spec.dim("experts") if r.per_expert else 1) * layers
    if needed > 2 * stored + NAMED_MARGIN:
        experts = spec.dims.get("experts")
        claims = f"{spec.num_layers} layers" + (f", {experts} experts" if experts else "")
        raise BadInputError(f"{where}: implies {needed} tensors ({claims}), but the safetensors headers hold "
                            f"only {stored} tensors")


def _check_layer_kinds(source: Source, rules: tuple[Rule, ...], stacks: tuple[LayerStack, ...],
                       tensors: dict[str, TensorInfo], reported: tuple[Rule, ...] = ()) -> None:
    """A layer holding another kind's tensors (a full-attention layer where config.json's pattern puts a
    linear one) is named as such, not as the tensors it then lacks. An encoder numbers its layers apart from
    the decoder's (Llama 4's vision layer 0 beside decoder layer 0): a layer index is another kind's only if no
    stack of that kind holds the index. A name an inactive rule of the layer's own kind accounts for (``reported``:
    the keys a KV-shared Gemma 4 layer still stores) is that layer's, reported rather than written."""
    kinded = [r for r in rules if r.per_layer and r.kinds is not None]
    held = defaultdict(set)  # layer index -> the kinds of the stacks holding it
    for stack in stacks:
        for layer in stack.layers:
            held[layer].add(stack.kind)
    encoder_kinds = {stack.kind for stack in stacks if stack.encoder}  # an encoder's names are its own
    for stack in (s for s in stacks if not s.encoder):
        # a name both kinds hold, in their own shapes (Gemma 4's q_proj: global layers' heads are wider), is
        # checked by shape, not here
        own = {r.hf for r in rules + reported if r.per_layer and applies(r, stack)}
        for r in (r for r in kinded
                  if stack.kind not in r.kinds and r.hf not in own and not r.kinds <= encoder_kinds):
            for layer in (i for i in stack.layers if not held[i] & r.kinds):
                info = tensors.get(r.hf.format(layer=layer, expert=0))
                if info is not None:
                    raise BadInputError(f"{source.uri}/{info.file}: layer {layer} holds {info.name!r}, a tensor of a "
                                        f"{' or '.join(sorted(r.kinds))} layer, but config.json makes layer {layer} "
                                        f"a {stack.kind} layer")


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


# --- names ---------------------------------------------------------------------------------

IGNORED_NOTE = ("rotary embedding buffers (rotary_emb.inv_freq): transformers recomputes them from config.json and "
                "MaxText computes RoPE itself")


def _sort_tensors(source: Source, family: Family, spec: ModelSpec,
                  stored: dict[str, TensorInfo]) -> tuple[dict[str, TensorInfo], tuple]:
    """Stored tensors by the names the rules use; what MaxText's layout does not hold, grouped."""
    tensors: dict[str, TensorInfo] = {}
    groups: dict[str, list[TensorInfo]] = defaultdict(list)
    skipped = family.not_converted(spec)
    for name, info in stored.items():
        what = next((label for prefix, label in skipped if name.startswith(prefix)), None)
        if what is not None:
            groups[what].append(info)
            continue
        if name.endswith(family.ignored_hf_suffixes):  # buffers, not weights: reported, never silently dropped
            groups[IGNORED_NOTE].append(info)
            continue
        canonical = family.canonical(name)
        if canonical in tensors:
            raise BadInputError(f"{source.uri}: tensors {tensors[canonical].name!r} and {name!r} are the same "
                                f"tensor ({canonical!r}) under two names")
        tensors[canonical] = info
    summary = tuple({"what": what, "tensors": len(infos), "bytes": sum(i.nbytes for i in infos),
                     "example": min(i.name for i in infos)} for what, infos in sorted(groups.items()))
    return tensors, summary


@dataclass(frozen=True)
class _Instance:
    """A rule applied to one layer stack (or, for a global rule, to nothing): its pieces by name."""

    rule: Rule
    stack: LayerStack | None
    names: tuple[str, ...]  # HF names of the pieces
    positions: tuple[tuple[int, ...], ...]  # each piece's index on the leaves' stack axes

    @property
    def stacked(self) -> bool:
        return self.stack is not None and self.stack.stacked


def _instances(rules: tuple[Rule, ...], stacks: tuple[LayerStack, ...], spec: ModelSpec) -> Iterator[_Instance]:
    """Global rules once, then every layer rule on every stack whose kind it serves, in that order."""
    for r in rules:
        if not r.per_layer:
            yield _instance(r, None, spec)
    for stack in stacks:
        for r in rules:
            if r.per_layer and applies(r, stack):
                yield _instance(r, stack, spec)


def _instance(r: Rule, stack: LayerStack | None, spec: ModelSpec) -> _Instance:
    """Pieces in stack order: experts outermost (MaxText's (experts, layers, ...)), then layers."""
    layers = stack.layers if stack is not None else (0,)
    stacked = stack is not None and stack.stacked
    experts = range(spec.dim("experts")) if r.per_expert else [None]
    names, positions = [], []
    for e in experts:
        for j, layer in enumerate(layers):
            names.append(r.hf.format(layer=layer, expert=e))
            positions.append(((e,) if e is not None else ()) + (stack.position(j) if stacked else ()))
    return _Instance(r, stack, tuple(names), tuple(positions))


def expected_tensors(rules: tuple[Rule, ...], stacks: tuple[LayerStack, ...], spec: ModelSpec) -> dict[str, tuple[Rule, Shape]]:
    """Every HF tensor the rules read, with the rule and the shape ``config.json`` implies."""
    return {name: (inst.rule, tuple(spec.dim(d) for d in inst.rule.hf_shape))
            for inst in _instances(rules, stacks, spec) for name in inst.names}


def _resolve(source: Source, expected: dict, tensors: dict[str, TensorInfo], scheme: str | None,
             family: Family, spec: ModelSpec) -> tuple[dict[str, Input], set[str]]:
    """The input each expected tensor reads (stored, decoded from its quantised parts, or joined from
    the parts a checkpoint stores it in), and every stored name they consume; a missing one fails
    naming the leaf it feeds."""
    inputs: dict[str, Input] = {}
    consumed: set[str] = set()
    missing = []
    for name in sorted(expected):
        found = resolve(name, tensors, scheme)
        join = family.join_for(name) if found is None else None
        if join is not None:
            found = join_input(name, join, spec, expected[name][1], lambda part: resolve(part, tensors, scheme))
        if found is None:
            missing.append(name)
            continue
        inputs[name], names = found
        consumed.update(names)
    if missing:
        rule = expected[missing[0]][0]
        leaves = ", ".join("/".join(o.path) for o in rule.outputs)
        join = family.join_for(missing[0])
        shown = join.part_names(missing[0], spec)[0] if join is not None else missing[0]
        raise BadInputError(
            f"{source.uri}: missing tensor {shown!r} (needed for MaxText leaf {leaves})"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}"
        )
    return inputs, consumed


def _resolve_present(names: dict, tensors: dict[str, TensorInfo], scheme: str | None) -> tuple[dict[str, Input], set[str]]:
    """Inputs of inactive rules that the checkpoint holds anyway (reported, not written)."""
    found = {name: resolve(name, tensors, scheme) for name in names}
    present = {name: hit for name, hit in found.items() if hit is not None}
    return ({name: hit[0] for name, hit in present.items()},
            {stored for _, consumed in present.values() for stored in consumed})


def _check_extra(source: Source, family: Family, tensors: dict[str, TensorInfo], consumed: set[str]) -> None:
    extra = sorted(set(tensors) - consumed)
    if extra:
        info = tensors[extra[0]]
        raise BadInputError(
            f"{source.uri}/{info.file}: unexpected tensor {info.name!r} for family "
            f"{family.name}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}"
        )


def _scaled(name: str, found: Input, expected: dict) -> bool:
    """Whether a tensor has block scales among the rules' tensors: its own, or every one of its parts'
    (an FP8 release's experts, stored one by one, each with its scale)."""
    parts = [p.name for p in getattr(found, "parts", ())]
    return name + "_scale_inv" in expected or bool(parts) and all(p + "_scale_inv" in expected for p in parts)


def _check_shapes_and_dtypes(expected: dict, inputs: dict[str, Input], scheme: str | None) -> None:
    for name, (rule, shape) in expected.items():
        found = inputs[name]
        if found.shape != shape:
            raise BadInputError(
                f"{found.file}: tensor {found.name!r} has shape {list(found.shape)}, config.json implies {list(shape)}"
            )
        if scheme == FP8_KEPT and _scaled(name, found, expected):  # kept quantised: e4m3 as its scales imply
            if found.dtype != dtypes.SAFETENSORS["F8_E4M3"]:
                raise BadInputError(f"{found.file}: tensor {found.name!r} has dtype {found.dtype}, but the FP8 "
                                    f"release stores it as float8_e4m3fn with {name + '_scale_inv'!r}")
            continue
        if rule.integer and found.dtype.kind in "iu":
            continue
        if found.dtype not in dtypes.FLOAT_SOURCES:
            raise BadInputError(f"{found.file}: tensor {found.name!r} has dtype {found.dtype}, expected a float dtype")


# --- jobs and leaves -----------------------------------------------------------------------

def layout_jobs(family: Family, spec: ModelSpec, stacks: tuple[LayerStack, ...], inputs: dict[str, Input],
                dtype: np.dtype, devices: int) -> tuple[Job, ...]:
    """Every job of the active rules on ``stacks``, in writing order: what ``convert`` writes and
    ``export`` reads back (``inputs``: the HF tensor each rule's pieces read or become; ``dtype``: --dtype's,
    float8_e4m3fn keeping each leaf in its piece's dtype, :func:`ckptconv.dtypes.leaf_dtype`)."""
    return tuple(_job(inst, spec, inputs, dtype, devices) for inst in _instances(family.active_rules(spec), stacks, spec))


def _job(inst: _Instance, spec: ModelSpec, inputs: dict[str, Input], dtype: np.dtype, devices: int) -> Job:
    r, stack = inst.rule, inst.stack
    pieces = tuple(inputs[name] for name in inst.names)
    kinds = {(type(p).__name__, p.shape, p.order, p.dtype) for p in pieces}
    if len(kinds) > 1:  # e.g. some experts of a layer quantised, others not: one tile plan cannot read both
        raise BadInputError(f"{pieces[0].file}: tensors of {r.hf!r} are stored in different ways "
                            f"({', '.join(sorted({k[0] for k in kinds}))} with shapes {sorted({k[1] for k in kinds})})")
    source_shape = pieces[0].shape
    layers = stack.stack_shape if inst.stacked else ()
    stack_shape: tuple[int, ...] = ((spec.dim("experts"),) if r.per_expert else ()) + layers
    shapes = []
    for output in r.outputs:
        piece = output_shape(source_shape, output.steps, spec)
        shape, stack_axes = _stacked_shape(piece, r.per_expert, layers, output.layer_axis, spec)
        path = ("params", output.collection) + (stack.path(output.path) if stack is not None else output.path)
        shapes.append((path, shape, stack_axes, output.steps))
    dtype = dtypes.leaf_dtype(dtype, pieces[0].dtype)
    leaf_dtypes = [np.dtype(o.dtype) if o.dtype else dtype for o in r.outputs]
    leaf_shapes = tuple(LeafShape(shape, axes, steps, d.itemsize) for (_, shape, axes, steps), d in zip(shapes, leaf_dtypes))
    try:
        tiling = plan_tiling(source_shape, pieces[0].dtype.itemsize, leaf_shapes, stack_shape, spec, devices,
                             order=pieces[0].order, whole=pieces[0].whole_axes)
    except Misaligned as err:
        raise BadInputError(f"{pieces[0].file}: tensor {pieces[0].name!r}: {err}") from None
    leaves = tuple(LeafPlan(path, shape, d, axes, steps, chunk)
                   for (path, shape, axes, steps), chunk, d in zip(shapes, tiling.chunks, leaf_dtypes))
    return Job(r, pieces, inst.positions, source_shape, leaves, tiling)


def _stacked_shape(piece: Shape, per_expert: bool, layers: tuple[int, ...], layer_axis: int,
                   spec: ModelSpec) -> tuple[Shape, tuple[int, ...]]:
    """Experts stack on a new leading axis; scanned layers on ``layer_axis`` (MaxText's scan axis 1
    for parameters) after that, on as many consecutive axes as the stack has (nested scans)."""
    shape, axes = piece, ()
    if per_expert:
        shape, axes = (spec.dim("experts"), *shape), (0,)
    if layers:
        axis = min(layer_axis, len(shape))
        shape = (*shape[:axis], *layers, *shape[axis:])
        axes = tuple(a + len(layers) * (a >= axis) for a in axes) + tuple(range(axis, axis + len(layers)))
    return shape, axes


def _dropped_rows(jobs: tuple[Job, ...], spec: ModelSpec) -> tuple[dict, ...]:
    """Rows a Resize step drops (a vocabulary larger than MaxText's) are named in the report."""
    notes = []
    for job in jobs:
        for step in (s for leaf in job.leaves for s in leaf.steps if isinstance(s, Resize)):
            rows, size = job.source_shape[step.axis], spec.dim(step.size)
            if rows > size:
                info = job.pieces[0]
                notes.append({"what": f"rows {size}..{rows - 1} of {info.name} (MaxText's vocabulary has {size} rows)",
                              "tensors": [info.name], "bytes": (rows - size) * info.nbytes // rows})
    return tuple(notes)
