"""The tile plan under a tiny read budget: every family's leaves tiled exactly once, reads bounded.

With the read size (``settings.IN_FLIGHT.read_bytes``) shrunk to a few KiB, a tiny model's tensors take the paths a 70B or
235B model's take (bands of rows, kernels cut across device shards, groups of small
pieces), so these tests exercise them in seconds. The conversion under that budget must
give the same bits as the plain restatement in test_convert and pass ``verify``.
"""

import dataclasses
import math

import numpy as np
import pytest

from ckptconv import settings
from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.families.sharding import write_shape
from ckptconv.families.transforms import box_shape, box_slices
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.test_convert import LLAMA31_ROPE, expected_params, restore

FAMILIES = {
    "llama": synth.SynthModel(model_type="llama", tie_word_embeddings=False, config_overrides={"rope_scaling": LLAMA31_ROPE}),
    "qwen2": synth.SynthModel(model_type="qwen2", tie_word_embeddings=False),
    "qwen3_moe": synth.SynthModel(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=48, num_layers=3),
    "mixtral": synth.SynthModel(model_type="mixtral", num_experts=4, tie_word_embeddings=False),
    "gemma2": synth.SynthModel(model_type="gemma2", num_layers=4, vocab_size=96),
    "gemma3": synth.SynthModel(model_type="gemma3", num_layers=7, vocab_size=96),
}
BUDGET = 2048
# The tiny budget is patched into settings.IN_FLIGHT (module state) for a test's synchronous make_plan() or convert()
# only: make_plan takes no read budget yet (plan_tiling does, from settings.IN_FLIGHT), convert()'s threads are joined
# before it returns, and CLI children read their own settings; monkeypatch undoes it when the test ends.


@pytest.mark.parametrize("devices", [1, 16])
@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_budget_tiles_every_leaf_once_within_shards(tmp_path, monkeypatch, family, scan, devices):
    src = tmp_path / "src"
    synth.write_checkpoint(FAMILIES[family], str(src))
    monkeypatch.setattr(settings, "IN_FLIGHT", dataclasses.replace(settings.IN_FLIGHT, read_bytes=BUDGET))
    plan = make_plan(LocalSource(str(src)), scan_layers=scan, devices=devices)
    banded = _assert_tiled_once(plan, devices, BUDGET)
    assert banded, "the tiny budget should force some tensors into bands"


def _assert_tiled_once(plan, devices: int, budget: int) -> int:
    """Every leaf of ``plan`` tiled exactly once by whole chunks within device parts, reads within ``budget``;
    the number of jobs read in bands."""
    banded = 0
    for job in plan.jobs:
        covered = [np.zeros(leaf.shape, dtype=np.int8) for leaf in job.leaves]
        for unit in job.units(plan.spec):
            if unit.source_box is None:  # zero padding (a vocabulary padded to MaxText's size): nothing read
                written = sum(math.prod(box_shape(b)) * leaf.dtype.itemsize
                              for leaf, b in zip(job.leaves, unit.leaf_boxes) if b is not None)
                assert written <= budget or written <= max(math.prod(c) * leaf.dtype.itemsize
                                                          for leaf, c in zip(job.leaves, (l.chunk_shape for l in job.leaves)))
            else:
                read = sum(math.prod(box_shape(unit.source_box)) * job.pieces[i].dtype.itemsize for i in unit.pieces)
                if job.tiling.band is None or job.tiling.band > 1:  # a single quantum may exceed a 2 KiB budget
                    assert read <= budget, (job.rule.hf, read)
            for leaf, box, counts in zip(job.leaves, unit.leaf_boxes, covered):
                if box is None:
                    continue
                counts[box_slices(box)] += 1
                for (start, stop), chunk, dim in zip(box, leaf.chunk_shape, leaf.shape):
                    assert start % chunk == 0 and (stop % chunk == 0 or stop == dim), (leaf.name, box, leaf.chunk_shape)
        for leaf, counts in zip(job.leaves, covered):
            assert (counts == 1).all(), f"{leaf.name}: read units must tile the leaf exactly once"
            part = write_shape(leaf.shape, devices)
            assert all(p % c == 0 for p, c, d in zip(part, leaf.chunk_shape, leaf.shape) if p != d), leaf.name
        banded += job.tiling.band_axis is not None
    return banded


@pytest.mark.parametrize("devices", [1, 4, 16])
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_padded_vocabulary_is_chunked_by_the_budget_not_by_its_rows(tmp_path, family, devices):
    """A 100-row vocabulary padded to MaxText's 256128 or 262144 rows: cut at its data's extent, its chunks
    were gcd(100, rows a device) = 4 rows (65536 chunks to write and read back); the data's last read now
    carries zeros to a chunk boundary the budget allows, and the plan keeps every guarantee."""
    src = tmp_path / "src"
    synth.write_checkpoint(dataclasses.replace(FAMILIES[family], vocab_size=100), str(src))
    plan = make_plan(LocalSource(str(src)), devices=devices)
    budget = settings.IN_FLIGHT.read_bytes
    _assert_tiled_once(plan, devices, budget)
    (job,) = [job for job in plan.jobs if any(leaf.name.endswith("token_embedder/embedding") for leaf in job.leaves)]
    leaf = job.leaves[0]
    assert math.prod(-(-d // c) for d, c in zip(leaf.shape, leaf.chunk_shape)) <= 64, leaf.chunk_shape
    for unit in job.units(plan.spec):  # every tile, the data's padded last read included, within the budget
        assert math.prod(box_shape(unit.leaf_boxes[0])) * leaf.dtype.itemsize <= budget


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tiny_budget_conversion_gives_the_same_bits(tmp_path, monkeypatch, model_type):
    model = FAMILIES[model_type]
    src = tmp_path / "src"
    synth.write_checkpoint(model, str(src))
    monkeypatch.setattr(settings, "IN_FLIGHT", dataclasses.replace(settings.IN_FLIGHT, read_bytes=BUDGET))
    dst = tmp_path / "dst"
    report = convert(ConvertRequest(str(src), str(dst), devices=16, progress="none"))
    assert report["status"] == "complete"
    expected = expected_params(src, model, scan=True, dtype="bfloat16")
    restored = restore(dst)
    for name, value in expected.items():
        assert restored[name].tobytes() == value.tobytes(), name
    assert run_cli("verify", str(src), str(dst)).returncode == 0
