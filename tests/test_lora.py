"""LoRA adapters: ``convert BASE DST --lora ADAPTER`` (the adapter alone, MaxText 0.2.5's layout) and
``--merge-lora`` (folded into the base), on adapters PEFT itself made and saved.

The expected adapter leaves are computed here the way MaxText 0.2.5's ``to_maxtext`` computes them
(``_process_and_stack_weights``: ``lora_A.T`` and ``lora_B.T``, flat, the query/key transforms on
``lora_B`` head by head, layers stacked on axis 1, cast to the output dtype), not through ckptconv's
rules. The merged checkpoint must equal, bit for bit, the plain conversion of a base whose weights
were replaced by ``W + (alpha/r) B A`` (float32, rounded once).
"""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.families.llama import LLAMA31_ROPE
from tests.conftest import run_cli
from tests.lora_adapters import adapter_tensors, edit_config, make_adapter, write_merged_base
from tests.test_convert import restore

# Skipped without the test extra's peft, found but not imported here (tests/lora_adapters.py imports it where it makes
# an adapter): the memory phase collects this module for test_merge_streams_the_base, which writes its adapter by
# hand, and importing peft (with torch and transformers) is ~6.5 s of a core per collecting worker.
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)

PATHS = {"q_proj": ("self_attention", "query"), "k_proj": ("self_attention", "key"),
         "v_proj": ("self_attention", "value"), "o_proj": ("self_attention", "out"),
         "gate_proj": ("mlp", "wi_0"), "up_proj": ("mlp", "wi_1"), "down_proj": ("mlp", "wo")}
# case -> (model, whether lora_B of q is pre-scaled by 1/sqrt(head_dim), whether q/k take Llama 3.1's RoPE order)
CASES = {
    "qwen3": (synth.SynthModel(model_type="qwen3"), False, False),
    # head_dim 8: 1/sqrt(head_dim) is not a power of two, so the scaling's rounding shows
    "llama3.1": (synth.SynthModel(model_type="llama", tie_word_embeddings=False, head_dim=8,
                                  config_overrides={"rope_scaling": LLAMA31_ROPE}), True, True),
    "mistral": (synth.SynthModel(model_type="mistral", tie_word_embeddings=False, head_dim=8), True, False),
}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def expected_lora_b(b: np.ndarray, module: str, model: synth.SynthModel, scaled: bool, interleaved: bool) -> np.ndarray:
    """MaxText's ``_process_and_stack_weights`` for one layer's lora_B."""
    w = b.astype(np.float32).T
    if module == "q_proj" and scaled:
        w = w * (1.0 / np.sqrt(model.head_dim))
    if module in ("q_proj", "k_proj") and interleaved:
        heads = model.num_heads if module == "q_proj" else model.num_kv_heads
        work = w.reshape(w.shape[0], heads, model.head_dim)
        half = model.head_dim // 2
        w = np.stack([work[..., :half], work[..., half:]], axis=-1).reshape(w.shape)
    return w


def expected_adapter(adapter, model: synth.SynthModel, scaled: bool, interleaved: bool, scan: bool,
                     dtype) -> dict[str, np.ndarray]:
    pairs = adapter_tensors(adapter)
    leaves = {}
    for module, (block, proj) in PATHS.items():
        per_layer = []
        for layer in range(model.num_layers):
            part = "self_attn" if block == "self_attention" else "mlp"
            a, b = pairs[f"model.layers.{layer}.{part}.{module}.weight"]
            per_layer.append((a.astype(np.float32).T, expected_lora_b(b, module, model, scaled, interleaved)))
        for which, index in (("kernel_lora_a", 0), ("kernel_lora_b", 1)):
            if scan:
                leaves[f"params/params/decoder/layers/{block}/{proj}/{which}/value"] = np.stack(
                    [p[index] for p in per_layer], axis=1).astype(dtype)
            else:
                for layer, p in enumerate(per_layer):
                    name = f"params/params/decoder/layers_{layer}/{block}/{proj}/{which}/value"
                    leaves[name] = p[index].astype(dtype)
    return leaves


@pytest.mark.parametrize("case,scan,devices,dtype", [
    ("qwen3", True, 4, "bfloat16"), ("llama3.1", True, 4, "bfloat16"), ("mistral", False, 1, "bfloat16"),
    ("llama3.1", False, 2, "float32"),
])
def test_adapter_alone_is_maxtext_layout(tmp_path, synth_dir, case, scan, devices, dtype):
    model, scaled, interleaved = CASES[case]
    base = synth_dir(model)
    adapter = make_adapter(base, tmp_path / "adapter")
    dst = tmp_path / "dst"
    layout = ["--scan-layers" if scan else "--no-scan-layers", "--devices", str(devices), "--dtype", dtype]
    result = run_cli("convert", str(base), str(dst), "--lora", str(adapter), "--progress", "none", *layout)
    assert result.returncode == 0, result.stderr
    got = restore(dst)
    assert got.pop("step") == 0
    want = expected_adapter(adapter, model, scaled, interleaved, scan,
                            ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert same_bits(got[name], value), name


@pytest.mark.parametrize("case,scan,devices", [("qwen3", True, 4), ("llama3.1", False, 2)])
def test_merged_is_the_base_with_the_adapter_folded_in(tmp_path, synth_dir, case, scan, devices):
    model, _, _ = CASES[case]
    base = synth_dir(model)
    rank, alpha = 4, 16
    adapter = make_adapter(base, tmp_path / "adapter", rank=rank, alpha=alpha,
                           targets=("q_proj", "v_proj", "down_proj"))
    folded = write_merged_base(base, adapter, tmp_path / "folded", alpha / rank)
    layout = ["--scan-layers" if scan else "--no-scan-layers", "--devices", str(devices), "--progress", "none"]
    merged = run_cli("convert", str(base), str(tmp_path / "merged"), "--lora", str(adapter), "--merge-lora", *layout)
    assert merged.returncode == 0, merged.stderr
    plain = run_cli("convert", str(folded), str(tmp_path / "plain"), *layout)
    assert plain.returncode == 0, plain.stderr
    got, want = restore(tmp_path / "merged"), restore(tmp_path / "plain")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert same_bits(np.asarray(got[name]), np.asarray(value)), name
    # and the adapter changed what it targets (a zero adapter would pass the above trivially)
    original = restore_plain(tmp_path, base, layout)
    query = next(n for n in want if n.endswith("self_attention/query/kernel"))
    assert not np.array_equal(original[query], got[query])


def restore_plain(tmp_path, base, layout):
    result = run_cli("convert", str(base), str(tmp_path / "original"), *layout)
    assert result.returncode == 0, result.stderr
    return restore(tmp_path / "original")


def test_report_rerun_and_adapter_change(tmp_path, synth_dir):
    """The report says what was converted; a rerun is skipped; another adapter at the same path is not."""
    import json

    base = synth_dir()
    adapter = make_adapter(base, tmp_path / "adapter", targets=("q_proj",))
    dst = tmp_path / "dst"
    args = ("convert", str(base), str(dst), "--lora", str(adapter), "--progress", "none")
    assert run_cli(*args).returncode == 0
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert report["lora"] == {"adapter": str(adapter), "mode": "adapter", "layout": "converter", "rank": 4,
                              "alpha": 8.0, "targets": ["q_proj"]}
    assert "nothing to do" in run_cli(*args).stdout
    make_adapter(base, adapter, targets=("q_proj",), seed=1)  # same names and shapes, other values
    again = run_cli(*args)
    assert again.returncode == 2 and "--overwrite" in again.stderr


REFUSALS = [
    ({"use_rslora": True}, "use_rslora=True is refused: rsLoRA scales by alpha/sqrt(r)"),
    ({"use_dora": True}, "use_dora=True is refused: DoRA"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern={'q_proj': 8} is refused: per-module ranks"),
    ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern={'q_proj': 8} is refused: per-module alphas"),
    ({"bias": "all"}, "bias='all' is refused"),
    ({"layers_to_transform": [0]}, "layers_to_transform=[0] is refused"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'; only LORA"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target module 'lm_head' is not a projection"),
    ({"target_modules": ".*q_proj"}, "is a regular expression"),
    ({"auto_mapping": {"base_model_class": "LlamaForCausalLM"}}, "the adapter was trained on LlamaForCausalLM"),
]


@pytest.mark.parametrize("fields,message", REFUSALS, ids=[next(iter(f)) for f, _ in REFUSALS])
def test_what_maxtext_cannot_represent_is_refused(tmp_path, synth_dir, fields, message):
    base = synth_dir()
    adapter = make_adapter(base, tmp_path / "adapter", targets=("q_proj",))
    edit_config(adapter, **fields)
    dst = tmp_path / "dst"
    for merge in ((), ("--merge-lora",)):
        result = run_cli("convert", str(base), str(dst), "--lora", str(adapter), "--progress", "none", *merge)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not dst.exists()


def test_adapter_of_another_model_is_refused(tmp_path, synth_dir):
    """An adapter trained on a wider model: one line naming the tensor and both shapes, exit 2, nothing written."""
    base = synth_dir()
    other = synth_dir(synth.SynthModel(hidden_size=96), name="other")
    adapter = make_adapter(other, tmp_path / "adapter", targets=("q_proj",))
    for merge in ((), ("--merge-lora",)):
        result = run_cli("convert", str(base), str(tmp_path / "dst"), "--lora", str(adapter), "--progress", "none",
                         *merge)
        assert result.returncode == 2
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1 and "lora_A.weight' has shape [4, 96]" in line and "[4, 64]" in line, line
        assert not (tmp_path / "dst").exists()


def test_adapter_of_a_deeper_model_is_refused(tmp_path, synth_dir):
    base = synth_dir()
    deeper = synth_dir(synth.SynthModel(num_layers=3), name="deeper")
    adapter = make_adapter(deeper, tmp_path / "adapter", targets=("q_proj",))
    result = run_cli("convert", str(base), str(tmp_path / "dst"), "--lora", str(adapter), "--progress", "none")
    assert result.returncode == 2, result.stderr
    assert "unexpected tensor" in result.stderr and "layers.2." in result.stderr, result.stderr


def test_pickled_adapter_is_refused_unread(tmp_path, synth_dir):
    base = synth_dir()
    adapter = make_adapter(base, tmp_path / "adapter", targets=("q_proj",))
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    result = run_cli("convert", str(base), str(tmp_path / "dst"), "--lora", str(adapter), "--progress", "none")
    assert result.returncode == 2 and "adapter_model.bin: a pickled adapter; ckptconv never unpickles" in result.stderr


def test_merge_lora_needs_an_adapter(tmp_path, synth_dir):
    result = run_cli("convert", str(synth_dir()), str(tmp_path / "dst"), "--merge-lora")
    assert result.returncode == 2 and "--merge-lora folds an adapter into the base" in result.stderr


def test_rank_and_alpha_scale_the_merge(tmp_path, synth_dir):
    """alpha/r, not alpha alone: the same B A with alpha doubled moves W twice as far (float32, before rounding)."""
    base = synth_dir(synth.SynthModel(dtype="float32"))
    adapter = make_adapter(base, tmp_path / "adapter", rank=2, alpha=2, targets=("q_proj",))
    common = ("--no-scan-layers", "--devices", "1", "--dtype", "float32", "--progress", "none")
    assert run_cli("convert", str(base), str(tmp_path / "plain"), *common).returncode == 0
    assert run_cli("convert", str(base), str(tmp_path / "one"), "--lora", str(adapter), "--merge-lora",
                   *common).returncode == 0
    edit_config(adapter, lora_alpha=4)
    assert run_cli("convert", str(base), str(tmp_path / "two"), "--lora", str(adapter), "--merge-lora",
                   *common).returncode == 0
    leaf = "params/params/decoder/layers_0/self_attention/query/kernel"
    plain, one, two = (restore(tmp_path / d)[leaf] for d in ("plain", "one", "two"))
    np.testing.assert_allclose(two - plain, 2 * (one - plain), rtol=1e-4, atol=1e-6)
    assert np.abs(one - plain).max() > 0


def peft_logits(base, adapter) -> np.ndarray:
    """Logits of the HF base with the adapter loaded by PEFT, float32, on a fixed batch of tokens."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    tokens = torch.tensor(np.random.default_rng(1).integers(0, 512, size=(2, 24)))
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().numpy()


@pytest.mark.parametrize("case,scan,devices", [("qwen3", True, 4), ("llama3.1", True, 2), ("mistral", False, 1)])
def test_export_gives_back_a_peft_adapter(tmp_path, synth_dir, case, scan, devices):
    """convert --lora then export: PEFT loads the result onto the HF base with the original adapter's logits."""
    model, _, _ = CASES[case]
    base = synth_dir(model)
    adapter = make_adapter(base, tmp_path / "adapter", rank=4, alpha=16)
    dst, back = tmp_path / "dst", tmp_path / "back"
    layout = ("--scan-layers" if scan else "--no-scan-layers", "--devices", str(devices), "--dtype", "float32",
              "--progress", "none")
    assert run_cli("convert", str(base), str(dst), "--lora", str(adapter), *layout).returncode == 0
    result = run_cli("export", str(dst), str(back), "--like", str(base), "--dtype", "float32", "--progress", "none")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in back.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                       "ckptconv-report.json"]
    original, exported = adapter_tensors(adapter), adapter_tensors(back)
    assert sorted(original) == sorted(exported)
    for name, (a, b) in original.items():
        assert same_bits(exported[name][0], a), name  # lora_A only moves
        np.testing.assert_allclose(exported[name][1], b, rtol=1e-6, atol=0)  # lora_B: scaled and back, in float32
    want, got = peft_logits(base, adapter), peft_logits(base, back)
    assert np.abs(want - got).max() <= 1e-4
    assert np.abs(want - peft_logits_without_adapter(base)).max() > 1e-3  # the adapter does change the logits


def peft_logits_without_adapter(base) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    tokens = torch.tensor(np.random.default_rng(1).integers(0, 512, size=(2, 24)))
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().numpy()


def test_export_needs_the_alpha(tmp_path, synth_dir):
    """An adapter checkpoint that does not record its alpha (MaxText's converter writes none): export asks for it."""
    import json

    base = synth_dir()
    adapter = make_adapter(base, tmp_path / "adapter", targets=("q_proj", "v_proj"), alpha=12)
    dst = tmp_path / "dst"
    assert run_cli("convert", str(base), str(dst), "--lora", str(adapter), "--progress", "none").returncode == 0
    meta = dst / "0" / "_CHECKPOINT_METADATA"
    recorded = json.loads(meta.read_text())
    assert recorded["custom_metadata"]["lora"] == {"lora_rank": 4, "lora_alpha": 12.0}  # as MaxText's LoRA training
    recorded["custom_metadata"].pop("lora")
    meta.write_text(json.dumps(recorded))
    refused = run_cli("export", str(dst), str(tmp_path / "back"), "--like", str(base), "--progress", "none")
    assert refused.returncode == 2 and "records no LoRA alpha" in refused.stderr and "--lora-alpha" in refused.stderr
    assert not (tmp_path / "back").exists()
    given = run_cli("export", str(dst), str(tmp_path / "back"), "--like", str(base), "--lora-alpha", "12",
                    "--progress", "none")
    assert given.returncode == 0, given.stderr
    config = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 12.0, ["q_proj", "v_proj"])


def test_export_refuses_an_adapter_of_another_model(tmp_path, synth_dir):
    base = synth_dir()
    other = synth_dir(synth.SynthModel(hidden_size=96), name="other")
    adapter = make_adapter(base, tmp_path / "adapter", targets=("q_proj",))
    dst = tmp_path / "dst"
    assert run_cli("convert", str(base), str(dst), "--lora", str(adapter), "--progress", "none").returncode == 0
    result = run_cli("export", str(dst), str(tmp_path / "back"), "--like", str(other), "--progress", "none")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "kernel_lora_a/value' has shape" in result.stderr or "was converted with" in result.stderr, result.stderr


def test_restore_layout_is_rooted_where_maxtext_lora_training_reads(tmp_path, synth_dir):
    """--lora-layout restore: the LoRA tree at the root of items (MaxText's lora_restore_path reads the model's own
    LoRA paths there; bench/maxtext_lora_restore.py), rank and alpha in the metadata; export reads it back."""
    import json

    base = synth_dir()
    adapter = make_adapter(base, tmp_path / "adapter", targets=("q_proj", "o_proj"))
    converter, rooted = tmp_path / "converter", tmp_path / "rooted"
    common = ("--devices", "2", "--progress", "none")
    assert run_cli("convert", str(base), str(converter), "--lora", str(adapter), *common).returncode == 0
    result = run_cli("convert", str(base), str(rooted), "--lora", str(adapter), "--lora-layout", "restore", *common)
    assert result.returncode == 0, result.stderr
    got, want = restore(rooted), restore(converter)
    want.pop("step")
    assert sorted(got) == sorted(name.removeprefix("params/params/") for name in want)
    for name, value in want.items():
        assert same_bits(got[name.removeprefix("params/params/")], value), name
    meta = json.loads((rooted / "0" / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
    assert meta["lora"] == {"lora_rank": 4, "lora_alpha": 8.0}
    back = tmp_path / "back"
    assert run_cli("export", str(rooted), str(back), "--like", str(base), "--progress", "none").returncode == 0
    assert sorted(adapter_tensors(back)) == sorted(adapter_tensors(adapter))
    refused = run_cli("convert", str(base), str(tmp_path / "m"), "--lora", str(adapter), "--merge-lora",
                      "--lora-layout", "restore", *common)
    assert refused.returncode == 2 and "--lora-layout restore places an adapter written alone" in refused.stderr


ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
# Families whose adapters ckptconv does not convert yet, and why (docs/lora.md).
NO_LORA = {"deepseek_v4": "transformers renames DeepSeek-V4's modules when it loads the release (its conversion "
                          "mapping), so a PEFT adapter names modules the hub's files do not hold"}


def _families():
    from ckptconv.families import FAMILIES

    return [pytest.param(family, id=family.name, marks=[pytest.mark.skip(NO_LORA[family.name])]
                         if family.name in NO_LORA else []) for family in FAMILIES]


@pytest.mark.parametrize("family", _families())
def test_every_family_converts_and_exports_its_adapter(tmp_path, family):
    """Derived from the registry: an adapter on each family's projections (attention; the MLP too where it is dense)
    converts and exports back to the same tensors. A vision tower's LoRA is reported, not converted, as the base's."""
    import json

    from ckptconv.families.lora import targets

    model = synth.for_family(family, family.synthetic.round_trip[0].model)
    base = tmp_path / "hf"
    synth.write_checkpoint(model, str(base))
    modules = set(targets(family))
    chosen = sorted(modules if not model.num_experts else modules & ATTENTION)
    adapter = make_adapter(base, tmp_path / "adapter", targets=chosen)
    dst, back = tmp_path / "dst", tmp_path / "back"
    result = run_cli("convert", str(base), str(dst), "--lora", str(adapter), "--devices", "2", "--dtype", "float32",
                     "--progress", "none")
    assert result.returncode == 0, result.stderr
    result = run_cli("export", str(dst), str(back), "--like", str(base), "--dtype", "float32", "--progress", "none")
    assert result.returncode == 0, result.stderr

    def text_name(name: str) -> str:  # the text decoder's tensors under the names the base stores them
        return (name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
                .replace("thinker.model.", "model."))

    original = {text_name(n): pair for n, pair in adapter_tensors(adapter).items() if "vision" not in n
                and "visual" not in n and "audio_tower" not in n}
    exported = {text_name(n): pair for n, pair in adapter_tensors(back).items()}
    assert sorted(exported) == sorted(original)
    for name, (a, b) in original.items():
        assert same_bits(exported[name][0], a), name
        np.testing.assert_allclose(exported[name][1], b, rtol=1e-6, atol=0)
    skipped = len(adapter_tensors(adapter)) - len(original)
    if skipped:
        report = json.loads((dst / "ckptconv-report.json").read_text())
        assert any("(LoRA)" in entry["what"] for entry in report["not_converted"]), report["not_converted"]


def test_target_modules_name_suffix_or_all_linear():
    """PEFT's target_modules: module names, dotted suffixes of them, or all-linear (every projection)."""
    from ckptconv.errors import BadInputError
    from ckptconv.families import BY_MODEL_TYPE
    from ckptconv.plan.lora import choose_targets
    from ckptconv.read.adapter import AdapterConfig

    family = BY_MODEL_TYPE["qwen3"]

    def chosen(*names):
        return [t.module for t in choose_targets(family, AdapterConfig(4, 8.0, names, None), "cfg")]

    assert chosen("all-linear") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert chosen("self_attn.q_proj", "down_proj") == ["q_proj", "down_proj"]  # the family's order
    with pytest.raises(BadInputError, match="target module 'mlp.q_proj' is not a projection"):
        chosen("mlp.q_proj")


@pytest.mark.memory
def test_merge_streams_the_base(tmp_path, synth_dir):
    """Merged at Qwen3-0.6B widths (4 layers): the peak stays within plan's prediction and near a plain conversion's
    (the adapter is read region by region beside the base, never held whole)."""
    import json

    from tests.lora_adapters import write_peft_adapter

    model = synth.SynthModel(model_type="qwen3", vocab_size=8192, hidden_size=1024, num_layers=4, num_heads=16,
                             num_kv_heads=8, head_dim=128, intermediate_size=3072)
    base = synth_dir(model)
    write_peft_adapter(model, tmp_path / "adapter", rank=64, alpha=32)
    common = ("--devices", "4", "--progress", "none")
    assert run_cli("convert", str(base), str(tmp_path / "plain"), *common).returncode == 0
    result = run_cli("convert", str(base), str(tmp_path / "merged"), "--lora", str(tmp_path / "adapter"),
                     "--merge-lora", *common)
    assert result.returncode == 0, result.stderr
    plain, merged = (json.loads((tmp_path / d / "ckptconv-report.json").read_text()) for d in ("plain", "merged"))
    assert merged["peak_rss_bytes"] <= merged["predicted_peak_rss_bytes"]
    assert merged["peak_rss_bytes"] <= plain["peak_rss_bytes"] + 64 * 2**20
