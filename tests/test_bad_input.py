"""Bad input: one line naming the file and tensor, exit status 2, no traceback, DST untouched."""

import json
import os

import ml_dtypes  # noqa: F401
import pytest
from safetensors.numpy import load_file, save_file

from ckptconv.commands import synth
from tests.conftest import run_cli


def drop_tensor(src):
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(src / "model.safetensors"))


def add_tensor(src):
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = tensors["model.norm.weight"]
    save_file(tensors, str(src / "model.safetensors"))


def edit_config(**changes):
    def edit(src):
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(config | changes))
    return edit


def truncate(src):
    path = src / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)


def corrupt_header(src):
    with open(src / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 8)


def bad_header_entry(src):
    """A header whose first tensor has a shape that is not a list (rewritten, data kept)."""
    path = src / "model.safetensors"
    blob = path.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + length])
    first = next(name for name in header if name != "__metadata__")
    header[first]["shape"] = "64x64"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + length:])


def pickle_only(src):
    (src / "model.safetensors").rename(src / "pytorch_model.bin")


CASES = {
    "missing config": (lambda src: (src / "config.json").unlink(), "config.json: missing"),
    "unsupported family": (edit_config(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    "unknown config field": (edit_config(quantization_config={"bits": 4}), "unknown field(s) 'quantization_config'"),
    "missing tensor": (drop_tensor, "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    "extra tensor": (add_tensor, "model.safetensors: unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    "shape mismatch": (edit_config(intermediate_size=100),
                       "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64], config.json implies [100, 64]"),
    "truncated file": (truncate, "model.safetensors: file is truncated"),
    "corrupt header": (corrupt_header, "model.safetensors: corrupt safetensors header"),
    "pickle only": (pickle_only, "never unpickles"),
    "malformed header entry": (bad_header_entry, "invalid shape '64x64'"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_line(tmp_path, synth_dir, case):
    damage, message = CASES[case]
    src = synth_dir()
    damage(src)
    dst = tmp_path / "dst"
    result = run_cli("convert", str(src), str(dst), "--progress", "none")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.startswith("ckptconv: error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    assert not dst.exists(), "nothing may be written for bad input"


def test_bad_input_leaves_existing_checkpoint_alone(tmp_path, synth_dir):
    good, dst = synth_dir(name="good"), tmp_path / "dst"
    assert run_cli("convert", str(good), str(dst), "--devices", "1", "--progress", "none").returncode == 0
    before = sorted((p.relative_to(dst), p.stat().st_mtime_ns) for p in dst.rglob("*"))
    bad = synth_dir(name="bad")
    truncate(bad)
    result = run_cli("convert", str(bad), str(dst), "--overwrite", "--progress", "none")
    assert result.returncode == 2
    assert sorted((p.relative_to(dst), p.stat().st_mtime_ns) for p in dst.rglob("*")) == before
    assert run_cli("verify", str(good), str(dst)).returncode == 0


def test_verify_detects_a_changed_source(tmp_path, synth_dir):
    src, dst = synth_dir(), tmp_path / "dst"
    assert run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none").returncode == 0
    synth.write_checkpoint(synth.SynthModel(seed=1), str(src))  # same shapes, other weights
    result = run_cli("verify", str(src), str(dst))
    assert result.returncode == 1 and "FAILED" in result.stdout
