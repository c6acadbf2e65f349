"""The family registry: complete, consistent, and producing exactly MaxText's leaf names and shapes."""

import json

import pytest

from ckptconv import synth
from ckptconv.errors import BadInputError
from ckptconv.families import BY_MODEL_TYPE, FAMILIES, family_for
from ckptconv.plan import make_plan
from ckptconv.sources import LocalSource
from ckptconv.spec import ConfigReader

MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3"]


def maxtext_leaves(model_type: str, m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    """MaxText's parameter tree for a dense decoder, restated from its docs/converter (not from our tables)."""
    emb, L, nq, nkv, hd, mlp, vocab = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                                       m.intermediate_size, m.vocab_size)
    layer = {
        "self_attention/query/kernel": (emb, nq, hd),
        "self_attention/key/kernel": (emb, nkv, hd),
        "self_attention/value/kernel": (emb, nkv, hd),
        "self_attention/out/kernel": (nq, hd, emb),
        "pre_self_attention_layer_norm/scale": (emb,),
        "post_self_attention_layer_norm/scale": (emb,),
        "mlp/wi_0/kernel": (emb, mlp),
        "mlp/wi_1/kernel": (emb, mlp),
        "mlp/wo/kernel": (mlp, emb),
    }
    if model_type == "qwen3":
        layer |= {"self_attention/query_norm/scale": (hd,), "self_attention/key_norm/scale": (hd,)}
    if model_type == "qwen2":
        layer |= {"self_attention/query/bias": (nq, hd), "self_attention/key/bias": (nkv, hd),
                  "self_attention/value/bias": (nkv, hd)}
    leaves = {"params/params/token_embedder/embedding": (vocab, emb), "params/params/decoder/decoder_norm/scale": (emb,)}
    if not m.tie_word_embeddings:
        leaves["params/params/decoder/logits_dense/kernel"] = (emb, vocab)
    for name, shape in layer.items():
        if scan:
            leaves[f"params/params/decoder/layers/{name}"] = (shape[0], L, *shape[1:])
        else:
            leaves |= {f"params/params/decoder/layers_{i}/{name}": shape for i in range(L)}
    return leaves


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_plan_matches_maxtext_tree(tmp_path, model_type, tied, scan):
    model = synth.SynthModel(model_type=model_type, tie_word_embeddings=tied, num_layers=3)
    synth.write_checkpoint(model, str(tmp_path))
    plan = make_plan(LocalSource(str(tmp_path)), scan_layers=scan, devices=4)
    assert {leaf.name: leaf.shape for leaf in plan.leaves} == maxtext_leaves(model_type, model, scan)
    assert plan.tensor_count == len(synth.tensor_shapes(model))


def test_registry_is_consistent():
    assert len(BY_MODEL_TYPE) == sum(len(f.model_types) for f in FAMILIES), "a model_type is claimed twice"
    for family in FAMILIES:
        hf_names = [rule.hf for rule in family.rules]
        assert len(hf_names) == len(set(hf_names)), family.name
        targets = [(rule.per_layer, rule.maxtext) for rule in family.rules]
        assert len(targets) == len(set(targets)), family.name
        for rule in family.rules:
            assert rule.hf_shape and all(isinstance(d, str) for d in rule.hf_shape)


TRANSFORMERS_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_configs_written_by_transformers_parse(model_type):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, TRANSFORMERS_CONFIGS[model_type])(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)
    data = json.loads(config.to_json_string())
    family = family_for(data["model_type"], "config.json")
    spec = family.read_spec(ConfigReader(data, "config.json", family.extra_config_fields))
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (64, 4, 2, 16)


def test_llama3_rope_scaling_turns_on_interleave():
    llama31 = synth.SynthModel(model_type="llama", config_overrides={"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    family = BY_MODEL_TYPE["llama"]
    assert family.read_spec(ConfigReader(llama31.config(), "c", frozenset())).interleave_rope
    llama2 = synth.SynthModel(model_type="llama")
    assert not family.read_spec(ConfigReader(llama2.config(), "c", frozenset())).interleave_rope


@pytest.mark.parametrize("field, value, message", [
    ("quantization_config", {"bits": 4}, "unknown field(s) 'quantization_config'"),
    ("hidden_act", "gelu", "'hidden_act' = 'gelu' is not supported"),
    ("attention_bias", True, "'attention_bias' = True is not supported"),
    ("num_hidden_layers", 0, "'num_hidden_layers' must be a positive integer"),
])
def test_config_errors_name_the_field(field, value, message):
    config = synth.SynthModel(model_type="llama").config() | {field: value}
    with pytest.raises(BadInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BY_MODEL_TYPE["llama"].read_spec(ConfigReader(config, "config.json", frozenset()))
