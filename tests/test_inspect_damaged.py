"""``inspect`` and ``verify`` on damaged checkpoints: one line per problem, exit 1, never a traceback
(issue 13). Damage is real: files emptied, truncated, metadata overwritten after a real conversion."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One real conversion for the module; each test damages its own copy."""
    from ckptconv.commands import synth

    root = tmp_path_factory.mktemp("damaged")
    src, dst = root / "src", root / "dst"
    synth.write_checkpoint(synth.SynthModel(), str(src))
    assert run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none").returncode == 0
    return src, dst


@pytest.fixture
def converted(pristine, tmp_path):
    src, dst = pristine
    shutil.copytree(dst, tmp_path / "dst")
    return src, tmp_path / "dst"


def _data_files(dst):
    return sorted((dst / "0" / "items").glob("ocdbt.process_*/d/*"))


def _no_traceback(*results):
    for result in results:
        assert "Traceback" not in result.stdout + result.stderr, result.stderr[-2000:]


def test_emptied_data_files_make_it_incomplete(converted):
    src, dst = converted
    for file in _data_files(dst):
        file.write_bytes(b"")
    inspected = run_cli("inspect", str(dst), "--json")
    result = json.loads(inspected.stdout)
    assert inspected.returncode == 1 and not result["complete"]
    assert result["problems"] and all(p.endswith("empty data file") for p in result["problems"])
    verified = run_cli("verify", str(src), str(dst))
    assert verified.returncode == 1 and verified.stderr.count("\n") == 1
    _no_traceback(inspected, verified)


def test_a_truncated_data_file_is_found_by_a_deep_inspect(converted):
    src, dst = converted
    biggest = max(_data_files(dst), key=lambda f: f.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    deep = run_cli("inspect", str(dst), "--deep")
    assert deep.returncode == 1 and "INCOMPLETE" in deep.stdout and "unreadable" in deep.stdout
    verified = run_cli("verify", str(src), str(dst))
    assert verified.returncode == 1
    _no_traceback(deep, verified)


@pytest.mark.parametrize("damage", ["_METADATA", "_sharding", "manifest.ocdbt"])
def test_damaged_metadata_is_one_line(converted, damage):
    src, dst = converted
    (dst / "0" / "items" / damage).write_bytes(b"{not json")
    inspected, verified = run_cli("inspect", str(dst)), run_cli("verify", str(src), str(dst))
    for result in (inspected, verified):
        assert result.returncode == 1
        assert result.stderr.count("\n") <= 1 or "INCOMPLETE" in result.stdout, result.stderr
    _no_traceback(inspected, verified)


def test_an_intact_checkpoint_passes_a_deep_inspect(converted):
    _, dst = converted
    deep = run_cli("inspect", str(dst), "--deep", "--json")
    assert deep.returncode == 0 and json.loads(deep.stdout)["complete"] and json.loads(deep.stdout)["problems"] == []


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_deep_check_reading_ahead_finds_what_one_read_at_a_time_finds(converted, damage):
    """``verify DST`` reads and decodes several chunks at once (``--workers``, default: one fewer than the cores): the
    same problems, in the same order, as one chunk at a time."""
    _, dst = converted
    for file in _data_files(dst):
        data = bytearray(file.read_bytes())
        if damage == "truncated":
            data = data[: len(data) * 2 // 3]
        else:
            for at in range(len(data) // 7, len(data), max(1, len(data) // 5)):
                data[at] ^= 0x5A
        file.write_bytes(bytes(data))
    results = [run_cli("verify", str(dst), "--json", "--workers", workers) for workers in ("1", "4")]
    one, four = (json.loads(result.stdout) for result in results)
    assert [r.returncode for r in results] == [1, 1] and one["mismatches"], one
    assert one == four
    _no_traceback(*results)


def test_a_sharding_entry_without_its_fields_names_the_file(converted):
    """``_sharding`` that is JSON but whose NamedSharding entry lacks its mesh shape: the line names that file (it
    said only "cannot read the checkpoint: KeyError: 'shape'")."""
    src, dst = converted
    file = dst / "0" / "items" / "_sharding"
    recorded = json.loads(file.read_text())
    name, value = next((k, json.loads(v)) for k, v in recorded.items() if v and "shape" in json.loads(v))
    del value["shape"]
    file.write_text(json.dumps({**recorded, name: json.dumps(value)}))
    results = run_cli("inspect", str(dst)), run_cli("verify", str(src), str(dst))
    for result in results:
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert "_sharding: not readable as this checkpoint's metadata" in result.stderr, result.stderr
    _no_traceback(*results)


def test_a_deep_check_reads_no_more_chunks_at_once_than_fit_its_budget(pristine):
    """A stored chunk is a whole shard (up to 2 GiB, MaxText's chunk_byte_size): a deep check's reads ahead are as
    many as the budget holds, each the largest chunk read and decoded (twice its bytes), one at least."""
    from ckptconv.commands.inspection import chunks_in_flight
    from ckptconv.read.stored import read_metadata

    leaves, _ = read_metadata(str(pristine[1]))
    largest = max(math.prod(leaf.chunk_shape) * (2 if leaf.dtype == "bfloat16" else 4)
                  for leaf in leaves if leaf.chunk_shape is not None and leaf.shape)
    assert {leaf.dtype for leaf in leaves if leaf.shape} <= {"bfloat16", "float32"}
    assert chunks_in_flight(leaves, 8, None) == 8  # no budget: as many as asked
    assert chunks_in_flight(leaves, 8, 3 * 2 * largest) == 3
    assert chunks_in_flight(leaves, 8, 3 * 2 * largest - 1) == 2
    assert chunks_in_flight(leaves, 2, 100 * largest) == 2  # never more than asked
    assert chunks_in_flight(leaves, 8, 1) == 1  # one at least
