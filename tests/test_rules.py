"""A rule with two outputs (one fused HF tensor -> two leaves) reads its tensor once and writes both.

No supported family of this release fuses two projections into one tensor (gpt-oss's
``gate_up_proj`` will), so a small family is declared here, in the same vocabulary the real
families use, and registered for the test only. Every byte read from the source is logged: the
fused tensor's bytes must be read exactly once, in bounded pieces, though they feed two leaves.
"""

import dataclasses
import numpy as np
import pytest
from safetensors.numpy import load_file

from ckptconv import families, settings
from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.families.base import Family, Output, Rule, Synthetic, rule
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KERNEL, KV_KERNEL, L, LAYER_NORM_ROWS, Q_KERNEL, attention_rows, decoder_config, decoder_values,
    make_spec, read_dense_dims,
)
from ckptconv.families.transforms import TRANSPOSE, TakeStrided
from ckptconv.read import sources
from ckptconv.read.safetensors_io import index_checkpoint
from tests.test_convert import restore


def read_spec(cfg):
    dims = read_dense_dims(cfg)
    dims["mlp2"] = 2 * dims["mlp"]
    return make_spec(cfg, "fused", dims, decoder_values(cfg))


FUSED = Family(
    name="fused",
    model_types=("fused_toy",),
    decoder_block="toy",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + LAYER_NORM_ROWS + GLOBAL_ROWS + (
        # (2*mlp, emb): gate and up rows interleaved, as gpt-oss stores its experts' gate_up_proj
        Rule(L + "mlp.gate_up_proj.weight", ("mlp2", "emb"), (
            Output(("mlp", "wi_0", "kernel"), (TRANSPOSE, TakeStrided("gate", -1, 0, 2))),
            Output(("mlp", "wi_1", "kernel"), (TRANSPOSE, TakeStrided("up", -1, 1, 2))))),
        rule(L + "mlp.down_proj.weight", ("mlp", "wo", "kernel"), ("emb", "mlp"), KERNEL),
    ),
    read_spec=read_spec,
    synthetic=Synthetic(config=lambda m: decoder_config(m, "FusedToyForCausalLM")),
)


@pytest.fixture
def fused_family(monkeypatch):
    monkeypatch.setitem(families.BY_MODEL_TYPE, "fused_toy", FUSED)


@pytest.mark.parametrize("budget", [None, 4096])
def test_one_tensor_two_leaves_read_once(tmp_path, monkeypatch, fused_family, budget):
    model = synth.SynthModel(model_type="fused_toy", intermediate_size=96, tie_word_embeddings=False)
    src, dst = tmp_path / "src", tmp_path / "dst"
    synth.write_checkpoint(model, str(src))
    # Module state, for the one synchronous convert() below: make_plan takes no read budget yet (plan_tiling does,
    # from settings.IN_FLIGHT), and convert()'s producer and writer threads are joined before it returns; CLI
    # children read their own settings. Both patches are undone when the test ends.
    if budget:
        monkeypatch.setattr(settings, "IN_FLIGHT", dataclasses.replace(settings.IN_FLIGHT, read_bytes=budget))
    reads: list[tuple[str, int, int]] = []
    original = sources.LocalSource.read_range

    def logged(self, name, offset, length):
        reads.append((name, offset, length))
        return original(self, name, offset, length)

    monkeypatch.setattr(sources.LocalSource, "read_range", logged)
    report = convert(ConvertRequest(str(src), str(dst), devices=16, progress="none"))
    assert report["status"] == "complete"

    infos = index_checkpoint(sources.LocalSource(str(src)))
    for layer in range(model.num_layers):
        info = infos[f"model.layers.{layer}.mlp.gate_up_proj.weight"]
        pieces = sorted((o, n) for f, o, n in reads if f == info.file and info.offset <= o < info.offset + info.nbytes)
        assert sum(n for _, n in pieces) == info.nbytes, "every byte of the fused tensor read exactly once"
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:])), "no byte read twice, none skipped"
        if budget:
            assert len(pieces) > 1 and max(n for _, n in pieces) <= budget

    hf = load_file(str(src / "model.safetensors"))
    restored = restore(dst)
    stacked = np.stack([hf[f"model.layers.{i}.mlp.gate_up_proj.weight"].T for i in range(model.num_layers)], axis=1)
    assert restored["params/params/decoder/layers/mlp/wi_0/kernel"].tobytes() == stacked[..., 0::2].tobytes()
    assert restored["params/params/decoder/layers/mlp/wi_1/kernel"].tobytes() == stacked[..., 1::2].tobytes()
