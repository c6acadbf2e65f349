"""The leaf metadata ``inspect``, ``verify`` and ``export`` read without Orbax (ckptconv.read.pytree_metadata) is
Orbax's own, leaf by leaf, on what ckptconv writes and on what Orbax writes itself (as MaxText saves: sharded
jax.Arrays, numpy arrays, a scalar step, an empty optimizer state); a layout it does not cover goes to Orbax; and
the file commands load neither Orbax nor JAX."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.read import pytree_metadata
from ckptconv.read.stored import _orbax_items_metadata, read_items_metadata
from tests.conftest import ROOT, run_cli


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny model on 4 devices and on 1 (no sharding recorded), as ckptconv writes them."""
    base = tmp_path_factory.mktemp("pytree")
    synth.write_checkpoint(synth.SynthModel(), str(base / "src"))
    for devices in ("4", "1"):
        done = run_cli("convert", str(base / "src"), str(base / f"dst{devices}"), "--devices", devices,
                       "--progress", "none")
        assert done.returncode == 0, done.stderr
    return base


def _orbax_saved(directory, tree) -> str:
    """``tree`` saved by Orbax itself (OCDBT, zarr3, as MaxText's checkpoints are); its items directory."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(str(directory), item_names=("items",), item_handlers={
        "items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)})
    manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(item=tree)))
    manager.wait_until_finished()
    return str(directory / "0" / "items")


def _maxtext_like_tree() -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    sharded = jax.device_put(rng.standard_normal((8, 6, 4), dtype=np.float32).astype(jax.numpy.bfloat16),
                             NamedSharding(mesh, PartitionSpec(("data", "model"), None)))
    by_model = jax.device_put(np.arange(32, dtype=np.float32).reshape(4, 8),
                              NamedSharding(mesh, PartitionSpec(None, "model")))
    return {"params": {"params": {"wi": sharded, "scale": by_model, "host": np.ones((3, 5), np.int32)}},
            "step": 7, "opt_state": {}}


def test_ckptconv_checkpoints_read_as_orbax_reads_them(converted):
    for devices in ("4", "1"):
        items = str(converted / f"dst{devices}" / "0" / "items")
        ours = read_items_metadata(items)
        assert ours == _orbax_items_metadata(items)
        assert len(ours) == 14 and any(leaf.mesh_shape == (4,) for leaf in ours) == (devices == "4")


def test_an_orbax_saved_tree_reads_as_orbax_reads_it(tmp_path):
    """Two mesh axes, a partition entry of two axes, a numpy leaf (no sharding), a scalar, an empty dict."""
    items = _orbax_saved(tmp_path / "ckpt", _maxtext_like_tree())
    assert pytree_metadata.tree_leaves(items) is not None  # read here, not by the fallback
    ours = read_items_metadata(items)
    assert ours == _orbax_items_metadata(items)
    by_name = {leaf.name: leaf for leaf in ours}
    assert by_name["params/params/wi"].partition_spec == (["data", "model"], None)
    assert by_name["params/params/wi"].mesh_shape == (2, 2) and by_name["params/params/host"].mesh_shape is None
    assert by_name["step"].shape == () and by_name["step"].chunk_shape is None


def test_a_layout_it_does_not_cover_goes_to_orbax(tmp_path):
    """A list in the tree (sequence keys): left to Orbax, whose answer is the one returned."""
    items = _orbax_saved(tmp_path / "ckpt", {"layers": [np.zeros((2, 2), np.float32), np.ones((3,), np.float32)]})
    assert pytree_metadata.tree_leaves(items) is None
    assert read_items_metadata(items) == _orbax_items_metadata(items)
    assert [leaf.shape for leaf in read_items_metadata(items)] == [(2, 2), (3,)]


NO_JAX = """
import runpy, sys
sys.argv = ["ckptconv", *sys.argv[1:]]
try:
    runpy.run_module("ckptconv", run_name="__main__")
except SystemExit as done:
    assert done.code == 0, done.code
loaded = sorted(name for name in ("jax", "orbax.checkpoint") if name in sys.modules)
print("LOADED", loaded, file=sys.stderr)
"""


@pytest.mark.parametrize("command", ["inspect", "inspect --deep", "verify SRC", "verify", "export"])
def test_file_commands_that_only_read_load_neither_orbax_nor_jax(converted, tmp_path, command):
    """Their fixed cost was mostly these imports (and JAX's backend start): 0.9 of inspect's 1.1 s on 2 cores."""
    dst, src = str(converted / "dst4"), str(converted / "src")
    args = {"inspect": ["inspect", dst], "inspect --deep": ["inspect", dst, "--deep"],
            "verify SRC": ["verify", src, dst, "--progress", "none"], "verify": ["verify", dst],
            "export": ["export", dst, str(tmp_path / "hf"), "--like", src, "--progress", "none"]}[command]
    done = subprocess.run([sys.executable, "-c", NO_JAX, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert "LOADED []" in done.stderr, done.stderr[-3000:]


def test_an_exported_model_is_the_same_bits_either_reader(converted, tmp_path):
    """Export reads its leaves through these handles: its safetensors are the source's, bit for bit (a ``verify`` of
    the export against the checkpoint would read the checkpoint through the same handles, and agree with itself)."""
    from safetensors.numpy import load_file

    done = run_cli("export", str(converted / "dst4"), str(tmp_path / "hf"), "--like", str(converted / "src"),
                   "--progress", "none")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "hf" / "ckptconv-report.json").read_text())
    assert report["tensors"] == 24
    source = load_file(str(converted / "src" / "model.safetensors"))
    exported = {}
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_file(str(file)))
    assert sorted(exported) == sorted(source)
    for name, want in source.items():
        assert (exported[name].dtype, exported[name].shape) == (want.dtype, want.shape), name
        assert exported[name].tobytes() == want.tobytes(), name


def test_a_checkpoint_rewritten_in_place_reads_as_rewritten(converted, tmp_path):
    """Each reader opens its own tensorstore context, as Orbax does: a context kept for the process served the old
    OCDBT nodes after ``--overwrite`` (an in-process export of a reconverted checkpoint read past its files' ends)."""
    from ckptconv.read.stored import open_items_leaf, read_region

    dst = tmp_path / "dst"
    items = str(dst / "0" / "items")
    for layout in (("--devices", "4"), ("--devices", "1", "--no-scan-layers", "--overwrite")):
        done = run_cli("convert", str(converted / "src"), str(dst), "--progress", "none", *layout)
        assert done.returncode == 0, done.stderr
        leaves = read_items_metadata(items)
        assert leaves == _orbax_items_metadata(items)
        for leaf in leaves:
            read_region(open_items_leaf(items, leaf.path), tuple(slice(None) for _ in leaf.shape))


def test_a_jax_array_saved_from_one_device_reads_as_unsharded_either_way(tmp_path):
    """A jax.Array on one device records a SingleDeviceSharding (a device string, no mesh): read here, and in a tree
    left to Orbax (a list), it is a leaf without a mesh; Orbax's reading of it raised AttributeError ('shape')."""
    import jax

    one = jax.device_put(np.arange(12, dtype=np.float32).reshape(4, 3), jax.devices()[0])
    for name, tree in (("dict", {"a": one}), ("list", {"layers": [one, np.ones((3,), np.float32)]})):
        items = _orbax_saved(tmp_path / name, tree)
        ours, theirs = read_items_metadata(items), _orbax_items_metadata(items)
        assert ours == theirs and (pytree_metadata.tree_leaves(items) is None) == (name == "list")
        assert ours[0].shape == (4, 3) and ours[0].mesh_shape is None and ours[0].partition_spec is None
