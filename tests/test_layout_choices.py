"""The two layout choices a family may constrain: ``--multimodal`` (the encoders) and the default scan.

Conversions run in the test process (16 devices, as the suite's JAX starts). A small family is declared here in the families' own vocabulary and registered for the test only (as in
tests/test_rules.py): Qwen3's rules plus one encoder tensor written only with ``--multimodal``, and a layout
that MaxText's code would run unscanned only. The real families that use these (vision towers, Gemma 4's
small models) have their own tests; these pin the planner's behaviour on both choices.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ckptconv import families
from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.commands.export import ExportRequest, export
from ckptconv.errors import BadInputError
from ckptconv.families.base import UnscannedOnly, multimodal, rule, uniform_layout
from ckptconv.families.transforms import TRANSPOSE
from tests.test_convert import restore

ENCODER = "visual.proj.weight"
ENCODER_LEAF = "params/params/vision_encoder/proj/kernel"


def unscanned_only(spec, scan: bool):
    if scan:
        raise UnscannedOnly("the toy's shared layers run unscanned only in MaxText's code")
    return uniform_layout(spec, scan)


BASE = families.BY_MODEL_TYPE["qwen3"]
TOY = dataclasses.replace(
    BASE, name="encoder_toy", model_types=("encoder_toy",), layout=unscanned_only,
    rules=BASE.rules + (rule(ENCODER, ("vision_encoder", "proj", "kernel"), ("mlp", "emb"), (TRANSPOSE,),
                             when=multimodal, note="vision projection (convert with --multimodal)"),),
    encoders=("vision projection",))


@pytest.fixture
def toy_source(tmp_path, monkeypatch):
    # a family added to the registry for this test's synchronous plans and conversions (no other test knows the
    # model type encoder_toy; CLI children never see it); removed when the test ends
    monkeypatch.setitem(families.BY_MODEL_TYPE, "encoder_toy", TOY)
    model = synth.SynthModel(model_type="qwen3", num_layers=2, dtype="float32")
    src = tmp_path / "src"
    synth.write_checkpoint(model, str(src))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "encoder_toy"}))
    tensors = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(0)
    tensors[ENCODER] = rng.standard_normal((model.intermediate_size, model.hidden_size)).astype(np.float32)
    save_file(tensors, str(src / "model.safetensors"))
    return src, tensors[ENCODER]


def test_encoders_only_with_multimodal_and_export_finds_them(tmp_path, toy_source):
    src, encoder = toy_source
    text = convert(ConvertRequest(str(src), str(tmp_path / "text"), devices=16, dtype="float32", progress="none"))
    assert text["multimodal"] is False
    assert [entry["tensors"] for entry in text["not_converted"]] == [[ENCODER]]
    assert ENCODER_LEAF not in restore(tmp_path / "text")

    both = convert(ConvertRequest(str(src), str(tmp_path / "both"), devices=16, dtype="float32", progress="none",
                                  multimodal=True))
    assert both["multimodal"] is True and both["not_converted"] == []
    assert restore(tmp_path / "both")[ENCODER_LEAF].tobytes() == encoder.T.tobytes()

    export(ExportRequest(str(tmp_path / "both"), str(tmp_path / "hf"), like=str(src), dtype="float32",
                         progress="none"))
    exported = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert exported[ENCODER].tobytes() == encoder.tobytes()


def test_default_layout_is_the_one_the_model_runs_and_an_explicit_scan_is_refused(tmp_path, toy_source):
    src, _ = toy_source
    report = convert(ConvertRequest(str(src), str(tmp_path / "dst"), devices=16, progress="none"))
    assert report["scan_layers"] is False
    assert "params/params/decoder/layers_0/mlp/wo/kernel" in restore(tmp_path / "dst")
    with pytest.raises(BadInputError, match="run unscanned only in MaxText's code"):
        convert(ConvertRequest(str(src), str(tmp_path / "scanned"), devices=16, scan_layers=True, progress="none"))
    assert not (tmp_path / "scanned").exists()
