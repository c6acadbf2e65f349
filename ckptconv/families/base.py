"""The vocabulary model families are written in.

A family is data:
- ``read_spec``: ``config.json`` -> :class:`~ckptconv.read.spec.ModelSpec` (its own fields; unknown ones fail);
- ``rules``: which HF tensor (a name template over ``{layer}`` and ``{expert}``, with a shape in
  named dimensions) feeds which MaxText leaves, through which transform steps. A rule may have
  several outputs (one HF tensor -> two leaves) and is read once for all of them;
- ``layout``: the :class:`LayerStack` s that place HF layers in MaxText's tree, scanned or not
  (Llama: one stack ``decoder/layers``; Gemma 3: six block stacks plus a remainder; Gemma 2:
  local and global stacks of alternating layers);
- what the checkpoint may hold that MaxText's layout does not (a vision tower), reported, not written;
- ``synthetic``: how to write a small checkpoint of the family (its ``config.json`` in the hub's form for
  given sizes) and the named examples the test suite derives its round-trip, logit and memory cases
  from, so a new family is its own file and the tests follow from the registry.

The planner derives every leaf (name, shape, sources) from these; scanned and unscanned
layouts come from the same rules, so they can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from ckptconv.families.inputs import ExpertJoin, Join
from ckptconv.families.transforms import Step
from ckptconv.read.spec import ConfigReader, ModelSpec

LAYER = "{layer}"
EXPERT = "{expert}"


class LayoutError(ValueError):
    """A model MaxText cannot hold in the asked layout (the planner names config.json and refuses)."""


class UnscannedOnly(LayoutError):
    """A model MaxText's code runs unscanned only, whatever its converter writes: without ``--scan-layers`` the
    planner lays it out unscanned (the report says so); an explicit ``--scan-layers`` is refused with this reason,
    because no checkpoint in the scanned layout could ever load."""


def always(spec: ModelSpec) -> bool:
    return True


def never(spec: ModelSpec) -> bool:
    return False


def untied(spec: ModelSpec) -> bool:
    return not spec.value("tie_word_embeddings")


MULTIMODAL = "multimodal"  # the spec value ``convert --multimodal`` sets (MaxText's use_multimodal)


def multimodal(spec: ModelSpec) -> bool:
    """The encoders' rules (vision, audio) are active only with ``--multimodal``, as MaxText converts them only
    with ``use_multimodal=true``; without it their tensors are reported, not written."""
    return bool(spec.values.get(MULTIMODAL))


@dataclass(frozen=True)
class Output:
    """One leaf a rule writes: its MaxText path and the steps from the HF tensor to it.

    ``collection``: the variable collection the leaf lives in, stored as
    ``items/params/<collection>/...`` (every family writes ``params``: MaxText's inference loader
    reads no other). Scanned, MaxText stacks parameters' layers on axis 1 and other variables'
    (DeepSeek's router bias, a ``MoEBiasVar``) on axis 0 (``layer_axis``).
    """

    path: tuple[str, ...]
    steps: tuple[Step, ...] = ()
    collection: str = "params"
    layer_axis: int = 1
    dtype: str | None = None  # the leaf's own dtype whatever --dtype (a constant MaxText writes in float32)


@dataclass(frozen=True)
class Rule:
    """HF tensor ``hf`` -> the leaves ``outputs``.

    ``hf`` may hold ``{layer}`` (a layer rule: paths are below the layer stack's prefix) and
    ``{expert}`` (one tensor per expert, stacked on a leading expert axis of each leaf).
    ``hf_shape`` names dimensions of the spec. ``kinds``: the layer kinds the rule applies to
    (None: every decoder layer), for models whose layers differ (DeepSeek's dense and MoE layers)
    and for an encoder's layers (a vision tower's: see :attr:`LayerStack.encoder`).
    ``when`` false: the rule is inactive and its tensor, if present, is reported, not written
    (``lm_head.weight`` of a tied model).
    """

    hf: str
    hf_shape: tuple[str, ...]
    outputs: tuple[Output, ...]
    when: Callable[[ModelSpec], bool] = always
    kinds: frozenset[str] | None = None
    note: str = ""  # why an inactive rule's tensor is not written (for the report)
    integer: bool = False  # the tensor holds integers (DeepSeek-V4's token -> expert table), written as --dtype

    @property
    def per_layer(self) -> bool:
        return LAYER in self.hf

    @property
    def per_expert(self) -> bool:
        return EXPERT in self.hf


def rule(hf: str, maxtext: tuple[str, ...], hf_shape: tuple[str, ...], steps: tuple[Step, ...] = (),
         when: Callable[[ModelSpec], bool] = always, kinds: frozenset[str] | None = None, note: str = "") -> Rule:
    """The common case: one HF tensor -> one leaf."""
    return Rule(hf, hf_shape, (Output(maxtext, steps),), when, kinds, note)


@dataclass(frozen=True)
class LayerStack:
    """HF ``layers`` placed under MaxText ``prefix``.

    ``stacked``: one leaf per rule output with the layers on MaxText's scan axis (axis 1), in
    the order given; otherwise exactly one layer with plain leaves. ``suffix`` is appended to
    the first component of every rule path (Gemma 2: ``self_attention`` -> ``self_attention_local``).
    ``kind`` selects the rules (see :attr:`Rule.kinds`). ``grid``: the layers fill several
    consecutive scan axes instead of one, row-major (MaxText's nested scans: Qwen3-Next's
    ``local_layers`` are (blocks, linear layers per block) on axes (1, 2)).

    ``encoder``: the layers of an encoder beside the decoder (``--multimodal``: Gemma 3's SigLIP tower). Its
    ``layers`` are the encoder's own indices (``{layer}`` in its rules counts the tower's layers, which the
    decoder's ``num_layers`` says nothing about), and only rules naming its ``kind`` apply to it: the decoder's
    kind-less rules (``kinds=None``) would otherwise be asked for in every vision layer.
    """

    prefix: tuple[str, ...]
    layers: tuple[int, ...]
    stacked: bool
    suffix: str = ""
    kind: str = "decoder"
    grid: tuple[int, ...] = ()
    encoder: bool = False

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The scan axes the layers fill (empty when not stacked)."""
        if not self.stacked:
            return ()
        return self.grid or (len(self.layers),)

    def position(self, j: int) -> tuple[int, ...]:
        """The ``j``-th layer's index on the scan axes."""
        if not self.stacked:
            return ()
        if not self.grid:
            return (j,)
        index = []
        for size in reversed(self.grid):
            j, i = divmod(j, size)
            index.append(i)
        return tuple(reversed(index))

    def path(self, rule_path: tuple[str, ...]) -> tuple[str, ...]:
        head = rule_path[0] + self.suffix
        return (*self.prefix, head, *rule_path[1:])


def applies(r: Rule, stack: LayerStack) -> bool:
    """Whether layer rule ``r`` reads (and writes) the layers of ``stack``: the kinds it names, or, naming none,
    every decoder stack (never an encoder's)."""
    return stack.kind in r.kinds if r.kinds is not None else not stack.encoder


def uniform_layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """Every layer alike: ``decoder/layers`` (scanned) or ``decoder/layers_{i}``."""
    layers = tuple(range(spec.num_layers))
    if scan:
        return (LayerStack(("decoder", "layers"), layers, True),)
    return tuple(LayerStack(("decoder", f"layers_{i}"), (i,), False) for i in layers)


def block_layout(period: int, name: str = "layers") -> Callable[[ModelSpec, bool], tuple[LayerStack, ...]]:
    """Layers in repeating blocks of ``period`` (Gemma 3: 5 local + 1 global; gpt-oss: 2).

    Scanned, MaxText scans whole blocks: block position ``b`` is the stack
    ``decoder/layers/{name}_{b}`` over HF layers ``b, b + period, ...``; the layers after the
    last whole block are ``decoder/layers_remainder/layers_{r}``, unscanned.
    """

    def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
        if not scan:
            return uniform_layout(spec, scan)
        whole = spec.num_layers - spec.num_layers % period
        stacks = [LayerStack(("decoder", "layers", f"{name}_{b}"), tuple(range(b, whole, period)), True)
                  for b in range(period) if whole]
        stacks += [LayerStack(("decoder", "layers_remainder", f"layers_{r}"), (whole + r,), False)
                   for r in range(spec.num_layers - whole)]
        return tuple(stacks)

    return layout


class Sizes(Protocol):
    """The sizes a synthetic checkpoint is written with (``ckptconv.commands.synth.SynthModel``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    num_experts: int
    moe_intermediate_size: int
    quantization: str | None
    dtype: str


@dataclass(frozen=True)
class Example:
    """A small model of the family that a test derived from the registry builds and converts.

    ``model``: ``SynthModel`` fields (``model_type`` defaults to the family's first); ``name`` is the
    test's id, unique across families. ``scan``/``devices``: how the test converts it (a round trip
    converts both scanned and not, on ``devices``). ``rounded``: tensor name endings a bfloat16 round
    trip gives back within one bfloat16 step rather than bit for bit (Gemma's ``1 + w`` norms).
    ``reference`` (logit examples): what the converted leaves are checked against. ``transformers``: its logits,
    which MaxText's forward pass on the leaves must reproduce (tests/test_logits.py). ``maxtext``: MaxText 0.2.5's
    own conversion of the same checkpoint, leaf by leaf (digests its bench driver recorded,
    ``tests/data/maxtext_leaves/<name>.json``; tests/test_maxtext_leaves.py), for a family whose MaxText forward
    pass does not reproduce transformers' logits even on MaxText's own conversion (DeepSeek-V4).
    ``multimodal``: the model is synthesised with its encoders (``Family.encoders``, as the hub ships them) and
    converted with ``--multimodal``; the derived tests then cover the encoders' leaves too (the round trip gives
    them back bit for bit; the logits show the text decoder is unchanged beside them).
    """

    name: str
    model: Mapping[str, Any] = field(default_factory=dict)
    scan: bool = True
    devices: int = 1
    rounded: tuple[str, ...] = ()
    reference: str = "transformers"
    multimodal: bool = False


MIB, GIB = 2**20, 2**30  # for the examples' byte counts


class _JsonNull:
    """A field a synthetic ``config.json`` writes as ``null`` (None means: leave the field out)."""

    def __repr__(self) -> str:
        return "JSON_NULL"


JSON_NULL = _JsonNull()  # DeepSeek-V2-Lite's "q_lora_rank": null (absent would mean transformers' default rank)


@dataclass(frozen=True)
class MemoryExample:
    """A peak-memory case: ``model`` converted (a fresh process per device count in ``devices``) peaks no
    higher than ``plan`` predicts, and the prediction is tight (the test's bounds).

    ``fewer``: the same widths with fewer layers or experts, converted first on ``devices[0]``: the
    peak must not grow past its peak, and ``model`` must hold at least ``more_bytes`` more. ``bound``:
    bytes the peak stays under; ``source_bytes``: how big the source at least is (the case really is
    wide). ``full``: the whole release's config.json, planned with header-only files: its prediction
    must be no more than the case's.
    """

    name: str
    model: Mapping[str, Any]
    devices: tuple[int, ...] = (16,)
    fewer: Mapping[str, Any] | None = None
    more_bytes: int = 0
    bound: int | None = None
    source_bytes: int = 0
    full: Mapping[str, Any] | None = None
    max_shard_bytes: int | None = None


@dataclass(frozen=True)
class Synthetic:
    """How to write a synthetic checkpoint of the family, and the examples its tests are derived from.

    ``config``: sizes -> ``config.json`` as the hub ships it (unset fields None, dropped by the writer);
    ``hub_prefixes``: model_type -> (prefix the rules use, prefix the hub stores) where the hub nests the
    decoder (Gemma 3's ``Gemma3ForConditionalGeneration``: ``language_model.model.``). Every family has at
    least one example of each kind (a registry test checks it).
    """

    config: Callable[[Sizes], dict]
    round_trip: tuple[Example, ...] = ()
    logits: tuple[Example, ...] = ()
    memory: tuple[MemoryExample, ...] = ()
    hub_prefixes: Mapping[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """One model family: how its config reads, its rules, and how its layers stack."""

    name: str
    model_types: tuple[str, ...]
    decoder_block: str  # MaxText's ``decoder_block`` for this family (report, README)
    rules: tuple[Rule, ...]
    read_spec: Callable[[ConfigReader], ModelSpec]
    synthetic: Synthetic
    layout: Callable[[ModelSpec, bool], tuple[LayerStack, ...]] = uniform_layout
    # Stored name prefix -> the prefix the rules are written with (checkpoints saved by
    # different transformers versions name the same tensor differently).
    aliases: tuple[tuple[str, str], ...] = ()
    # Name prefixes of tensors MaxText's decoder does not hold, with what they are (per spec:
    # DeepSeek's multi-token-prediction layers follow its last layer).
    not_converted: Callable[[ModelSpec], tuple[tuple[str, str], ...]] = lambda spec: ()
    ignored_hf_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # Tensors the rules read fused that checkpoints may store in parts (Qwen3.5's in_proj_qkv + in_proj_z).
    joins: tuple[Join | ExpertJoin, ...] = ()
    # What ``--multimodal`` adds (its rules are active under :func:`multimodal`): empty for a family whose
    # encoders ckptconv does not convert, where the flag is refused rather than silently ignored.
    encoders: tuple[str, ...] = ()

    def join_for(self, name: str) -> Join | ExpertJoin | None:
        return next((join for join in self.joins if name.endswith(join.fused)), None)

    def active_rules(self, spec: ModelSpec) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.when(spec))

    def canonical(self, name: str) -> str:
        """The name the rules use for a stored tensor name."""
        for stored, canonical in self.aliases:
            if name.startswith(stored):
                return canonical + name[len(stored):]
        return name
