"""Tests for ckptconv.write.orbax: layout equal to a plain Orbax save, bounded RSS, atomicity, and a conversion
process that never imports Orbax or JAX.

Every test that saves runs in a child process: JAX fixes its device count when its
backend starts, and the plain Orbax saves and restores these tests compare with need 1, 3 and 16 simulated devices.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from ckptconv.write import codecs
from ckptconv.write.orbax import TARGET_FILE_BYTES, LeafWrite, write_checkpoint, write_shape

REPO = pathlib.Path(__file__).resolve().parents[1]
BF16 = np.dtype(ml_dtypes.bfloat16)

# Prepended to every child script: deterministic leaves, written both ways.
PRELUDE = """
import json, os, sys
import numpy as np, ml_dtypes
BF16 = np.dtype(ml_dtypes.bfloat16)

def values(shape, dtype, seed):
    return ((np.arange(int(np.prod(shape))) * 7 + seed) % 251 - 125).astype(dtype).reshape(shape)

SMALL = {  # path: (shape, dtype, chunk shape, tile axis, tile thickness)
    ("params", "params", "decoder", "layers", "k"): ((16, 6, 32), BF16, (1, 1, 32), 1, 1),
    ("params", "params", "decoder", "layers", "kt"): ((6, 32, 40), np.dtype(np.float32), (6, 2, 8), 2, 8),
    ("params", "params", "token_embedder", "embedding"): ((64, 8), np.dtype(np.float32), (4, 8), 0, 16),
    ("params", "params", "decoder", "replicated"): ((3, 5, 32), BF16, (3, 5, 32), None, None),
    ("step",): ((), np.dtype(np.int32), (), None, None),
}

def small_arrays():
    return {path: values(shape, dtype, n) for n, (path, (shape, dtype, *_)) in enumerate(SMALL.items())}

def small_leaves(arrays, devices):
    # LeafWrites (chunks within shards on `devices`) and one interleaved tile stream over all of them.
    from ckptconv.families.sharding import write_shape
    from ckptconv.write.orbax import LeafWrite
    leaves, streams = [], []
    for n, (path, (shape, dtype, chunk, axis, rows)) in enumerate(SMALL.items()):
        shard = write_shape(shape, devices)
        chunk = tuple(min(c, s) if s % min(c, s) == 0 else 1 for c, s in zip(chunk, shard))
        numpy_ints = tuple(np.int64(dim) for dim in shape)  # as a planner may hand them over
        leaves.append(LeafWrite(path, numpy_ints, dtype, chunk))
        array = arrays[path]
        if axis is None:
            streams.append([(n, (slice(None),) * array.ndim, array)])
            continue
        cut = []
        for start in range(0, shape[axis], rows):
            index = [slice(None)] * array.ndim
            index[axis] = slice(start, start + rows)
            cut.append((n, tuple(index), array[tuple(index)].copy()))
        streams.append(cut)
    # Round robin over the leaves: the writer must accept tiles of any leaf in any order.
    tiles = [t for group in __import__("itertools").zip_longest(*streams) for t in group if t is not None]
    return leaves, (lambda: iter(tiles))

EXTRAS = {"opt_state": {}, "epoch": 0}  # as MaxText's step and opt_state: Orbax's ScalarHandler, an empty dict

def nest(flat):
    tree = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
"""


def run_child(script: str, devices: int, out: pathlib.Path,
              timeout: float = 120) -> subprocess.CompletedProcess:
    """Run PRELUDE + script in a fresh Python whose JAX has `devices` CPU devices.

    The script finds its output directory in $OUT. MALLOC_ARENA_MAX=2 is what the CLI sets.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), MALLOC_ARENA_MAX="2", OUT=str(out),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    """The child's report: its last stdout line, as JSON; fail with its stderr otherwise."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SAVE_BOTH = """
import jax, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ckptconv.families.sharding import MESH_AXIS, partition_spec
from ckptconv.write.orbax import write_checkpoint, TARGET_FILE_BYTES
N, out = len(jax.devices()), os.environ["OUT"]
arrays = small_arrays()
mesh = Mesh(jax.devices(), (MESH_AXIS,))
def place(a):  # what MaxText's converter saves: sharded jax.Arrays, or numpy on 1 device
    return jax.device_put(a, NamedSharding(mesh, PartitionSpec(*partition_spec(a.shape, N)))) if N > 1 else a
tree = {**EXTRAS, **nest({path: place(a) for path, a in arrays.items()})}
manager = ocp.CheckpointManager(out + "/plain", item_names=("items",), item_handlers={
    "items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)})
save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=TARGET_FILE_BYTES), tree)
manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(
    item=tree, save_args=save_args, ocdbt_target_data_file_size=TARGET_FILE_BYTES)),
    custom_metadata={"scan_layers": True})
manager.wait_until_finished()
tiles = []
leaves, stream = small_leaves(arrays, N)
write_checkpoint(out + "/streamed", leaves, stream, devices=N, custom_metadata={"scan_layers": True},
                 on_tile=lambda leaf, n: tiles.append([leaf.path[-1], n]), extra_items=EXTRAS)
print(json.dumps({"tiles": tiles, "chunks": {"/".join(l.path): list(l.chunk_shape) for l in leaves}}))
"""

RESTORE_BOTH = """
import jax, orbax.checkpoint as ocp
out, report = os.environ["OUT"], {}
arrays = small_arrays()
for kind in ("plain", "streamed"):
    manager = ocp.CheckpointManager(out + "/" + kind, item_names=("items",), item_handlers={
        "items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)})
    args = {"epoch": ocp.RestoreArgs(), "opt_state": {},
            **nest({path: ocp.RestoreArgs(restore_type=np.ndarray) for path in arrays})}
    restored = manager.restore(0, args=ocp.args.Composite(items=ocp.args.PyTreeRestore(restore_args=args)))
    meta = manager.item_metadata(0)["items"]
    entry = report[kind] = {"custom": manager.metadata(0).custom_metadata, "leaves": {},
                            "extras": [int(restored["items"]["epoch"]), restored["items"]["opt_state"]]}
    for path, expected in arrays.items():
        got, m = restored["items"], meta
        for key in path:
            got, m = got[key], m[key]
        entry["leaves"]["/".join(path)] = {
            "equal": bool(np.array_equal(np.asarray(got), expected)) and np.asarray(got).dtype == expected.dtype,
            "sharding": repr(getattr(m, "sharding", None)),
            "chunk": list(getattr(getattr(m, "storage", None), "chunk_shape", None) or []),
        }
print(json.dumps(report))
"""


def _tree_files(root: pathlib.Path) -> set[str]:
    """Checkpoint entries except OCDBT data files, whose names are content hashes."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.parent.name != "d"}


@pytest.fixture(scope="module", params=[1, 16])
def saved(request, tmp_path_factory) -> tuple[int, pathlib.Path, dict]:
    """The SMALL tree saved by plain Orbax and by write_checkpoint, then restored on 3 devices."""
    devices, out = request.param, tmp_path_factory.mktemp(f"layout{request.param}")
    saved_report = last_json(run_child(SAVE_BOTH, devices, out))
    restored = last_json(run_child(RESTORE_BOTH, 3, out))
    return devices, out, {"save": saved_report, "restore": restored}


def _zarr_jsons(items: pathlib.Path) -> dict[str, dict]:
    """Every array's ``zarr.json`` as stored in the root OCDBT database of ``items``."""
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{items}/"}).result()
    return {key.decode()[:-len("/zarr.json")]: json.loads(bytes(store.read(key).result().value))
            for key in store.list().result() if key.decode().endswith("/zarr.json")}


def test_layout_files_and_metadata_match_plain_orbax(saved):
    """Every file but the data is Orbax's: _METADATA, _sharding and array_metadatas/process_0 as a plain Orbax save
    writes them (chunk shapes aside: ours are the planned ones), _CHECKPOINT_METADATA but its times, the commit
    files, and each array's zarr.json but its chunks and codec chain (ours: the planned chunks, our codec and a
    crc32c; the scalar extra item keeps Orbax's own chain)."""
    devices, out, report = saved
    plain, streamed = out / "plain" / "0", out / "streamed" / "0"
    assert _tree_files(plain) == _tree_files(streamed)
    expected_items = {"_METADATA", "manifest.ocdbt", "ocdbt.process_0", "commit_success.txt", "d"}
    if devices > 1:
        expected_items |= {"_sharding", "array_metadatas"}
    assert {p.name for p in (streamed / "items").iterdir()} == expected_items
    assert (streamed / "items" / "_METADATA").read_text() == (plain / "items" / "_METADATA").read_text()
    if devices > 1:
        assert json.loads((streamed / "items" / "_sharding").read_text()) == json.loads(
            (plain / "items" / "_sharding").read_text())
        read = lambda root: json.loads((root / "items" / "array_metadatas" / "process_0").read_text())
        planned = {name.replace("/", "."): chunk for name, chunk in report["save"]["chunks"].items()}
        want = read(plain)
        for entry in want["array_metadatas"]:
            entry["array_metadata"]["chunk_shape"] = planned[entry["array_metadata"]["param_name"]]
        assert read(streamed) == want
    step_meta = [json.loads((root / "_CHECKPOINT_METADATA").read_text()) for root in (plain, streamed)]
    times = ("init_timestamp_nsecs", "commit_timestamp_nsecs")
    assert all(isinstance(meta.pop(key), int) for meta in step_meta for key in times)
    assert list(step_meta[0]) == list(step_meta[1]) and step_meta[0] == step_meta[1]
    assert step_meta[1]["custom_metadata"] == {"scan_layers": True}
    for kind, root in (("plain", plain), ("streamed", streamed)):
        base = out / kind
        assert (root / "commit_success.txt").read_text() == f"Checkpoint commit was successful to {base / '0'}"
        assert (root / "items" / "commit_success.txt").read_text() == (
            f"Checkpoint commit was successful to {base / '0.orbax-checkpoint-tmp' / 'items'}")
    plain_zarr, streamed_zarr = _zarr_jsons(plain / "items"), _zarr_jsons(streamed / "items")
    assert plain_zarr.keys() == streamed_zarr.keys() == set(planned_names := [
        name.replace("/", ".") for name in report["save"]["chunks"]] + ["epoch"])
    for name in planned_names:
        want = plain_zarr[name]
        if name != "epoch":
            chunk = report["save"]["chunks"][name.replace(".", "/")]
            sharding = want["codecs"][0]["configuration"]
            want["chunk_grid"]["configuration"]["chunk_shape"] = sharding["chunk_shape"] = chunk
            assert [codec["name"] for codec in sharding["codecs"]] == ["bytes", "zstd"]
            sharding["codecs"][1]["configuration"]["level"] = codecs.ZSTD_LEVEL  # the default codec: zstd, level 1
            sharding["codecs"].append({"name": "crc32c"})
        assert streamed_zarr[name] == want, name


def test_write_specs_and_context_are_orbax_own():
    """Each array's tensorstore spec (before our codec and checksum), the merge's and a reader's kvstore specs, and
    the context are what Orbax 0.12.8's builders make, locally and on gs://, for a whole conversion's process 0 and a
    partition's; the context's OCDBT node cache is the one the memory prediction counts."""
    import orbax.checkpoint as ocp
    from etils import epath
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    from orbax.checkpoint._src.serialization import type_handlers

    from ckptconv import settings
    from ckptconv.write import orbax_layout

    assert ocp.__version__ == orbax_layout.ORBAX_VERSION
    for parent in ("/tmp/dst/0.orbax-checkpoint-tmp/items.orbax-checkpoint-tmp", "gs://bucket/zoo/m/0/items",
                   "/tmp/dst/ckptconv-partitions"):
        for shape, dtype, chunk, process_id in (((64, 6, 32), BF16, (4, 1, 32), "0"), ((), np.dtype(np.int64), (), "0"),
                                                ((8, 4), np.dtype(np.float32), (8, 4), "partition3")):
            for compress in (True, False):
                info = type_handlers.ParamInfo(name="params.params.w", parent_dir=epath.Path(parent),
                                               is_ocdbt_checkpoint=True, use_compression=compress, use_zarr3=True,
                                               ocdbt_target_data_file_size=TARGET_FILE_BYTES)
                want = ts_utils.build_array_write_spec(
                    info, ocp.SaveArgs(chunk_byte_size=TARGET_FILE_BYTES), global_shape=shape, local_shape=chunk,
                    dtype=dtype, use_ocdbt=True, process_index=process_id).json
                want = json.loads(json.dumps(want))  # Orbax's shapes are tuples: as JSON they are lists
                assert orbax_layout.array_write_spec(parent, "params.params.w", shape=shape, dtype=dtype,
                                                     chunk_shape=chunk, compress=compress,
                                                     process_id=process_id) == want
        assert orbax_layout.kvstore_spec(parent, merge=True) == ts_utils.build_kvstore_tspec(
            parent, use_ocdbt=True,
            ocdbt_write_options=ts_utils.OcdbtKvStoreWriteOptions(mode=ts_utils.OcdbtWriteMode.MERGE))
        assert orbax_layout.kvstore_spec(parent + "/ocdbt.process_0") == ts_utils.build_kvstore_tspec(
            parent + "/ocdbt.process_0", use_ocdbt=True)
    cache = settings.IN_FLIGHT.ocdbt_cache_bytes
    want = ts_utils.get_ts_context(use_ocdbt=True).spec.to_json()
    want["cache_pool#ocdbt"]["total_bytes_limit"] = cache
    assert orbax_layout.context(cache).spec.to_json() == want


def test_array_metadatas_record_shard_write_shape_and_chunks_inside_it(saved):
    devices, out, _ = saved
    if devices == 1:
        pytest.skip("1-device saves hold numpy leaves: Orbax records no array metadata")
    read = lambda kind: {m["array_metadata"]["param_name"]: m["array_metadata"] for m in json.loads(
        (out / kind / "0" / "items" / "array_metadatas" / "process_0").read_text())["array_metadatas"]}
    plain, streamed = read("plain"), read("streamed")
    assert plain.keys() == streamed.keys()
    for name, meta in streamed.items():
        assert meta["write_shape"] == plain[name]["write_shape"], name
        assert all(w % c == 0 for w, c in zip(meta["write_shape"], meta["chunk_shape"])), name


def test_restores_on_other_device_count_with_same_sharding_and_custom_metadata(saved):
    devices, _, report = saved
    plain, streamed = report["restore"]["plain"], report["restore"]["streamed"]
    assert streamed["custom"] == plain["custom"] == {"scan_layers": True}
    assert streamed["extras"] == plain["extras"] == [0, {}]
    for name, leaf in streamed["leaves"].items():
        assert leaf["equal"], name
        assert leaf["sharding"] == plain["leaves"][name]["sharding"], name
    assert ("checkpoint_sharding_axis" in streamed["leaves"]["params/params/token_embedder/embedding"]
            ["sharding"]) == (devices > 1)
    # Every leaf is stored with the planned chunks (one layer per chunk for "k").
    for name, chunk in report["save"]["chunks"].items():
        if name != "step":
            assert streamed["leaves"][name]["chunk"] == chunk, name
    assert streamed["leaves"]["params/params/decoder/layers/k"]["chunk"][1] == 1


def test_on_tile_reports_each_tile_bytes_once_written(saved):
    _, _, report = saved
    reported: dict[str, list[int]] = {}
    for name, nbytes in report["save"]["tiles"]:
        reported.setdefault(name, []).append(nbytes)
    assert reported == {"k": [16 * 32 * 2] * 6, "kt": [6 * 32 * 8 * 4] * 5, "embedding": [16 * 8 * 4] * 4,
                        "replicated": [3 * 5 * 32 * 2], "step": [4]}


MEMORY = """
import resource
import ml_dtypes, tensorstore as ts
from ckptconv.write.orbax import LeafWrite, write_checkpoint
out = os.environ["OUT"]
shape = (1024, 32, 4096)
def layer(l):  # generated on the fly: 8 MiB per layer, never a list of tiles
    row = ((np.arange(shape[0] * shape[2], dtype=np.int32) + 13 * l) % 251).astype(BF16)
    return row.reshape(shape[0], 1, shape[2])
tiles = lambda: ((0, np.s_[:, l:l + 1, :], layer(l)) for l in range(shape[1]))
leaf = LeafWrite(("params", "params", "decoder", "layers", "mlp", "wi_0", "kernel"), shape, BF16, (64, 1, 4096))
layer(0)  # the producer's own temporaries are not the writer's: count them in the baseline
# nor the writer's start-up (tensorstore's thread pools, the OCDBT driver, the allocator's first heap): one layer's
# leaf written first, so the growth below is what a 32 times larger leaf adds
write_checkpoint(out + "-warm", [LeafWrite(leaf.path, (shape[0], 1, shape[2]), BF16, (64, 1, 4096))],
                 lambda: iter([(0, np.s_[:, 0:1, :], layer(0))]), devices=16, custom_metadata={})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
write_checkpoint(out, [leaf], tiles, devices=16, custom_metadata={"scan_layers": True})
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
array = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": "file://" + out + "/0/items/",
                 "path": ".".join(leaf.path) + "/"}}).result()
checks = [bool(np.array_equal(array[:, l:l + 1, :].read().result(), layer(l))) for l in (0, 17, 31)]
print(json.dumps({"before": before, "peak": peak, "leaf": 2 * int(np.prod(shape)), "checks": checks,
                  "chunk": list(array.chunk_layout.read_chunk.shape)}))
"""


def test_streaming_a_256_mib_leaf_stays_far_below_its_size(tmp_path):
    report = last_json(run_child(MEMORY, 16, tmp_path / "ckpt"))
    growth = report["peak"] - report["before"]
    print(f"RSS before {report['before'] / 2**20:.0f} MiB, peak {report['peak'] / 2**20:.0f} MiB, "
          f"growth {growth / 2**20:.0f} MiB for a {report['leaf'] / 2**20:.0f} MiB leaf")
    assert growth < 0.5 * report["leaf"]
    assert report["checks"] == [True, True, True]
    assert report["chunk"] == [64, 1, 4096]


PACKED = """
from collections import defaultdict
from ckptconv import settings
from ckptconv.read.restore_cost import stored_chunks
from ckptconv.write.orbax import LeafWrite, write_checkpoint
out = os.environ["OUT"]
rows = {"a": (512, 3), "b": (512, 2), "c": (256, 1), "d": (512, 6), "e": (512, 1)}  # one 1 MiB tile per layer (c: 0.5)
leaves = [LeafWrite(("params", "params", name), (r, n, 1024), BF16, (r // 4, 1, 1024)) for name, (r, n) in rows.items()]
tiles = lambda: ((k, np.s_[:, l:l + 1, :], values((r, 1, 1024), BF16, l)) for k, (r, n) in enumerate(rows.values())
                 for l in range(n))
options = settings.RunOptions(data_file_bytes=4 << 20, workers=int(os.environ["WORKERS"]))
write_checkpoint(out, leaves, tiles, devices=1, custom_metadata={}, codec="none", options=options)
files = defaultdict(lambda: defaultdict(int))
for chunk in stored_chunks(out + "/0/items")[0]:
    if chunk.file is not None:
        files[chunk.file][chunk.leaf.rsplit(".", 1)[-1]] += chunk.length
print(json.dumps(sorted([{leaf: round(n / 2**20, 1) for leaf, n in sorted(held.items())} for held in files.values()],
                        key=json.dumps)))
"""


@pytest.mark.parametrize("workers", (1, 2))
def test_a_leaf_starts_a_data_file_unless_all_of_it_fits_in_the_one_being_filled(tmp_path, monkeypatch, workers):
    """Data files of 4 MiB, tiles of 1 MiB, leaves of 3, 2, 0.5, 6 and 1 MiB written in that order: b does not fit
    after a (3 + 2 > 4) and starts a data file, c fits whole after it, d (over the limit) starts one and fills it,
    e fits whole after d's rest. Each leaf is in as few data files as it can be (a host restoring its shard makes a
    request per (leaf, data file) pair it reads, docs/bench/RESTORE.md); filling each file to the limit regardless of
    leaves would have split b over two files and d over three. One device: with more, the files are by device
    (tests/test_spill.py). With workers (RunOptions.workers > 1) a data file commits while the next is gathered:
    the same files."""
    monkeypatch.setenv("WORKERS", str(workers))
    files = last_json(run_child(PACKED, 1, tmp_path / "ckpt"))
    assert files == [{"a": 3.0}, {"b": 2.0, "c": 0.5}, {"d": 2.0, "e": 1.0}, {"d": 4.0}], files


KILLED = """
import signal
from ckptconv.write.orbax import LeafWrite, write_checkpoint
shape = (256, 16, 1024)
def tiles():
    for l in range(shape[1]):
        if l == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        yield 0, np.s_[:, l:l + 1, :], values((shape[0], 1, shape[2]), BF16, l)
write_checkpoint(os.environ["OUT"], [LeafWrite(("params", "params", "w"), shape, BF16, (64, 1, 1024))], tiles,
                 devices=4, custom_metadata={})
"""

RERUN = """
import orbax.checkpoint as ocp
from ckptconv.write.orbax import LeafWrite, write_checkpoint
out, shape = os.environ["OUT"], (256, 16, 1024)
steps_before = list(ocp.CheckpointManager(out, options=ocp.CheckpointManagerOptions(read_only=True)).all_steps())
tiles = lambda: ((0, np.s_[:, l:l + 1, :], values((shape[0], 1, shape[2]), BF16, l)) for l in range(shape[1]))
write_checkpoint(out, [LeafWrite(("params", "params", "w"), shape, BF16, (64, 1, 1024))], tiles, devices=4,
                 custom_metadata={}, codec="none")
stored = sum(f.stat().st_size for f in __import__("pathlib").Path(out, "0", "items").rglob("*") if f.is_file())
manager = ocp.CheckpointManager(out, item_names=("items",))
restored = manager.restore(0, args=ocp.args.Composite(items=ocp.args.PyTreeRestore(
    restore_args={"params": {"params": {"w": ocp.RestoreArgs(restore_type=np.ndarray)}}})))
w = restored["items"]["params"]["params"]["w"]
print(json.dumps({"steps_before": steps_before, "steps_after": list(manager.all_steps()), "stored": stored,
                  "layer9": bool(np.array_equal(w[:, 9:10], values((shape[0], 1, shape[2]), BF16, 9)))}))
"""


@pytest.mark.fault
def test_killed_write_leaves_no_step_and_a_rerun_succeeds(tmp_path):
    out = tmp_path / "ckpt"
    killed = run_child(KILLED, 4, out)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "0").exists()
    leftovers = [p.name for p in out.iterdir()]
    assert leftovers and all(".orbax-checkpoint-tmp" in name for name in leftovers), leftovers
    report = last_json(run_child(RERUN, 4, out))
    stored = report.pop("stored")
    assert report == {"steps_before": [], "steps_after": [0], "layer9": True}
    # Uncompressed, each chunk stored once: the leaf's 8 MiB plus a little metadata.
    assert 256 * 16 * 1024 * 2 <= stored < 1.05 * 256 * 16 * 1024 * 2
    assert [p.name for p in out.iterdir()] == ["0"]  # the interrupted run's tmp dir is gone


# One write per process, as the CLI does (a conversion is a fresh process): a save that fails at its first tile
# leaves Orbax's directory creation running in a thread, which can create step 0's temporary directory after the
# failure; in one process the next save to the same destination then met it (FileExistsError, on a busy machine).
ERRORS = """
import orbax.checkpoint as ocp
from ckptconv.write.orbax import LeafWrite, write_checkpoint
out, report = os.environ["OUT"], {}
emb = values((64, 8), np.dtype(np.float32), 0)
leaf = LeafWrite(("params", "emb"), emb.shape, emb.dtype, (4, 8))
tiles = {
    "misaligned": [(0, np.s_[0:4, :], emb[0:4]), (0, np.s_[4:6, :], emb[4:6]), (0, np.s_[6:64, :], emb[6:64])],
    "short": [(0, np.s_[0:32, :], emb[0:32])],
    "good": [(0, np.s_[32:64, :], emb[32:64]), (0, np.s_[0:32, :], emb[0:32])],
}[os.environ["CASE"]]
try:
    write_checkpoint(out, [leaf], lambda: iter(tiles), devices=16, custom_metadata={})
except Exception as error:
    report["error"] = f"{type(error).__name__}: {error}"
report["steps"] = list(ocp.CheckpointManager(out).all_steps())
print(json.dumps(report))
"""


def test_misaligned_or_missing_tiles_fail_without_a_step_and_complete_step_is_never_overwritten(tmp_path,
                                                                                                 monkeypatch):
    """At one destination, one process after another: tiles that cut through chunks, then tiles that miss half
    the leaf, each fail naming the problem and leave no step; then a complete write; then a second complete
    write is refused and the first step stays."""
    def write(case: str) -> dict:
        monkeypatch.setenv("CASE", case)
        return last_json(run_child(ERRORS, 16, tmp_path / "ckpt"))

    misaligned = write("misaligned")
    assert "params/emb" in misaligned["error"] and "cuts through chunks" in misaligned["error"]
    assert misaligned["steps"] == []
    short = write("short")
    assert "tiles covered 256 of 512 elements" in short["error"]
    assert short["steps"] == []
    assert write("good") == {"steps": [0]}
    again = write("good")
    assert again["error"].startswith("FileExistsError") and "already holds a complete step 0" in again["error"]
    assert again["steps"] == [0]


def test_write_shape_splits_replicated_leaves_like_replica_parallel_orbax():
    assert write_shape((4, 2, 32, 64), 16) == (4, 2, 2, 64)
    assert write_shape((3,), 16) == (3,)
    assert write_shape((), 16) == ()
    assert write_shape((1024, 30), 16) == (64, 30)
    assert write_shape((30, 1024), 16) == (30, 64)


@pytest.mark.parametrize("leaf, devices, message", [
    (LeafWrite((), (2,), BF16, (2,)), 1, "path must be"),
    (LeafWrite(("a",), (0, 3), BF16, (1, 3)), 1, "empty"),
    (LeafWrite(("a",), (2, 3), BF16, (2,)), 1, "does not fit"),
    (LeafWrite(("a",), (2, 3), BF16, (2, 4)), 1, "does not fit"),
    (LeafWrite(("a",), (32, 3), BF16, (3, 3)), 16, "crosses the shards"),
])
def test_invalid_leaves_are_rejected_before_any_write(leaf, devices, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        write_checkpoint(str(tmp_path), [leaf], list, devices=devices, custom_metadata={})
    assert not any(tmp_path.iterdir())


def test_duplicate_and_nested_paths_are_rejected(tmp_path):
    a = LeafWrite(("params", "a"), (2,), BF16, (2,))
    nested = LeafWrite(("params", "a", "b"), (2,), BF16, (2,))
    for leaves in ([a, a], [a, nested], [nested, a]):
        with pytest.raises(ValueError, match="nest|duplicate"):
            write_checkpoint(str(tmp_path), leaves, list, devices=1, custom_metadata={})


LATE_TILE = """
from ckptconv import settings
from ckptconv.write.orbax import LeafWrite, write_checkpoint
shape = (64, 4, 256)
def tiles():
    for l in range(shape[1]):
        yield 0, np.s_[:, l:l + 1, :], values((shape[0], 1, shape[2]), BF16, l)
    yield 0, np.s_[:, 0:1, :], values((shape[0], 1, shape[2]), BF16, 0)  # the leaf again, once complete
try:
    write_checkpoint(os.environ["OUT"], [LeafWrite(("params", "params", "w"), shape, BF16, (16, 1, 256))], tiles,
                     devices=4, custom_metadata={},
                     options=settings.RunOptions(data_files_by_device_asked=os.environ["BY_DEVICE"] == "1"))
except ValueError as err:
    print(json.dumps({"error": str(err)}))
"""


@pytest.mark.parametrize("by_device", (False, True))
def test_a_tile_after_its_leaf_is_complete_is_refused(tmp_path, monkeypatch, by_device):
    """A stream that hands a complete leaf another tile is a bug upstream: refused by name, never written again."""
    monkeypatch.setenv("BY_DEVICE", "1" if by_device else "0")  # the child's environment (run_child copies it)
    error = last_json(run_child(LATE_TILE, 4, tmp_path / "ckpt"))["error"]
    assert error.startswith("params/params/w: tile") and error.endswith("after the leaf was complete"), error


# The CLI run in a child as ``python -m ckptconv`` runs it, then the modules it left imported.
CLI_THEN_MODULES = """
import json, sys
from ckptconv import cli, monitor
monitor.tune_malloc()
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "imported": sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "orbax"))}))
"""


@pytest.mark.parametrize("devices", (1, 16))
def test_a_conversion_process_never_imports_jax_or_orbax(tmp_path, synth_dir, devices):
    """A whole conversion, and one split into two partitions then finalized, each in a fresh process as the CLI
    runs: the checkpoint is written (and restores: the tests above) without JAX or Orbax in the process, whose import
    was most of a small conversion's CPU."""
    src = synth_dir()

    def convert(dst: pathlib.Path, *args: str) -> list[str]:
        env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
        proc = subprocess.run([sys.executable, "-c", CLI_THEN_MODULES, "convert", str(src), str(dst), "--devices",
                               str(devices), "--progress", "none", *args],
                              capture_output=True, text=True, env=dict(env, PYTHONPATH=str(REPO)), timeout=300)
        report = last_json(proc)
        assert report["code"] == 0, proc.stderr[-3000:]
        return report["imported"]

    assert convert(tmp_path / "whole") == []
    assert (tmp_path / "whole" / "0" / "commit_success.txt").exists()
    for step in ("--partition", "0/2"), ("--partition", "1/2"), ("--finalize", "2"):
        assert convert(tmp_path / "parts", *step) == [], step
    assert (tmp_path / "parts" / "0" / "items" / "ocdbt.process_partition1").is_dir()


def test_the_estimate_counts_what_the_writer_holds_ahead():
    """The memory estimate restates the writer's read-ahead, parts in flight and spill-ahead (the plan must not import
    the writer's tensorstore machinery): the two must agree, or admission reserves too little."""
    from ckptconv.plan import estimate
    from ckptconv.write import orbax

    for name in ("READ_AHEAD", "PARTS_IN_FLIGHT", "SPILL_AHEAD"):
        assert getattr(estimate, name) == getattr(orbax, name), name


def test_a_step_missing_an_array_is_never_committed(tmp_path):
    """The last check before the commit: every leaf's array is in the merged root database. A finalize that adopts
    one partition of two, or nothing at all, raises naming what is missing and leaves no complete step 0."""
    import shutil

    from ckptconv.write.orbax import LeafWrite, write_checkpoint, write_partition
    from ckptconv.write.step_commit import StepCommit

    leaves = [LeafWrite(("params", name), (4, 8), np.dtype("float32"), (4, 8)) for name in ("a", "b")]
    staging = tmp_path / "staging"
    write_partition(str(staging), leaves[:1], [0], lambda: iter([(0, np.s_[:, :], np.ones((4, 8), np.float32))]),
                    devices=1, process_id="0of2")

    def adopt_first(items) -> None:  # the second partition never ran
        for child in staging.iterdir():
            shutil.move(str(child), str(items / child.name))

    with pytest.raises(ValueError, match=r"1 array\(s\) missing from the merged checkpoint, not committed: params\.b"):
        write_checkpoint(str(tmp_path / "one"), leaves, lambda: iter([]), devices=1, custom_metadata={},
                         adopt=adopt_first)
    assert not StepCommit(str(tmp_path / "one")).complete()
    with pytest.raises(ValueError, match="nothing was written"):
        write_checkpoint(str(tmp_path / "none"), leaves, lambda: iter([]), devices=1, custom_metadata={},
                         adopt=lambda items: None)
    assert not StepCommit(str(tmp_path / "none")).complete()
