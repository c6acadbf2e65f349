"""Releases as they are shipped: each release's real tensor list and config.json, planned from header-only files.

Every family's other tests build checkpoints from our own reading of a release. Here the fixtures
(``tests/fixtures/releases/<name>.json.gz``, made by ``make_fixture.py`` beside them) hold a real release's tensor
names, shapes and dtypes (from a public dump of its files, or its ``model.safetensors.index.json`` with shapes
derived from config.json where the fixture says so), the file each tensor is in where known, and its config.json;
never a weight. Each is written as sparse safetensors files (headers only) and planned: the plan must succeed,
read every tensor MaxText holds, and name every other one in ``not_converted`` with its reason. ``EXPECTED`` pins,
per release, how many tensors are reported not converted and why, so a tensor silently dropped or newly refused
fails here. A listing of part of a release (``PARTIAL``) is compared with the names, shapes and stored dtypes the
rules derive instead. docs/releases.md lists every release, its sources and what each showed.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import struct
from pathlib import Path

import pytest

from ckptconv import dtypes
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource

FIXTURES = Path(__file__).parent / "fixtures" / "releases"
SHARD_BYTES = 5 * 10**9  # where a listing names no files: the hub's usual shard size


def load(name: str) -> dict:
    """A fixture, its ``rows`` (a report's name patterns) expanded into ``tensors``."""
    with gzip.open(FIXTURES / f"{name}.json.gz", "rt") as f:
        fixture = json.load(f)
    fixture["tensors"].update(expand_rows(fixture.get("rows", ())))
    return fixture


def expand_rows(rows) -> dict[str, list]:
    """A report's rows, ``layers.1-60.mlp.experts.0-383.down_proj.weight_packed`` (index ranges, ``a-b`` or
    ``a-b,c-d``, in any dot-separated part), as one name per index combination -> [dtype, shape]."""
    tensors: dict[str, list] = {}
    for pattern, dtype, shape in rows:
        names = [""]
        for part in pattern.split("."):
            choices = _indices(part) if re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", part) else [part]
            names = [f"{n}.{c}" if n else c for n in names for c in choices]
        tensors.update({name: [dtype, shape] for name in names})
    return tensors


def _indices(part: str) -> list[str]:
    out = []
    for span in part.split(","):
        lo, _, hi = span.partition("-")
        out += [str(i) for i in range(int(lo), int(hi or lo) + 1)]
    return out


def write_release(fixture: dict, directory: Path) -> None:
    """config.json and sparse safetensors files whose headers are the release's: the files the listing names (with
    an index), else one ``model.safetensors`` or shards of ``SHARD_BYTES`` in the listing's order."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fixture["config"]))
    files: dict[str, list[tuple[str, str, list[int]]]] = {}
    names = fixture["files"]
    size, shard = 0, 0
    for name, (dtype, shape, *file) in fixture["tensors"].items():
        nbytes = math.prod(shape) * dtypes.SAFETENSORS[dtype].itemsize
        if file:
            key = names[file[0]]
        else:
            if size and size + nbytes > SHARD_BYTES:
                shard, size = shard + 1, 0
            size += nbytes
            key = shard
        files.setdefault(key, []).append((name, dtype, shape))
    if not names and len(files) > 1:
        files = {f"model-{i + 1:05d}-of-{len(files):05d}.safetensors": entries for i, entries in files.items()}
    elif not names:
        files = {"model.safetensors": files[0]}
    for file, entries in files.items():
        _write_header_only(directory / file, entries)
    if len(files) > 1:
        weight_map = {name: file for file, entries in files.items() for name, _, _ in entries}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _write_header_only(path: Path, entries: list[tuple[str, str, list[int]]]) -> None:
    header, offset = {}, 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtypes.SAFETENSORS[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(data)) + data)
        f.truncate(8 + len(data) + offset)  # sparse: the plan reads headers only


def not_converted(plan) -> dict[str, int]:
    """What the plan reports not converted: reason -> number of tensors."""
    counts: dict[str, int] = {}
    for entry in plan.not_converted:
        n = entry["tensors"] if isinstance(entry["tensors"], int) else len(entry["tensors"])
        counts[entry["what"]] = counts.get(entry["what"], 0) + n
    return counts


# Per release: the tensors reported not converted, by the start of their reason (what the report says), and how
# many. Every other tensor the release holds is read into MaxText's tree (the plan refuses any it cannot place).
EXPECTED: dict[str, dict[str, int]] = {
    "gemma-4-E2B-it": {"audio tower": 751, "audio projector": 1, "vision tower": 658, "vision projector": 1,
                       "keys and values of a KV-shared layer": 60},
    "gpt-oss-20b": {},
    "Qwen3-0.6B": {"tied embeddings": 1},  # the release stores lm_head.weight beside tie_word_embeddings: true
    "Kimi-K2.5": {"multimodal projector": 6, "vision tower": 329},
    "Kimi-K2.6": {"multimodal projector": 6, "vision tower": 329},
    "DeepSeek-V3.2": {"multi-token prediction": 1571},
    "Qwen3.5-35B-A3B": {"multi-token prediction": 785, "vision tower": 333},
    "Qwen3-Next-80B-A3B-Instruct": {"multi-token prediction": 1553},
    "gemma-4-31B-it": {"vision projector": 1, "vision tower": 355},
    "Qwen3-VL-30B-A3B-Instruct": {"vision tower": 351},
    "DeepSeek-V3": {"multi-token prediction": 1564},
    "Llama-3.1-8B-Instruct": {},
    "DeepSeek-V4-Pro": {"multi-token prediction": 2343},
    "Kimi-K2-Instruct": {"rotary embedding buffers": 61},  # each layer stores its rotary_emb.inv_freq
    "Qwen3-30B-A3B-Instruct-2507": {},
    "Qwen3-VL-8B-Instruct": {"vision tower": 351},
    "Qwen3-Omni-30B-A3B-Instruct": {"audio tower": 525, "vision tower": 351, "talker": 8037, "code2wav": 230},
    "Qwen2.5-7B-Instruct": {},
    "DeepSeek-V2-Lite-Chat": {},
}
# The same releases converted with --multimodal where their family converts the encoders as MaxText does: what
# is then left out (the encoders' tensors are all read).
EXPECTED_MULTIMODAL: dict[str, dict[str, int]] = {
    "gemma-4-31B-it": {},
    "Qwen3.5-35B-A3B": {"multi-token prediction": 785},
    "Qwen3-VL-30B-A3B-Instruct": {},
    "Qwen3-VL-8B-Instruct": {},
    "Qwen3-Omni-30B-A3B-Instruct": {"talker": 8037, "code2wav": 230},
}


# SynthModel's name for each quantisation scheme config.json's quantization_config reads as
SCHEMES = {"fp8-block-128": "fp8", "fp8-block-128-kept": "fp8", "fp8-channel": "fp8", "mxfp4": "mxfp4",
           "int4-group-32": "int4"}


def derive(config: dict, names: list[str]) -> tuple[dict[str, list], list[str]]:
    """name -> [dtype, shape] for a listing that names tensors only: every tensor a rule of the family names (active
    or not; encoders included), in its stored form (quantised parts as the release's quantization_config says), with
    the shape config.json implies. Names no rule knows get [BF16, [1]] and are returned apart."""
    from dataclasses import replace

    from ckptconv.commands.synth import _Release, _stored_entries
    from ckptconv.families import family_for
    from ckptconv.families.base import MULTIMODAL, LayoutError
    from ckptconv.plan.conversion import expected_tensors, read_spec

    family = family_for(config.get("model_type"), "config.json")
    spec = read_spec(family, config, "config.json")
    if family.encoders:
        spec = replace(spec, values={**spec.values, MULTIMODAL: True})
    try:
        stacks = family.layout(spec, False)
    except LayoutError:
        stacks = family.layout(spec, True)
    sized = tuple(r for r in family.rules if set(r.hf_shape) <= spec.dims.keys())
    expected = expected_tensors(sized, stacks, spec)
    scheme = spec.values.get("quantization")
    quantization = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config") or {}
    release = _Release(SCHEMES.get(scheme), config["model_type"], scheme == "fp8-block-128-kept", scheme,
                       tuple(quantization.get("ignore", ())))
    stored: dict[str, list] = {}
    for name, (rule, shape) in expected.items():
        join = family.join_for(name)
        parts = join.part_shapes(name, spec, shape) if join is not None else {name: shape}
        for part, part_shape in parts.items():
            for entry in _stored_entries(release, part, tuple(part_shape), "I64" if rule.integer else "BF16", 2):
                stored[entry.name] = [entry.st_dtype, list(entry.shape)]
    shapes, placeholders = {}, []
    for name in names:
        found = stored.get(family.canonical(name)) or stored.get(name)
        if found is None:
            placeholders.append(name)
            found = ["BF16", [1]]
        shapes[name] = found
    return shapes, sorted(placeholders)


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    written: dict[str, Path] = {}

    def write(name: str) -> Path:
        if name not in written:
            written[name] = tmp_path_factory.mktemp(name)
            write_release(load(name), written[name])
        return written[name]
    return write


# Listings of part of a release (a report of an incomplete download): not plannable, so every tensor they hold is
# compared with what ckptconv's rules derive from the release's config.json, name, shape and (quantised) dtype.
PARTIAL = ("DeepSeek-V4-Flash",)
QUANTISED = {"F8_E4M3", "F8_E8M0", "I8", "U8", "I32", "I64"}  # stored forms whose dtype the rules fix exactly


def test_every_fixture_has_its_expectations():
    """A fixture added without saying what it reports, or an expectation without its fixture, fails."""
    assert sorted(p.name.removesuffix(".json.gz") for p in FIXTURES.glob("*.json.gz")) == sorted([*EXPECTED, *PARTIAL])
    assert all(load(name)["partial"] for name in PARTIAL) and not any(load(name).get("partial") for name in EXPECTED)


@pytest.mark.parametrize("name", PARTIAL)
def test_partial_listing_matches_the_rules_names_and_shapes(name):
    """Every tensor of the partial listing is one ckptconv's rules name for the release's config.json, with the
    shape they derive, and, where the rules fix the stored form (FP8 and FP4 parts, integer tables), its dtype."""
    fixture = load(name)
    derived, unknown = derive(fixture["config"], list(fixture["tensors"]))
    assert not unknown, unknown[:5]
    wrong = {n: (t, derived[n]) for n, t in fixture["tensors"].items()
             if t[1] != derived[n][1] or (t[0] in QUANTISED or derived[n][0] in QUANTISED) and t[0] != derived[n][0]}
    assert not wrong, list(wrong.items())[:5]


@pytest.mark.parametrize("name, multimodal", [(name, False) for name in sorted(EXPECTED)]
                         + [(name, True) for name in sorted(EXPECTED_MULTIMODAL)])
def test_release_plans_as_shipped(release_dir, name, multimodal):
    """The release plans (with --multimodal too, where its family converts the encoders); the tensors it does not
    convert are the expected ones, each with its reason."""
    fixture = load(name)
    plan = make_plan(LocalSource(str(release_dir(name))), multimodal=multimodal)
    reported = not_converted(plan)
    expected = (EXPECTED_MULTIMODAL if multimodal else EXPECTED)[name]
    by_reason = {}
    for what, count in reported.items():
        key = next((k for k in expected if what.startswith(k)), what)
        by_reason[key] = by_reason.get(key, 0) + count
    assert by_reason == expected, reported
    read = sum(len(getattr(piece, "parts", (piece,))) for job in plan.jobs for piece in job.pieces)
    assert read + sum(reported.values()) <= len(fixture["tensors"])


@pytest.mark.parametrize("form", ["E2B_TINY", "E4B_TINY"])
def test_gemma4_kv_shared_layers_stored_keys_are_reported_and_change_no_leaf(tmp_path, form):
    """E2B's form as shipped (and E4B's, built the same way): the KV-shared layers still store k_proj, v_proj and
    k_norm. They convert, each reported with its reason, and every leaf is bit-identical to the conversion of the
    same model without them (as MaxText 0.2.5's is)."""
    import numpy as np

    from ckptconv.commands import synth
    from ckptconv.families import gemma4
    from tests.conftest import run_cli
    from tests.test_convert import restore

    fields = getattr(gemma4, form)
    spec = synth.for_family(gemma4.FAMILY, fields)
    text = spec.config()["text_config"]
    layers, shared = text["num_hidden_layers"], text["num_kv_shared_layers"]
    hd, ghd, kv = text["head_dim"], text["global_head_dim"], text["num_key_value_heads"]
    extra = {}
    for i in range(layers - shared, layers):
        width = ghd if text["layer_types"][i] == "full_attention" else hd
        p = f"model.language_model.layers.{i}.self_attn."
        extra |= {p + "k_proj.weight": (kv * width, text["hidden_size"]),
                  p + "v_proj.weight": (kv * width, text["hidden_size"]), p + "k_norm.weight": (width,)}
    outputs = {}
    for name, tensors in (("plain", {}), ("shipped", extra)):
        src, dst = tmp_path / f"{name}-src", tmp_path / f"{name}-dst"
        synth.write_checkpoint(synth.SynthModel(model_type="gemma4", extra_tensors=tensors, **fields), str(src))
        result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "1")
        assert result.returncode == 0, result.stderr
        report = json.loads((dst / "ckptconv-report.json").read_text())
        outputs[name] = (restore(dst), report["not_converted"])
    (plain, plain_notes), (shipped, shipped_notes) = outputs["plain"], outputs["shipped"]
    assert plain.keys() == shipped.keys()
    for leaf in plain:
        np.testing.assert_array_equal(plain[leaf], shipped[leaf], err_msg=leaf)
    assert [n for n in shipped_notes if n not in plain_notes] and all(
        n["what"].startswith("keys and values of a KV-shared layer") for n in shipped_notes if n not in plain_notes)
    reported = {t for n in shipped_notes if n not in plain_notes for t in n["tensors"]}
    assert reported == set(extra)


def _kimi_k25_config() -> dict:
    from ckptconv.commands import synth
    from ckptconv.families import kimi_k25

    return synth.for_family(kimi_k25.FAMILY, {**kimi_k25.K26_WIDTHS, "num_layers": 2}).config()


def test_kimi_k25_identical_quantization_configs_at_the_top_and_in_text_config_read_as_one():
    """Kimi-K2.5's config.json as transformers 5.7 saves it: the same quantization_config at the top and in
    text_config. One setting, read once: the spec is the one either copy alone gives."""
    import copy

    from ckptconv.families import BY_MODEL_TYPE
    from ckptconv.plan.conversion import read_spec

    inner = _kimi_k25_config()
    both = copy.deepcopy(inner)
    both["quantization_config"] = copy.deepcopy(inner["text_config"]["quantization_config"])
    outer = copy.deepcopy(both)
    del outer["text_config"]["quantization_config"]
    family = BY_MODEL_TYPE["kimi_k25"]
    specs = [read_spec(family, config, "config.json") for config in (inner, both, outer)]
    layouts = {json.dumps([s.num_layers, s.dims, s.values], sort_keys=True) for s in specs}
    assert len(layouts) == 1 and specs[1].values["quantization"] is not None


@pytest.mark.parametrize("field, value, shown", [
    ("ignore", ["re:.*lm_head"], "['re:.*lm_head'] at the top"),
    ("config_groups.group_0.weights.observer", "mse",
     "differ at config_groups.group_0.weights.observer: 'mse' at the top, 'minmax' in text_config"),
])
def test_kimi_k25_differing_quantization_configs_are_refused_naming_both(field, value, shown):
    import copy

    from ckptconv.errors import BadInputError
    from ckptconv.families import BY_MODEL_TYPE
    from ckptconv.plan.conversion import read_spec

    config = _kimi_k25_config()
    config["quantization_config"] = top = copy.deepcopy(config["text_config"]["quantization_config"])
    *parents, last = field.split(".")
    for key in parents:
        top = top[key]
    top[last] = value
    with pytest.raises(BadInputError, match="quantization_config in both config.json and its text_config") as err:
        read_spec(BY_MODEL_TYPE["kimi_k25"], config, "config.json")
    assert shown in str(err.value) and "which one holds is unclear" in str(err.value)


@pytest.mark.parametrize("field, value", [("add_cross_attention", True), ("pruned_heads", {"0": [1]}),
                                          ("tie_encoder_decoder", True), ("is_decoder", True)])
def test_transformers_generic_settings_that_change_weights_are_refused_unless_inert(field, value):
    """Kimi-K2.5's text_config as transformers prints it holds PretrainedConfig's generic settings: at their inert
    defaults they read as bookkeeping (the release plans above); a value that would add or remove weights is
    refused, naming the field."""
    from ckptconv.errors import BadInputError
    from ckptconv.families import BY_MODEL_TYPE
    from ckptconv.plan.conversion import read_spec

    config = load("Kimi-K2.5")["config"]
    assert config["text_config"][field] in ({}, False)
    config["text_config"][field] = value
    with pytest.raises(BadInputError, match=f"text_config: field '{field}' = .* is not supported"):
        read_spec(BY_MODEL_TYPE["kimi_k25"], config, "config.json")


def test_qwen3_next_sliding_window_is_read_off_and_refused_on():
    """transformers 5 prints Qwen3-Next's config with use_sliding_window: false (the release plans above); true would
    be attention MaxText's qwen3-next decoder does not run: refused by name."""
    from ckptconv.errors import BadInputError
    from ckptconv.families import BY_MODEL_TYPE
    from ckptconv.plan.conversion import read_spec

    config = load("Qwen3-Next-80B-A3B-Instruct")["config"]
    read_spec(BY_MODEL_TYPE["qwen3_next"], config, "config.json")
    with pytest.raises(BadInputError, match="'use_sliding_window' = True is not supported"):
        read_spec(BY_MODEL_TYPE["qwen3_next"], {**config, "use_sliding_window": True}, "config.json")


def test_gemma4_expert_intermediate_size_read_off_and_refused_when_it_contradicts():
    """transformers 5.7 prints Gemma 4's text_config with expert_intermediate_size (null in gemma-4-31B-it, which
    plans above). In a MoE model a value other than moe_intermediate_size is refused, naming both."""
    from ckptconv.commands import synth
    from ckptconv.errors import BadInputError
    from ckptconv.families import BY_MODEL_TYPE, gemma4
    from ckptconv.plan.conversion import read_spec

    config = synth.for_family(gemma4.FAMILY, gemma4.MOE_TINY).config()
    moe = config["text_config"]["moe_intermediate_size"]
    config["text_config"]["expert_intermediate_size"] = moe
    assert read_spec(BY_MODEL_TYPE["gemma4"], config, "config.json").dim("moe_mlp") == moe
    config["text_config"]["expert_intermediate_size"] = 2 * moe
    with pytest.raises(BadInputError, match=f"expert_intermediate_size={2 * moe} differs from moe_intermediate_size"):
        read_spec(BY_MODEL_TYPE["gemma4"], config, "config.json")


@pytest.mark.parametrize("field, value", [("shared_expert_intermediate_size", 768), ("use_qk_norm", False),
                                          ("use_sliding_window", True)])
def test_qwen3_omni_printed_text_fields_read_at_the_release_values_only(field, value):
    """transformers 5.7 prints Qwen3-Omni's thinker text_config with shared_expert_intermediate_size 0, use_qk_norm
    true and use_sliding_window false (the release plans above); other values would mean other weights or attention,
    refused by name."""
    import copy

    from ckptconv.errors import BadInputError
    from ckptconv.families import BY_MODEL_TYPE
    from ckptconv.plan.conversion import read_spec

    config = copy.deepcopy(load("Qwen3-Omni-30B-A3B-Instruct")["config"])
    config["thinker_config"]["text_config"][field] = value
    with pytest.raises(BadInputError, match=f"text_config: field '{field}' = .* is not supported"):
        read_spec(BY_MODEL_TYPE["qwen3_omni_moe"], config, "config.json")
