"""Data files by restoring device (ckptconv.write.spill): each OCDBT data file holds one device's chunks, or only
replicated leaves', so a host restoring its shard reads its own files and no others; the spill is removed after
a conversion and after a failed one."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from ckptconv import settings
from ckptconv.commands import synth
from ckptconv.read.restore_cost import device_boxes, stored_chunks
from ckptconv.read.stored import read_items_metadata
from ckptconv.write.spill import PREFIX, REPLICATED, DeviceSpill, device_parts, sweep
from tests.conftest import run_cli

MIB = 1024**2
MODEL = synth.SynthModel(num_layers=4, hidden_size=256, intermediate_size=1024, vocab_size=2048)


@pytest.mark.parametrize("shape, region, axis", [
    ((64, 8), (slice(8, 40), slice(0, 8)), 0),  # dim 0 divisible: sharded there
    ((6, 64, 4), (slice(0, 6), slice(0, 64), slice(1, 3)), 1),  # dim 1
])
def test_device_parts_cover_the_region_once_each_inside_one_shard(shape, region, axis):
    devices = 4
    shard = shape[axis] // devices
    data = np.arange(math.prod(len(range(*s.indices(d))) for s, d in zip(region, shape))).reshape(
        [len(range(*s.indices(d))) for s, d in zip(region, shape)])
    whole = np.full(shape, -1)
    for group, into, take in device_parts(region, shape, devices):
        assert into[axis].start // shard == group == (into[axis].stop - 1) // shard  # inside device `group`'s shard
        assert (whole[into] == -1).all()  # each element once
        whole[into] = data[take]
    assert (whole[region] == data).all() and (whole != -1).sum() == data.size


def test_a_replicated_leaf_is_one_part_of_its_own_group():
    assert device_parts((slice(0, 3), slice(0, 5)), (3, 5), 4) == [(REPLICATED, (slice(0, 3), slice(0, 5)),
                                                                     (slice(None), slice(None)))]


def test_spill_reads_back_what_it_took_and_forgets_a_window(tmp_path):
    import ml_dtypes

    spill = DeviceSpill(window=100, directory=str(tmp_path))
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(6).astype(ml_dtypes.bfloat16)
    spill.add(1, 0, (slice(0, 3), slice(0, 4)), a[:, :])
    spill.add(REPLICATED, 1, (slice(0, 6),), b)
    spill.add(0, 0, (slice(3, 6), slice(0, 4)), a.T.T[::-1])  # not contiguous: copied on the way
    assert spill.bytes == 48 + 12 + 48 and spill.full(1) and not DeviceSpill(100, str(tmp_path)).full(1000)
    groups = list(spill.groups())
    assert [g for g, _ in groups] == [0, 1, REPLICATED]  # devices in order, replicated leaves last
    (_, [p0]), (_, [p1]), (_, [pr]) = groups
    assert (spill.read(0, p0) == a[::-1]).all() and (spill.read(1, p1) == a).all()
    assert spill.read(REPLICATED, pr).dtype == b.dtype and (spill.read(REPLICATED, pr) == b).all()
    spill.clear()
    assert spill.bytes == 0 and not list(spill.groups())
    spill.add(1, 0, (slice(0, 3), slice(0, 4)), a + 1)
    (_, [again]), = spill.groups()
    assert again.offset == 0 and (spill.read(1, again) == a + 1).all()
    spill.close()
    assert list(tmp_path.iterdir()) == []


def _convert(src: Path, dst: Path, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none", "--no-compression",
                   "--data-files-by-device", *flags, env=env)


@pytest.mark.parametrize("workers", (1, 4))
def test_each_data_file_holds_one_device_chunks_and_a_host_reads_only_its_own(tmp_path, workers):
    """One worker commits the devices' data files one after another; four commit them two at a time, each in an OCDBT
    database of its own (write.orbax._Lanes): either way a data file holds one device's chunks."""
    src, dst, spill_root = tmp_path / "src", tmp_path / "dst", tmp_path / "tmp"
    synth.write_checkpoint(MODEL, str(src))
    spill_root.mkdir()
    done = _convert(src, dst, "--data-file-size", "1MiB", "--workers", str(workers), env={"TMPDIR": str(spill_root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(spill_root.iterdir()) == []  # the spill is gone
    items = dst / "0" / "items"
    assert len(list(items.glob("ocdbt.process_*"))) == (workers // 2 or 1)  # one writer, or two side by side
    leaves = {".".join(leaf.path): leaf for leaf in read_items_metadata(str(items)) if leaf.chunk_shape is not None}
    owners: dict[str, set] = defaultdict(set)
    chunks, _, _ = stored_chunks(str(items))
    for chunk in chunks:
        leaf = leaves.get(chunk.leaf)
        if chunk.file is None or leaf is None:  # inline in the b-tree, or MaxText's scalar step
            continue
        if leaf.partition_spec is None or all(name is None for name in leaf.partition_spec):
            owners[chunk.file].add("replicated")
            continue
        inside = [d for d in range(4) if all(lo <= i * c < hi for i, c, (lo, hi) in
                                              zip(chunk.index, leaf.chunk_shape, device_boxes(leaf, d)))]
        assert len(inside) == 1, (chunk, inside)
        owners[chunk.file].add(inside[0])
    assert all(len(held) == 1 for held in owners.values()), dict(owners)
    assert {next(iter(held)) for held in owners.values()} >= {0, 1, 2, 3}  # small replicated leaves: inline
    report = json.loads((dst / "ckptconv-report.json").read_text())
    figures = report["restore"]
    assert figures["device_data_files"] == sum(held == {0} for held in owners.values()) + \
        sum(held == {"replicated"} for held in owners.values())
    # a host reads its device's files in one request each (its chunks are all of them), not every file
    assert figures["device_data_files"] < figures["data_files"] / 2, figures
    verified = run_cli("verify", str(src), str(dst), "--progress", "none")
    assert verified.returncode == 0, verified.stdout + verified.stderr


FAILING = """
import tempfile
from ckptconv import settings
from ckptconv.write.orbax import LeafWrite, write_checkpoint
tempfile.tempdir = os.environ["SPILL"]
shape = (256, 16, 1024)
def tiles():
    for l in range(shape[1]):
        if l == 8:
            raise ValueError("source went away")
        yield 0, np.s_[:, l:l + 1, :], values((shape[0], 1, shape[2]), BF16, l)
try:
    write_checkpoint(os.environ["OUT"], [LeafWrite(("params", "params", "w"), shape, BF16, (64, 1, 1024))], tiles,
                     devices=4, custom_metadata={}, options=settings.RunOptions(data_files_by_device_asked=True,
                                                                                workers=int(os.environ["WORKERS"])))
except ValueError as err:
    print(json.dumps({"error": str(err), "spill": os.listdir(os.environ["SPILL"])}))
"""


@pytest.mark.parametrize("workers", (1, 4))  # 4: two commit lanes, spill writes beside the stream
def test_a_failed_write_leaves_no_spill(tmp_path, monkeypatch, workers):
    from tests.test_writer import last_json, run_child

    spill_root = tmp_path / "tmp"
    spill_root.mkdir()
    monkeypatch.setenv("SPILL", str(spill_root))
    monkeypatch.setenv("WORKERS", str(workers))  # the child's environment (run_child copies this process's)
    assert last_json(run_child(FAILING, 4, tmp_path / "ckpt")) == {"error": "source went away", "spill": []}


def test_a_killed_writer_spill_is_swept_by_the_next_one_and_a_live_one_kept(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{PREFIX}{int(gone.stdout)}-abc"
    live = tmp_path / f"{PREFIX}{__import__('os').getpid()}-def"
    other = tmp_path / "ckptconv-spill-notapid"
    for directory in (dead, live, other):
        directory.mkdir()
        (directory / "device-0").write_bytes(b"x" * 10)
    spill = DeviceSpill(window=10, directory=str(tmp_path))
    assert not dead.exists() and live.exists() and other.exists()
    assert sweep(str(tmp_path)) == []
    spill.close()


def test_plan_says_the_spill_disk_a_conversion_needs(tmp_path):
    """``plan`` names the local disk the spill takes at most: two windows of devices x data file size (one
    filling, one being written) and a tile, no more than the output; none on one device or with a data file per
    tile."""
    src = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(src))

    def plan(*flags: str) -> dict:
        done = run_cli("plan", str(src), "--json", "--data-files-by-device", *flags)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    small = plan("--devices", "4", "--data-file-size", "256KiB")
    assert small["spill_disk_bytes"] == 2 * 4 * 256 * 1024 + small["largest_tile_bytes"]
    assert plan("--devices", "16")["spill_disk_bytes"] == plan("--devices", "16")["output_bytes"]  # 1 GiB > model
    assert plan("--devices", "1")["spill_disk_bytes"] == 0
    assert plan("--devices", "4", "--data-file-size", "0")["spill_disk_bytes"] == 0
    unasked = run_cli("plan", str(src), "--json", "--devices", "16")
    assert json.loads(unasked.stdout)["spill_disk_bytes"] == 0  # not asked: tiles written as they come


def test_data_files_are_by_device_by_size_unless_asked(tmp_path):
    """Asked neither way, a conversion writes its data files by device when its output fills more than
    ``settings.AUTO_SPILL_WINDOWS`` spill windows (one: devices x --data-file-size), in the source's order otherwise,
    and never on one device; either flag overrides the size. plan, the conversion and its report follow the same
    choice, and the codec follows it (lz4 by device, zstd in the source's order)."""
    src = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(src))

    def by_device(*flags: str) -> bool:
        done = run_cli("plan", str(src), "--json", *flags)
        assert done.returncode == 0, done.stderr
        planned = json.loads(done.stdout)
        assert planned["data_files_by_device"] is (planned["spill_disk_bytes"] > 0), planned
        return planned["data_files_by_device"]

    output = json.loads(run_cli("plan", str(src), "--json", "--devices", "4").stdout)["output_bytes"]
    windows = settings.AUTO_SPILL_WINDOWS
    over = str((output - 1) // (windows * 4))  # the threshold's windows of 4 data files hold less than the output
    within = str(-(-output // (windows * 4)))  # ... hold all of it
    assert by_device("--devices", "4", "--data-file-size", over)
    assert not by_device("--devices", "4", "--data-file-size", within)
    assert not by_device("--devices", "4", "--data-file-size", over, "--no-data-files-by-device")
    assert by_device("--devices", "4", "--data-file-size", within, "--data-files-by-device")
    assert not by_device("--devices", "1", "--data-file-size", over)
    for size, chosen in ((over, True), (within, False)):
        dst = tmp_path / f"out-{size}"
        done = run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none", "--data-file-size", size)
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads((dst / "ckptconv-report.json").read_text())
        assert report["data_files_by_device"] is chosen
        assert report["compression"] == ("lz4" if chosen else "zstd")  # the codec follows the layout
        figures = report["restore"]
        # by device, a host reads its own device's files (and the replicated leaves'), well under half of them
        assert (figures["device_data_files"] < figures["data_files"] / 2) is chosen, figures


WINDOWS = """
import glob
from ckptconv import settings
from ckptconv.write.orbax import LeafWrite, write_checkpoint
layers = int(os.environ["LAYERS"])
shape = (256, layers, 1024)  # 0.5 MiB a layer: 8 layers fill a window of 4 devices x 1 MiB data files
data_files = []  # when the second tile is taken (the leaf made: its metadata's own data file), and before the last
def tiles():
    for l in range(layers):
        if l == layers - 1:
            time.sleep(1.0)  # a window written beside the stream has its data files by now
        if l in (1, layers - 1):
            data_files.append(len(glob.glob(os.path.join(os.environ["OUT"], "**", "d", "*"), recursive=True)))
        yield 0, np.s_[:, l:l + 1, :], values((shape[0], 1, shape[2]), BF16, l)
write_checkpoint(os.environ["OUT"], [LeafWrite(("params", "params", "w"), shape, BF16, (64, 1, 1024))], tiles,
                 devices=4, custom_metadata={}, options=settings.RunOptions(
                     data_file_bytes=1 << 20, data_files_by_device_asked=True).planned(shape[0] * layers * 2048))
print(json.dumps({"data_files_before_last_tile": data_files[1] - data_files[0]}))
"""


@pytest.mark.parametrize("layers, overlapped", [(12, False), (16, False), (24, True)])
def test_within_two_windows_the_first_is_written_after_the_stream(tmp_path, monkeypatch, layers, overlapped):
    """An output of two spill windows at most (1.5 and 2) is written once the stream has ended, so the stream's peak
    and a commit's never meet (plan.estimate counts the larger only); a bigger one (3) writes its first window while
    the stream goes on."""
    from tests.test_writer import last_json, run_child

    monkeypatch.setenv("LAYERS", str(layers))
    report = last_json(run_child("import time\n" + WINDOWS, 4, tmp_path / "ckpt"))
    assert (report["data_files_before_last_tile"] > 0) is overlapped, report
