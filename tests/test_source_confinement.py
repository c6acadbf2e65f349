"""A source is read only inside SRC, only from regular files, and never blocks.

Index entries that are absolute, climb with ``..``, hold backslashes or subdirectories, or
resolve (through symlinks) outside SRC are refused in one line (exit 2) for local, ``gs://``
and ``hf://`` sources alike; FIFOs, directories and devices named as shards or config are
refused without being opened blocking.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.plan.conversion import make_plan
from ckptconv.read.safetensors_io import INDEX_FILE, index_checkpoint
from ckptconv.read.sources import LocalSource, check_regular
from tests.conftest import run_cli

MODEL = synth.SynthModel(num_layers=2)
ESCAPES = {
    "dot-dot": "../outside.safetensors",
    "dot-dot inside a path": "sub/../../outside.safetensors",
    "absolute": "/etc/passwd",
    "backslash": "..\\outside.safetensors",
    "subdirectory": "sub/model.safetensors",
    "empty component": "a//b.safetensors",
    "empty": "",
    "dot": ".",
    "newline": "model\n.safetensors",
}


@pytest.fixture
def sharded(synth_dir):
    """A checkpoint in shards with an index, and a valid shard copy outside it (``../outside.safetensors``)."""
    src = synth_dir(MODEL, max_shard_bytes=20_000)
    first = sorted(src.glob("*.safetensors"))[0]
    shutil.copy(first, src.parent / "outside.safetensors")
    return src


def point_index(src: Path, name: str) -> str:
    """Make every tensor of the first shard map to ``name``; returns one such tensor."""
    index = json.loads((src / INDEX_FILE).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    moved = [t for t, f in index["weight_map"].items() if f == first]
    index["weight_map"].update({t: name for t in moved})
    (src / INDEX_FILE).write_text(json.dumps(index))
    return moved[0]


def assert_one_line_refusal(err: BadInputError, *parts: str) -> None:
    message = str(err)
    assert "\n" not in message and "refused" in message, message
    for part in parts:
        assert part in message, message


@pytest.mark.parametrize("case", ESCAPES)
def test_index_entry_leaving_the_source_is_refused(sharded, case):
    tensor = point_index(sharded, ESCAPES[case])
    with pytest.raises(BadInputError) as caught:
        index_checkpoint(LocalSource(str(sharded)))
    assert_one_line_refusal(caught.value, INDEX_FILE, repr(tensor))


def test_symlinks_resolving_outside_the_source_are_refused(sharded, tmp_path):
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    first.unlink()
    first.symlink_to(sharded.parent / "outside.safetensors")  # a valid shard, but outside SRC
    with pytest.raises(BadInputError) as caught:
        index_checkpoint(LocalSource(str(sharded)))
    assert_one_line_refusal(caught.value, str(first), "outside the source directory")

    first.unlink()
    (sharded / "moved.safetensors").write_bytes((sharded.parent / "outside.safetensors").read_bytes())
    first.symlink_to("moved.safetensors")  # a link that stays inside SRC is fine
    make_plan(LocalSource(str(sharded)), devices=1)

    (sharded / "config.json").rename(tmp_path / "config.json")
    (sharded / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(BadInputError) as caught:
        make_plan(LocalSource(str(sharded)), devices=1)
    assert_one_line_refusal(caught.value, "config.json", "outside the source directory")


def test_hugging_face_cache_snapshot_links_to_its_blobs(synth_dir, tmp_path):
    """The hub cache's snapshot files link to ``../../blobs/``: that one place outside SRC is allowed."""
    src = synth_dir(MODEL)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for path in src.iterdir():
        shutil.copy(path, blobs / path.name)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", path.name))
    assert make_plan(LocalSource(str(snapshot)), devices=1).tensor_count > 0
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(src / "config.json")  # outside the repository's cache
    with pytest.raises(BadInputError, match="outside the source directory"):
        make_plan(LocalSource(str(snapshot)), devices=1)


def test_cli_refuses_an_escaping_index_entry(sharded, tmp_path):
    point_index(sharded, "../outside.safetensors")
    dst = tmp_path / "dst"
    result = run_cli("convert", str(sharded), str(dst), "--progress", "none", timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("ckptconv: error: ") and result.stderr.count("\n") == 1
    assert "'../outside.safetensors' climbs out of the source" in result.stderr
    assert not dst.exists()


def test_gcs_index_entry_leaving_the_source_is_refused(gcs, sharded):
    point_index(sharded, "../outside.safetensors")
    bucket = gcs.new_bucket("esc")
    gcs.upload_dir(sharded.parent, f"gs://{bucket}/models")  # ../outside.safetensors exists there
    uri = gcs.upload_dir(sharded, f"gs://{bucket}/models/tiny")
    result = run_cli("plan", uri, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "climbs out of the source" in result.stderr


def test_hub_index_entry_leaving_the_source_is_refused(hub, sharded):
    point_index(sharded, "/etc/passwd")
    hub.add_commit("org/escape", sharded)
    result = run_cli("plan", "hf://org/escape", env=hub.client_env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "'/etc/passwd' is an absolute path" in result.stderr


# Opening a FIFO nobody writes blocks forever: any finite cap tells a refusal from a hang, so this one
# is sized for a busy machine (the refusal itself takes well under a second), not for an idle one.
BLOCKED = 150


@pytest.mark.timeout(BLOCKED)
@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_fifo_is_refused_without_blocking(synth_dir, name):
    src = synth_dir(MODEL)
    (src / name).unlink()
    os.mkfifo(src / name)  # nobody writes: opening it for reading would block forever
    with pytest.raises(BadInputError) as caught:
        make_plan(LocalSource(str(src)), devices=1)
    assert_one_line_refusal(caught.value, str(src / name), "is a FIFO")


@pytest.mark.timeout(BLOCKED)
def test_fifo_index_and_shard_via_cli(sharded, tmp_path):
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    result = run_cli("plan", str(sharded), timeout=BLOCKED - 30)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "is a FIFO" in result.stderr


@pytest.mark.timeout(BLOCKED)
def test_directory_and_device_are_refused(synth_dir):
    src = synth_dir(MODEL)
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").mkdir()
    with pytest.raises(BadInputError) as caught:
        make_plan(LocalSource(str(src)), devices=1)
    assert_one_line_refusal(caught.value, "is a directory")

    os.rmdir(src / "model.safetensors")
    (src / "model.safetensors").symlink_to("/dev/zero")  # outside SRC: refused before it is even opened
    with pytest.raises(BadInputError, match="outside the source directory"):
        make_plan(LocalSource(str(src)), devices=1)
    with pytest.raises(BadInputError) as caught:  # and were it inside, its type is refused
        check_regular("/dev/zero", os.stat("/dev/zero").st_mode)
    assert_one_line_refusal(caught.value, "is a character device")
