"""DeepSeek-V3 / Kimi-K2's router bias (``e_score_correction_bias``) where every MaxText 0.2.5 loader finds it.

MaxText's model declares the bias a ``MoEBiasVar``, but its inference loader
(``model_creation_utils.from_pretrained``, behind its decode and tunix paths) restores
``params/params`` only: a bias in ``params/MoEBiasVar`` is left deleted and the first forward
pass crashes. Its training loader (``checkpointing.load_params_from_path``) looks a collection the
checkpoint lacks up under ``params/params``. So the bias is written under ``params/params``, at the
leaf path the model gives it, scanned layers stacked on axis 0 (as the model stacks a MoEBiasVar,
not on the parameters' scan axis 1). ``bench/maxtext_loaders.py`` runs both MaxText loaders on
this output; here the location, shape and values are pinned, and export reads them back.
"""

import numpy as np
import pytest
from safetensors.numpy import load_file

from ckptconv.commands import synth
from ckptconv.families import FAMILIES
from tests.conftest import run_cli
from tests.test_convert import DTYPES, restore

BIAS = "DeepSeekMoeBlock_0/MoeBlock_0/gate/bias"
HF_BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"


def model(model_type: str, quantization: str | None = None) -> synth.SynthModel:
    """One dense layer, then three MoE layers: a stack of the bias with more than one layer."""
    return synth.SynthModel(model_type=model_type, hidden_size=128, num_layers=4, num_heads=2, head_dim=16,
                            intermediate_size=160, moe_intermediate_size=64, num_experts=8, vocab_size=256,
                            quantization=quantization)


def test_every_family_writes_only_the_params_collection():
    """MaxText's from_pretrained restores params/params only: a leaf in any other collection is lost."""
    elsewhere = [(family.name, rule.hf, output.collection) for family in FAMILIES for rule in family.rules
                 for output in rule.outputs if output.collection != "params"]
    assert elsewhere == []


CASES = [("deepseek_v3", None, True, 4, "bfloat16"), ("deepseek_v3", None, False, 1, "float32"),
         ("kimi_k2", None, True, 2, "float32"), ("kimi_k2", "int4", False, 2, "bfloat16")]


@pytest.mark.parametrize("model_type, quantization, scan, devices, dtype", CASES,
                         ids=[f"{c[0]}{'-' + c[1] if c[1] else ''}-{'scan' if c[2] else 'noscan'}" for c in CASES])
def test_router_bias_is_written_under_params_params(tmp_path, synth_dir, model_type, quantization, scan, devices,
                                                     dtype):
    m = model(model_type, quantization)
    src, dst = synth_dir(m), tmp_path / "dst"
    flags = ["--scan-layers" if scan else "--no-scan-layers", "--devices", str(devices), "--dtype", dtype]
    converted = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert converted.returncode == 0, converted.stderr
    hf = load_file(str(src / "model.safetensors")) if quantization is None else None
    if hf is None:  # the INT4 release: the bias is one of the tensors its ignore list keeps bfloat16
        from tests.test_int4 import dequantized
        hf = dequantized(src)
    restored = restore(dst)
    assert not [name for name in restored if name.startswith("params/") and not name.startswith("params/params/")]
    moe_layers = range(m.config()["first_k_dense_replace"], m.num_layers)
    want = [np.asarray(hf[HF_BIAS.format(i)]).astype(DTYPES[dtype]) for i in moe_layers]
    if scan:
        leaf = restored[f"params/params/decoder/moe_layers/{BIAS}"]
        assert leaf.shape == (len(want), m.num_experts) and leaf.dtype == DTYPES[dtype]
        assert leaf.tobytes() == np.stack(want, axis=0).tobytes()
    else:
        for n, value in enumerate(want):
            leaf = restored[f"params/params/decoder/moe_layers_{n}/{BIAS}"]
            assert leaf.shape == (m.num_experts,) and leaf.dtype == DTYPES[dtype]
            assert leaf.tobytes() == value.tobytes()
    verified = run_cli("verify", str(src), str(dst))
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr
    inspected = run_cli("inspect", str(dst))
    assert inspected.returncode == 0 and "params/params/decoder/moe_layers" in inspected.stdout, inspected.stderr


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "noscan"])
def test_export_reads_the_bias_back_from_params_params(tmp_path, synth_dir, scan):
    m = model("deepseek_v3")
    src, dst, back = synth_dir(m), tmp_path / "dst", tmp_path / "back"
    flags = ["--scan-layers" if scan else "--no-scan-layers", "--devices", "2"]
    assert run_cli("convert", str(src), str(dst), "--progress", "none", *flags).returncode == 0
    exported = run_cli("export", str(dst), str(back), "--like", str(src), "--progress", "none")
    assert exported.returncode == 0, exported.stderr
    hf, again = load_file(str(src / "model.safetensors")), {}
    for file in back.glob("*.safetensors"):
        again |= load_file(str(file))
    for i in range(1, m.num_layers):
        assert again[HF_BIAS.format(i)].tobytes() == hf[HF_BIAS.format(i)].tobytes(), i


# ckptconv before the move: the same rules, the bias's output in the MoEBiasVar collection
LEGACY_CONVERT = """
import dataclasses, sys
from ckptconv.families import deepseek
bias = next(r for r in deepseek.FAMILY.rules if r.hf.endswith("e_score_correction_bias"))
old = dataclasses.replace(bias, outputs=(dataclasses.replace(bias.outputs[0], collection="MoEBiasVar"),))
object.__setattr__(deepseek.FAMILY, "rules", tuple(old if r is bias else r for r in deepseek.FAMILY.rules))
sys.argv = ["ckptconv", *sys.argv[1:]]
from ckptconv.cli import run
run()
"""


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "noscan"])
def test_export_still_reads_the_bias_from_moebiasvar_of_earlier_checkpoints(tmp_path, synth_dir, scan):
    import subprocess
    import sys

    m = model("deepseek_v3")
    src, dst, back = synth_dir(m), tmp_path / "dst", tmp_path / "back"
    flags = ["--scan-layers" if scan else "--no-scan-layers", "--devices", "2"]
    old = subprocess.run([sys.executable, "-c", LEGACY_CONVERT, "convert", str(src), str(dst), "--progress", "none",
                          *flags], capture_output=True, text=True, timeout=300)
    assert old.returncode == 0, old.stderr
    assert any(name.startswith("params/MoEBiasVar/") for name in restore(dst))  # the earlier layout
    exported = run_cli("export", str(dst), str(back), "--like", str(src), "--progress", "none")
    assert exported.returncode == 0, exported.stderr
    hf, again = load_file(str(src / "model.safetensors")), {}
    for file in back.glob("*.safetensors"):
        again |= load_file(str(file))
    assert again.keys() == hf.keys()
    for name, value in hf.items():
        assert again[name].tobytes() == value.tobytes(), name


def test_rerun_over_the_earlier_layout_is_not_already_done(tmp_path, synth_dir):
    """Same source, same options: the fingerprint matches, but the checkpoint is not what this version
    writes (it would crash from_pretrained). A rerun says so and --overwrite redoes it."""
    import subprocess
    import sys

    src, dst = synth_dir(model("deepseek_v3")), tmp_path / "dst"
    flags = ["--progress", "none", "--devices", "2"]
    old = subprocess.run([sys.executable, "-c", LEGACY_CONVERT, "convert", str(src), str(dst), *flags],
                         capture_output=True, text=True, timeout=300)
    assert old.returncode == 0, old.stderr
    rerun = run_cli("convert", str(src), str(dst), *flags)
    assert rerun.returncode == 2, rerun.stdout + rerun.stderr
    assert "params/params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias" in rerun.stderr
    assert "--overwrite" in rerun.stderr and len(rerun.stderr.strip().splitlines()) == 1
    assert any(name.startswith("params/MoEBiasVar/") for name in restore(dst))  # nothing overwritten
    redone = run_cli("convert", str(src), str(dst), *flags, "--overwrite")
    assert redone.returncode == 0, redone.stderr
    names = restore(dst)
    assert f"params/params/decoder/moe_layers/{BIAS}" in names and not any("MoEBiasVar" in n for n in names)
    again = run_cli("convert", str(src), str(dst), *flags)
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr
