"""Qwen3-VL (dense, MoE) and Qwen3-Omni-MoE: their text decoders convert, everything else they ship is named.

The vision and audio towers (MaxText's ``use_multimodal`` / ``use_audio``) and Qwen3-Omni's talker and
code2wav are not converted yet or not MaxText's: present in the checkpoint, they are reported, not written.
"""

import pytest

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.families import BY_MODEL_TYPE
from ckptconv.plan.conversion import make_plan, read_spec
from ckptconv.read.sources import LocalSource

MOE = {"num_experts": 4, "moe_intermediate_size": 48, "tie_word_embeddings": False}
VISION = {"model.visual.patch_embed.proj.weight": (32, 3, 2, 16, 16), "model.visual.blocks.0.attn.qkv.weight": (96, 32),
          "model.visual.merger.linear_fc2.weight": (64, 128)}
OMNI = {"thinker.visual.blocks.0.attn.qkv.weight": (96, 32), "thinker.audio_tower.conv2d1.weight": (16, 1, 3, 3),
        "thinker.audio_tower.proj2.weight": (64, 32), "talker.model.embed_tokens.weight": (32, 16),
        "code2wav.decoder.0.conv.weight": (8, 8, 7)}


@pytest.mark.parametrize("model_type, fields, extra, expected", [
    ("qwen3_vl", {}, VISION, {"vision tower": 3}),
    ("qwen3_vl_moe", MOE, VISION, {"vision tower": 3}),
    ("qwen3_omni_moe", MOE, OMNI, {"vision tower": 1, "audio tower": 2, "talker": 1, "code2wav vocoder": 1}),
])
def test_other_towers_are_reported_not_converted(tmp_path, model_type, fields, extra, expected):
    model = synth.SynthModel(model_type=model_type, num_layers=2, extra_tensors=extra, **fields)
    synth.write_checkpoint(model, str(tmp_path))
    plan = make_plan(LocalSource(str(tmp_path)), scan_layers=True, devices=1)
    reported = {entry["what"].split(" (")[0]: entry["tensors"] for entry in plan.not_converted}
    assert reported == expected
    assert not any("visual" in leaf.name or "audio" in leaf.name for leaf in plan.leaves)
    assert plan.tensor_count == len(synth.tensor_shapes(model)) - len(extra)  # the decoder's, all of them


def test_qwen3_vl_moe_experts_in_transformers_5_layout_are_refused_by_name(tmp_path):
    """transformers 5's save_pretrained writes the fused experts as it holds them ((E, 2I, H), (E, H, I)), the
    releases the other way round; MaxText reads only the releases' layout."""
    model = synth.SynthModel(model_type="qwen3_vl_moe", num_layers=2, **MOE)
    shapes = synth.tensor_shapes(model)
    swapped = {name: (s[0], s[2], s[1]) for name, s in shapes.items() if ".mlp.experts." in name}
    synth.write_checkpoint(synth.SynthModel(model_type="qwen3_vl_moe", num_layers=2, **MOE, extra_tensors=swapped),
                           str(tmp_path))
    with pytest.raises(BadInputError, match=r"model.language_model.layers.0.mlp.experts.(gate_up|down)_proj' has shape"):
        make_plan(LocalSource(str(tmp_path)), devices=1)


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_vl_moe"])
def test_the_wrappers_tie_flag_decides_the_head(model_type):
    """transformers writes its text config's default (true) beside the wrapper's false: the wrapper's decides."""
    config = synth.SynthModel(model_type=model_type, **MOE).config()
    config["text_config"]["tie_word_embeddings"] = True
    spec = read_spec(BY_MODEL_TYPE[model_type], config, "config.json")
    assert spec.value("tie_word_embeddings") is False


@pytest.mark.parametrize("model_type, where", [("qwen3_vl", ("text_config",)),
                                               ("qwen3_omni_moe", ("thinker_config", "text_config"))])
def test_unknown_decoder_fields_are_refused_by_name(model_type, where):
    config = synth.SynthModel(model_type=model_type, **MOE).config()
    node = config
    for key in where:
        node = node[key]
    node["mystery"] = 1
    with pytest.raises(BadInputError, match=rf"{': '.join(where)}: unknown field\(s\) 'mystery'"):
        read_spec(BY_MODEL_TYPE[model_type], config, "config.json")


# MaxText 0.2.5's model configs (configs/models/*.yml): layers, emb, heads, kv heads, head_dim, experts, vocab, tied
RELEASES = {"qwen3-vl-2b": (28, 2048, 16, 8, 128, None, 151936, True),
            "qwen3-vl-4b": (36, 2560, 32, 8, 128, None, 151936, True),
            "qwen3-vl-30b-a3b": (48, 2048, 32, 4, 128, 128, 151936, False),
            # MaxText's copy: its layer and expert counts, transformers' defaults for the rest
            "qwen3-omni-30b-a3b": (48, 2048, 28, 4, 73, 128, 3584, False)}


@pytest.mark.parametrize("name", RELEASES)
def test_the_releases_configs_read_as_maxtexts_models(name):
    from tests.published_configs import QWEN3_MULTIMODAL

    config = QWEN3_MULTIMODAL[name]
    spec = read_spec(BY_MODEL_TYPE[config["model_type"]], config, "config.json")
    layers, emb, heads, kv, hd, experts, vocab, tied = RELEASES[name]
    assert (spec.num_layers, spec.dim("emb"), spec.dim("heads"), spec.dim("kv_heads"), spec.dim("hd")) == (
        layers, emb, heads, kv, hd)
    assert (spec.dims.get("experts"), spec.dim("vocab"), spec.value("tie_word_embeddings")) == (experts, vocab, tied)
