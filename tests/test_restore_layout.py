"""The layout a restoring host reads (issue 27): tiles gathered into OCDBT data files of the writer's target
size, chunks as the tile plan says, and the report's restore figures computed from the stored layout.

Each conversion runs ``python -m ckptconv convert --data-file-size SIZE``, uncompressed, so a data file's size is the
bytes of tiles gathered into it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ckptconv.commands import synth
from ckptconv.read.restore_cost import READ_COALESCING_BYTES, device_boxes, requests, stored_chunks
from ckptconv.read.stored import read_items_metadata

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024**2
MODEL = synth.SynthModel(num_layers=4, hidden_size=256, intermediate_size=1024, vocab_size=2048)

def convert(src: Path, dst: Path, limit: int, devices: int = 16, *flags: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", str(devices),
                             "--progress", "none", "--no-compression", "--data-file-size", str(limit), *flags],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((dst / "ckptconv-report.json").read_text())


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fastload") / "src"
    synth.write_checkpoint(MODEL, str(directory))
    return directory


def _data_files(items: Path) -> dict[str, int]:
    """Every data file holding chunks, and the bytes of chunks in it."""
    chunks, _, _ = stored_chunks(str(items))
    files: dict[str, int] = {}
    for chunk in chunks:
        if chunk.file is not None:
            files[chunk.file] = files.get(chunk.file, 0) + chunk.length
    return files


def test_data_files_gather_each_device_parts_up_to_the_target(source, tmp_path):
    """Tiles' device parts wait in a window of 16 targets and are written device by device, one commit per data
    file: each data file holds at most the target (plus its chunks' checksums); at 1 MiB each device's share of the
    model fills files up to the target; with a data file per tile (the limit 0) each file holds every device's
    chunks of its tile, so a host reads more than twice as many."""
    limit = 1 * MIB
    report = convert(source, tmp_path / "gathered", limit, 16, "--data-files-by-device")
    items = tmp_path / "gathered" / "0" / "items"
    files = _data_files(items)
    total = sum(files.values())
    inline = sum(chunk.length for chunk in stored_chunks(str(items))[0] if chunk.file is None)  # small ones
    assert total + inline >= report["output_bytes"]  # uncompressed: every byte of every leaf, plus checksums
    slack = 4 * report["restore"]["chunks"]  # a crc32c per chunk
    assert max(files.values()) <= limit + slack, sorted(files.values())
    # a device's share of the model (1/16 of it) in as few files as the target allows, per window
    share = report["output_bytes"] / 16
    windows = math.ceil(report["output_bytes"] / (16 * limit))
    assert report["restore"]["device_data_files"] <= math.ceil(share / (limit / 2)) + windows, report["restore"]
    assert report["restore"]["data_files"] == len(files)

    alone = convert(source, tmp_path / "alone", 0)
    assert alone["restore"]["chunks"] == report["restore"]["chunks"]  # the chunks do not depend on the files
    in_order = convert(source, tmp_path / "in-order", limit)  # not asked: data files in the source's order
    assert in_order["restore"]["device_data_files"] > 2 * report["restore"]["device_data_files"]
    assert alone["restore"]["device_data_files"] > 2 * report["restore"]["device_data_files"], (alone["restore"],
                                                                                                report["restore"])
    assert alone["restore"]["device_reads"] > 2 * report["restore"]["device_reads"]


def test_report_restore_figures_match_the_layout(source, tmp_path):
    """chunks = the chunk grid of every leaf; device 0's chunks = those inside its shard; its reads = its
    chunks' byte ranges merged within each data file (Orbax's coalescing) plus the manifest and b-tree nodes."""
    dst = tmp_path / "out"
    figures = convert(source, dst, 4 * MIB)["restore"]
    items = dst / "0" / "items"
    leaves = [leaf for leaf in read_items_metadata(str(items)) if leaf.chunk_shape is not None]  # no scalars
    grid = sum(math.prod(-(-d // c) for d, c in zip(leaf.shape, leaf.chunk_shape)) for leaf in leaves)
    assert figures["chunks"] == grid
    assert figures["devices"] == 16 and figures["device"] == 0
    mine = 0
    for leaf in leaves:
        box = device_boxes(leaf, 0)
        mine += math.prod(-(-hi // c) - lo // c for (lo, hi), c in zip(box, leaf.chunk_shape))
    assert figures["device_chunks"] == mine
    assert figures["device_chunks"] < figures["chunks"]  # a shard, not the whole checkpoint
    chunks, nodes, _ = stored_chunks(str(items))
    assert figures["all_devices_reads"] == 1 + nodes + requests(chunks)[0]
    assert 1 + nodes + figures["device_data_files"] <= figures["device_reads"] <= 1 + nodes + figures["device_chunks"]
    assert figures["coalescing_bytes"] == READ_COALESCING_BYTES
    assert figures["largest_data_file_bytes"] <= 4 * MIB + 4 * figures["chunks"]


def test_requests_merge_close_ranges_of_one_file():
    from ckptconv.read.restore_cost import StoredChunk

    def chunk(file, offset, length):
        return StoredChunk("x", (0,), file, offset, length)

    assert requests([chunk("a", 0, 10), chunk("a", 10, 10), chunk("a", 20 + READ_COALESCING_BYTES, 5),
                     chunk("b", 0, 1), chunk(None, 0, 3)]) == (3, 20 + 5 + 1)


def test_restore_figures_of_a_gcs_destination(tmp_path, gcs):
    """On gs:// the report's restore figures are read from the bucket, as locally."""
    from tests.conftest import run_cli

    src = tmp_path / "src"
    synth.write_checkpoint(synth.SynthModel(), str(src))
    dst = f"gs://{gcs.new_bucket('fastload')}/tiny"
    result = run_cli("convert", str(src), dst, "--devices", "4", "--progress", "none")
    assert result.returncode == 0, result.stderr
    figures = json.loads(gcs.read(dst + "/ckptconv-report.json"))["restore"]
    assert "error" not in figures, figures
    assert figures["devices"] == 4 and figures["chunks"] > figures["device_chunks"] > 0
    assert figures["data_files"] >= 1 and figures["device_reads"] >= 2  # the manifest, a b-tree node, data
    assert figures["device_read_seconds"] > 0 and figures["device_decoded_bytes"] > 0  # read back from the bucket


def test_plan_predicts_the_data_file_size_convert_is_given(source):
    """``--data-file-size`` is what ``plan`` predicts with (Prefect admits by it): by device a commit holds its data
    file twice (the chunks and their lz4 copy), beside the stream when the output fills more than two spill windows
    (16 x the size each: one window is written while the next fills); within two windows the spill is written after
    the stream and only the larger counts, the writer's less the stream's runtime (tests/test_memory.py holds the
    default to measured peaks); a size that is not one is refused in one line. One worker: one data file at a time
    (more commit side by side, tests/test_workers.py), and its tiles go to the spill as they come, two fewer alive
    than where tensorstore writes them."""
    from ckptconv.plan.estimate import DATA_FILE_FACTOR_BY_DEVICE, STREAM_RUNTIME_BYTES

    def plan(size: str | int) -> dict | subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-m", "ckptconv", "plan", str(source), "--devices", "16", "--json",
                                 "--data-file-size", str(size), "--data-files-by-device", "--workers", "1"],
                                capture_output=True,
                                text=True, cwd=ROOT, timeout=120)
        return json.loads(result.stdout) if result.returncode == 0 else result

    def writer(planned: dict) -> int:
        size = planned["data_file_bytes"]
        return int(min(max(size, planned["largest_tile_bytes"]), planned["output_bytes"]) * DATA_FILE_FACTOR_BY_DEVICE)

    alone, windows, one = (plan(size) for size in ("0", "128KiB", "4MiB"))
    assert (alone["data_file_bytes"], windows["data_file_bytes"], one["data_file_bytes"]) == (0, 128 * 1024, 4 * MIB)
    output = alone["output_bytes"]
    assert 3 * 16 * 128 * 1024 <= output <= 16 * 4 * MIB
    size = output // 24  # a window of two thirds of the output: 1.5 windows
    between = plan(size)
    terms = {name: planned["predicted_peak_terms"] for name, planned in
             (("alone", alone), ("windows", windows), ("one", one), ("between", between))}
    for name, planned in (("alone", alone), ("windows", windows), ("one", one), ("between", between)):
        t = terms[name]
        assert planned["predicted_peak_rss_bytes"] == t["baseline"] + t["cache"] + t["overlap"], name
        assert planned["data_files_by_device"] is (name != "alone"), name
    assert terms["alone"]["writer"] == 0 and terms["alone"]["overlap"] == terms["alone"]["producer"]
    assert terms["windows"]["producer"] < terms["alone"]["producer"]  # the spill takes the tiles as they come
    assert terms["windows"]["writer"] == writer(windows)
    assert terms["windows"]["overlap"] == terms["windows"]["producer"] + writer(windows)
    for name, planned in (("one", one), ("between", between)):  # the lane after the stream: two parts read back too
        assert writer(planned) < terms[name]["writer"] <= writer(planned) + 2 * planned["largest_tile_bytes"], name
        assert terms[name]["overlap"] == max(terms[name]["producer"],
                                             terms[name]["writer"] - STREAM_RUNTIME_BYTES), name
    bad = plan("lots")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "ckptconv: error: --data-file-size 'lots': expected a size like 5GB, 500MB or 2GiB"]


def test_report_times_reading_device_0_shard_back(source, tmp_path):
    """The report's restore figures carry the measured read of device 0's shard (every byte of it decoded), beside
    the computed reads."""
    figures = convert(source, tmp_path / "timed", 4 * MIB)["restore"]
    items = tmp_path / "timed" / "0" / "items"
    leaves = [leaf for leaf in read_items_metadata(str(items)) if leaf.chunk_shape is not None and leaf.shape]
    itemsize = {"bfloat16": 2, "float32": 4}
    shard = sum(math.prod(hi - lo for lo, hi in device_boxes(leaf, 0)) * itemsize[leaf.dtype] for leaf in leaves)
    assert figures["device_decoded_bytes"] == figures["device_shard_bytes"] == shard
    assert 0 < figures["device_read_seconds"] < 60
    from ckptconv.read.restore_probe import time_device_read

    limit = shard // 4  # a shard over the probe's limit is sampled: about the limit, from its first leaves to its last
    sampled = time_device_read(str(items), leaves, limit=limit)
    assert sampled["device_shard_bytes"] == shard and limit // 2 <= sampled["device_decoded_bytes"] <= limit


@pytest.mark.parametrize("box, chunk", [(((0, 64), (0, 48), (0, 1024)), (4, 1, 1024)),
                                        (((16, 32), (0, 1024)), (16, 64)), (((0, 3),), (3,))])
def test_probe_pieces_are_whole_chunks_within_the_limit_covering_the_box_once(box, chunk):
    import numpy as np

    from ckptconv.read.restore_probe import pieces

    limit = 64 * 1024
    seen = np.zeros([hi for _, hi in box], dtype=np.int8)
    for piece in pieces(box, chunk, 2, limit):
        size = 2 * math.prod(s.stop - s.start for s in piece)
        assert size <= limit or all(s.stop - s.start <= c for s, c in zip(piece, chunk)), piece  # or one chunk
        assert all((s.start - lo) % c == 0 for s, (lo, _), c in zip(piece, box, chunk)), piece  # chunk-aligned
        seen[piece] += 1
    inside = tuple(slice(lo, hi) for lo, hi in box)
    assert (seen[inside] == 1).all() and seen.sum() == math.prod(hi - lo for lo, hi in box)
