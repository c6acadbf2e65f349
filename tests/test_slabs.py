"""Slab producers under a tiny slab budget: layers go out as pieces of whole device shards.

With ``SLAB_BYTES`` shrunk, every layer of a small model takes the path a 70B model's layers
take (one layer per slab, pieces of shards, kernels transposed block by block from source
columns). The conversion runs in this process (16 devices, set by conftest) and is checked
against the independent restatement in test_convert and by ``verify``, whose own slabs are
whole layers.
"""

import numpy as np
import pytest

from ckptconv import slabs, synth
from ckptconv.convert import ConvertRequest, convert
from ckptconv.monitor import StageTimer
from ckptconv.plan import make_plan
from ckptconv.sources import LocalSource
from tests.conftest import run_cli
from tests.test_convert import LLAMA31_ROPE, expected_params, restore


@pytest.mark.parametrize("model_type, extra", [("llama", {"rope_scaling": LLAMA31_ROPE}), ("qwen2", {})])
def test_tiny_slab_budget_still_tiles_every_leaf(tmp_path, synth_dir, monkeypatch, model_type, extra):
    model = synth.SynthModel(model_type=model_type, tie_word_embeddings=False, config_overrides=extra)
    src = synth_dir(model)
    monkeypatch.setattr(slabs, "SLAB_BYTES", 2048)
    plan = make_plan(LocalSource(str(src)), devices=16)
    for leaf in plan.leaves:
        big_layers = leaf.stacked and leaf.nbytes // leaf.shape[1] > slabs.SLAB_BYTES
        if big_layers:
            assert slabs.layers_per_slab(leaf) == 1
        covered = np.zeros(leaf.shape, dtype=np.int8)
        pieces = 0
        for index, data in slabs.leaf_slabs(leaf, LocalSource(str(src)), plan.spec, StageTimer(), devices=16):
            assert covered[index].shape == data.shape, leaf.name
            covered[index] += 1
            pieces += 1
        assert (covered == 1).all(), f"{leaf.name}: slabs must tile the leaf exactly once"
        if big_layers and leaf.shape[0] % 16 == 0:
            assert pieces > leaf.shape[1], f"{leaf.name}: expected several pieces per layer"

    dst = tmp_path / "dst"
    report = convert(ConvertRequest(str(src), str(dst), devices=16, progress="none"))
    assert report["status"] == "complete"
    expected = expected_params(src, model, scan=True, dtype="bfloat16")
    restored = restore(dst)
    for name, value in expected.items():
        assert restored[name].tobytes() == value.tobytes(), name
    assert run_cli("verify", str(src), str(dst)).returncode == 0
