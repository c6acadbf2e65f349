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

def convert(src: Path, dst: Path, limit: int, devices: int = 16) -> dict:
    result = subprocess.run([sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", str(devices),
                             "--progress", "none", "--no-compression", "--data-file-size", str(limit)],
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


def test_data_files_gather_tiles_up_to_the_target(source, tmp_path):
    """Each data file holds at most the target (plus its chunks' checksums) and, but the last, more than the
    target less one tile (one commit per data file); a data file per tile (the limit 0) makes many more."""
    limit = 4 * MIB  # above the largest tile (2 MiB): a tile over the limit is a data file of its own
    report = convert(source, tmp_path / "gathered", limit)
    items = tmp_path / "gathered" / "0" / "items"
    files = _data_files(items)
    total = sum(files.values())
    inline = sum(chunk.length for chunk in stored_chunks(str(items))[0] if chunk.file is None)  # small ones
    assert total + inline >= report["output_bytes"]  # uncompressed: every byte of every leaf, plus checksums
    slack = 4 * report["restore"]["chunks"]  # a crc32c per chunk
    assert max(files.values()) <= limit + slack, sorted(files.values())
    # one commit per data file: each but the last was closed by a tile that did not fit any more
    tile = json.loads(subprocess.run([sys.executable, "-m", "ckptconv", "plan", str(source), "--devices", "16", "--json"],
                                     capture_output=True, text=True, cwd=ROOT, check=True).stdout)["largest_tile_bytes"]
    assert tile < limit
    assert all(size >= limit - tile for size in sorted(files.values())[1:]), (sorted(files.values()), tile)
    assert len(files) <= math.ceil(total / (limit - tile)) + 1, (len(files), total)
    assert report["restore"]["data_files"] == len(files)

    alone = convert(source, tmp_path / "alone", 0)
    assert alone["restore"]["chunks"] == report["restore"]["chunks"]  # the chunks do not depend on the files
    assert alone["restore"]["data_files"] > 2 * report["restore"]["data_files"], (alone["restore"], report["restore"])
    assert alone["restore"]["device_reads"] > report["restore"]["device_reads"]


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


def test_plan_predicts_the_data_file_size_convert_is_given(source):
    """``--data-file-size`` is what ``plan`` predicts with (Prefect admits by it): the transaction's tiles at
    1.25 bytes per byte gathered (tests/test_memory.py holds the default to measured peaks); a size that is not
    one is refused in one line."""
    def plan(size: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckptconv", "plan", str(source), "--devices", "16", "--json",
                               "--data-file-size", size], capture_output=True, text=True, cwd=ROOT, timeout=120)

    alone, gathered = (json.loads(plan(size).stdout) for size in ("0", "4MiB"))
    assert (alone["data_file_bytes"], gathered["data_file_bytes"]) == (0, 4 * MIB)
    held = min(max(4 * MIB, gathered["largest_tile_bytes"]), gathered["output_bytes"])
    assert gathered["predicted_peak_rss_bytes"] - alone["predicted_peak_rss_bytes"] == int(held * 1.25)
    bad = plan("lots")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "ckptconv: error: --data-file-size 'lots': expected a size like 5GB, 500MB or 2GiB"]
