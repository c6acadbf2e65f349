"""Issue 22, third adversarial pass: what could lose data or be silently wrong, one test per class.

One small Qwen3 is converted once per module (in this process, 16 simulated devices); each test
works on its own copies. Refusals run the CLI, whose exit status and one-line message are what
is tested.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.commands.export import ExportRequest, export
from tests.conftest import run_cli

MODEL = synth.SynthModel(model_type="qwen3", num_layers=2)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """(SRC, CKPT): a synthetic HF model and its MaxText checkpoint, never modified by tests."""
    import jax

    assert jax.device_count() == 16  # conftest's devices: in-process conversions use all 16
    root = tmp_path_factory.mktemp("converted")
    src, ckpt = root / "src", root / "ckpt"
    synth.write_checkpoint(MODEL, str(src))
    (src / "tokenizer.json").write_text('{"model": "synthetic"}\n')
    (src / "generation_config.json").write_text('{"do_sample": false}\n')
    convert(ConvertRequest(str(src), str(ckpt), devices=16, progress="none"))
    return src, ckpt


def tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# --- data lost -----------------------------------------------------------------------------

def test_convert_report_inside_the_source_is_refused_and_the_source_kept(synth_dir, tmp_path):
    src = synth_dir()
    before = tree_digest(src)
    result = run_cli("convert", str(src), str(tmp_path / "dst"), "--progress", "none", "--devices", "1",
                     "--report", str(src / "model.safetensors"))
    assert result.returncode == 2 and "inside the source" in one_line(result)
    assert tree_digest(src) == before and not (tmp_path / "dst").exists()


@pytest.mark.parametrize("inside, label", [("ckpt", "checkpoint"), ("hf", "destination")])
def test_export_report_inside_the_checkpoint_or_hf_dst_is_refused(converted, tmp_path, inside, label):
    src, ckpt = converted
    work = tmp_path / "ckpt"
    shutil.copytree(ckpt, work)
    hf = tmp_path / "hf"
    assert run_cli("export", str(work), str(hf), "--like", str(src), "--progress", "none").returncode == 0
    before = {"ckpt": tree_digest(work), "hf": tree_digest(hf)}
    target = {"ckpt": work / "0" / "items" / "manifest.ocdbt", "hf": hf / "model.safetensors"}[inside]
    result = run_cli("export", str(work), str(hf), "--like", str(src), "--progress", "none", "--overwrite",
                     "--report", str(target))
    assert result.returncode == 2 and f"inside the {label}" in one_line(result)
    assert {"ckpt": tree_digest(work), "hf": tree_digest(hf)} == before


def test_export_like_its_own_destination_with_overwrite_keeps_the_tokenizer(converted, tmp_path):
    src, ckpt = converted
    like = tmp_path / "model"
    shutil.copytree(src, like)
    kept = {name: (like / name).read_bytes() for name in ("tokenizer.json", "generation_config.json")}
    export(ExportRequest(str(ckpt), str(like), like=str(like), overwrite=True, progress="none"))
    assert {name: (like / name).read_bytes() for name in kept} == kept
    assert json.loads((like / "ckptconv-report.json").read_text())["status"] == "complete"


def test_export_leaves_a_pending_directory_it_did_not_create(converted, tmp_path):
    src, ckpt = converted
    hf = tmp_path / "hf"
    (hf / ".ckptconv-pending").mkdir(parents=True)
    (hf / ".ckptconv-pending" / "notes.txt").write_text("mine\n")
    result = run_cli("export", str(ckpt), str(hf), "--like", str(src), "--progress", "none")
    assert result.returncode == 2 and ".ckptconv-pending" in one_line(result)
    assert (hf / ".ckptconv-pending" / "notes.txt").read_text() == "mine\n"


# --- silently wrong ------------------------------------------------------------------------

def _partition(src, dst, spec: str):
    return run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--partition", spec)


@pytest.mark.parametrize("damage", ["deleted", "emptied", "flipped"])
def test_finalize_refuses_partitions_whose_staged_data_changed_and_a_rerun_repairs(synth_dir, tmp_path, damage):
    src, dst = synth_dir(), tmp_path / "dst"
    for index in range(2):
        assert _partition(src, dst, f"{index}/2").returncode == 0
    data = max((dst / "ckptconv-partitions" / "ocdbt.process_partition1" / "d").iterdir(),
               key=lambda p: p.stat().st_size)
    if damage == "deleted":
        data.unlink()
    elif damage == "emptied":
        data.write_bytes(b"")
    else:
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    early = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--finalize", "2")
    assert early.returncode == 1 and data.name in one_line(early) and "partition 1/2" in early.stderr
    assert not (dst / "0").exists() and not (dst / "ckptconv-report.json").exists()
    redo = _partition(src, dst, "1/2")  # its marker no longer vouches for the data: redone, not skipped
    assert redo.returncode == 0 and "nothing to do" not in redo.stdout
    assert run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4",
                   "--finalize", "2").returncode == 0
    assert json.loads(run_cli("verify", str(src), str(dst), "--json").stdout)["ok"]


def test_export_refuses_a_like_that_contradicts_what_the_checkpoint_was_converted_with(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    model = synth.SynthModel(model_type="llama", config_overrides={"rope_scaling": rope})
    src, ckpt, like, hf = (tmp_path / name for name in ("src", "ckpt", "like", "hf"))
    synth.write_checkpoint(model, str(src))
    assert run_cli("convert", str(src), str(ckpt), "--progress", "none", "--devices", "1").returncode == 0
    like.mkdir()
    config = model.config()
    del config["rope_scaling"]
    (like / "config.json").write_text(json.dumps(config))
    for checkpoint in (ckpt, ckpt / "0" / "items"):
        result = run_cli("export", str(checkpoint), str(hf), "--like", str(like), "--progress", "none")
        assert result.returncode == 2 and "runtime.rope_scaling" in one_line(result)
        assert not hf.exists()
    assert run_cli("export", str(ckpt), str(hf), "--like", str(src), "--progress", "none").returncode == 0


# --- unclean: locks, signals -----------------------------------------------------------------

def _convert(src, dst, *flags: str):
    return run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "1", *flags)


@pytest.mark.parametrize("content", [b"", b"[1, 2]", b"\xff\xfe not utf-8", b'"a string"'])
def test_a_lock_that_names_no_holder_is_stale_not_someone_elses(synth_dir, tmp_path, content):
    src, dst = synth_dir(), tmp_path / "dst"
    dst.mkdir()
    (dst / "ckptconv.lock").write_bytes(content)
    result = _convert(src, dst)
    assert result.returncode == 0, result.stderr
    assert not (dst / "ckptconv.lock").exists()


@pytest.mark.fault
def test_a_full_disk_when_the_lock_is_created_leaves_no_lock(synth_dir, tmp_path):
    import os
    import subprocess

    src, where = synth_dir(), tmp_path / "fs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4096k", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not permitted'})")
    try:
        dst = where / "dst"
        dst.mkdir()
        filler = where / "filler"
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY)  # every block taken: the lock's bytes cannot be written
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        full = _convert(src, dst)
        assert full.returncode == 1 and "no space left on device" in one_line(full)
        assert sorted(p.name for p in dst.iterdir()) == []
        filler.unlink()
        assert _convert(src, dst).returncode == 0
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_partition_another_live_run_holds_is_refused(synth_dir, tmp_path):
    from ckptconv.write import lock

    src, dst = synth_dir(), tmp_path / "dst"
    staging = dst / "ckptconv-partitions"
    staging.mkdir(parents=True)
    (staging / "partition1.lock").write_text(json.dumps(lock._me()))  # this test process: alive, on this host
    held = _partition(src, dst, "1/2")
    assert held.returncode == 1 and "partition1.lock" in one_line(held) and "another conversion" in held.stderr
    assert not (staging / "ocdbt.process_partition1").exists()
    assert _partition(src, dst, "0/2").returncode == 0  # another partition is not held


def test_sigterm_during_finalize_commits_nothing_and_a_rerun_finishes(synth_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.held import held_at_event, hold_at

    src, dst = synth_dir(), tmp_path / "dst"
    for index in range(2):
        assert _partition(src, dst, f"{index}/2").returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # held there (tests.held): a SIGSTOP sent after reading the line let a quick finalize commit first
    proc = subprocess.Popen([sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", "4",
                             "--progress", "jsonl", "--finalize", "2"], cwd=ROOT, env={**env, **hold_at("plan")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held_at_event(proc, "plan")  # the partitions are checked, the commit starts
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("ckptconv: terminated (SIGTERM)")
    assert json.loads((dst / "ckptconv-report.json").read_text())["status"] != "complete"
    again = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--finalize", "2")
    assert again.returncode == 0, again.stderr
    assert json.loads(run_cli("verify", str(src), str(dst), "--json").stdout)["ok"]


# --- damaged checkpoints: inspect --deep decodes, export says one line ----------------------------

LEAF = "params.params.decoder.layers.mlp.wi_0.kernel"


def value_location(items: Path, key: str) -> tuple[Path, int, int]:
    """(OCDBT data file, offset, length) of the stored value of ``key``."""
    from ckptconv.read.stored import open_database

    value = bytes(open_database(str(items)).read(key).result().value)
    for file in sorted(items.glob("**/d/*")):
        at = file.read_bytes().find(value)
        if at >= 0:
            return file, at, len(value)
    raise AssertionError(f"{key}: its value is in no data file")


def corrupt_value(items: Path, key: str, offset: int, mask: int = 0x01) -> Path:
    """Flip bits of byte ``offset`` (negative: from the end) of the stored value of ``key``."""
    file, at, length = value_location(items, key)
    raw = bytearray(file.read_bytes())
    raw[at + offset % length] ^= mask
    file.write_bytes(bytes(raw))
    return file


def cut_value(items: Path, key: str) -> Path:
    """Truncate the data file holding ``key``'s value half way through that value."""
    file, at, length = value_location(items, key)
    file.write_bytes(file.read_bytes()[: at + length // 2])
    return file


@pytest.fixture
def damaged_copy(converted, tmp_path):
    src, ckpt = converted
    shutil.copytree(ckpt, tmp_path / "ckpt")
    return src, tmp_path / "ckpt"


@pytest.mark.parametrize("offset, mask, what", [(0, 0xFF, "compressed frame"), (-1, 0x01, "shard index crc32c")])
def test_deep_inspect_decodes_every_chunk(damaged_copy, offset, mask, what):
    _, ckpt = damaged_copy
    corrupt_value(ckpt / "0" / "items", f"{LEAF}/c/1/0/0", offset, mask)
    shallow = run_cli("inspect", str(ckpt))
    assert shallow.returncode == 0  # the bytes are all there
    deep = run_cli("inspect", str(ckpt), "--deep", "--json")
    result = json.loads(deep.stdout)
    assert deep.returncode == 1 and not result["complete"], what
    assert any(p.startswith("params/params/decoder/layers/mlp/wi_0/kernel: chunk [1, 0, 0] does not decode")
               for p in result["problems"]), result["problems"]


def _chunk_file(items: Path) -> Path:
    return value_location(items, f"{LEAF}/c/1/0/0")[0]


OTHER_LAYOUT = {"tree_metadata": {"('x',)": {"key_metadata": [{"key": "x", "key_type": 2}], "value_metadata": {
    "value_type": "jax.Array", "skip_deserialize": False}}}, "use_zarr3": True}
DAMAGE = {
    "truncated data file": lambda i: cut_value(i, f"{LEAF}/c/1/0/0"),
    "emptied data file": lambda i: _chunk_file(i).write_bytes(b""),
    "deleted data file": lambda i: _chunk_file(i).unlink(),
    "flipped shard index": lambda i: corrupt_value(i, f"{LEAF}/c/1/0/0", -1),
    "garbage manifest": lambda i: (i / "manifest.ocdbt").write_bytes(b"garbage" * 10),
    "truncated _METADATA": lambda i: (i / "_METADATA").write_bytes((i / "_METADATA").read_bytes()[:100]),
    "empty _METADATA": lambda i: (i / "_METADATA").write_bytes(b""),
    "array _METADATA": lambda i: (i / "_METADATA").write_text("[1, 2]"),
    "non-UTF-8 _METADATA": lambda i: (i / "_METADATA").write_bytes(b"\xff\xfe\x00garbage"),
    "_METADATA of another layout": lambda i: (i / "_METADATA").write_text(json.dumps(OTHER_LAYOUT)),
}
NAMED = {"garbage manifest": "manifest.ocdbt", "flipped shard index": "wi_0"}


@pytest.mark.parametrize("damage", DAMAGE)
def test_export_of_a_damaged_checkpoint_is_one_line_naming_it(damaged_copy, tmp_path, damage):
    src, ckpt = damaged_copy
    items = ckpt / "0" / "items"
    DAMAGE[damage](items)
    result = run_cli("export", str(ckpt), str(tmp_path / "hf"), "--like", str(src), "--progress", "none")
    line = one_line(result)
    assert result.returncode == 1 and str(items) in line
    assert NAMED.get(damage, "_METADATA" if "_METADATA" in damage else "damaged") in line, line


@pytest.mark.parametrize("size", ["inf", "1e400", "nan", "1e400GiB"])
def test_shard_sizes_beyond_any_number_are_refused_in_one_line(converted, tmp_path, size):
    src, ckpt = converted
    result = run_cli("export", str(ckpt), str(tmp_path / "hf"), "--like", str(src), "--progress", "none",
                     "--shard-size", size)
    assert result.returncode == 2 and "--shard-size" in one_line(result) and not (tmp_path / "hf").exists()


def test_an_hf_dst_that_is_a_regular_file_is_refused_and_kept(converted, tmp_path):
    src, ckpt = converted
    target = tmp_path / "hf"
    target.write_text("notes\n")
    result = run_cli("export", str(ckpt), str(target), "--like", str(src), "--progress", "none")
    assert result.returncode == 2 and "not a directory" in one_line(result) and target.read_text() == "notes\n"


@pytest.mark.parametrize("text", ["[]", "3", '"complete"', "null"])
def test_reports_and_markers_that_are_json_but_not_objects_are_damaged_not_a_crash(synth_dir, converted, tmp_path,
                                                                                   text):
    src = synth_dir()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "ckptconv-report.json").write_text(text)  # convert: a damaged report of ours is redone
    assert _convert(src, dst).returncode == 0
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "ckptconv-report.json").write_text(text)  # export: not an export of ours, so refused
    refused = run_cli("export", str(dst), str(hf), "--like", str(src), "--progress", "none")
    assert refused.returncode == 2 and "not an export of ours" in one_line(refused)
    split = tmp_path / "split"
    assert _partition(src, split, "0/2").returncode == 0
    marker = split / "ckptconv-partitions" / "partition0of2.json"
    marker.write_text(text)  # a marker that vouches for nothing: not finished
    final = run_cli("convert", str(src), str(split), "--progress", "none", "--devices", "4", "--finalize", "2")
    assert final.returncode == 1 and "0/2" in one_line(final) and "not finished" in final.stderr


# --- beyond the anchors: every chunk carries a crc32c ----------------------------------------------

@pytest.mark.parametrize("flags", [[], ["--compression", "lz4"], ["--no-compression"]], ids=["zstd", "lz4", "raw"])
def test_bit_rot_in_a_stored_chunk_is_caught_without_the_source(synth_dir, tmp_path, flags):
    src, ckpt = synth_dir(), tmp_path / "ckpt"
    assert run_cli("convert", str(src), str(ckpt), "--progress", "none", "--devices", "4", *flags).returncode == 0
    items = ckpt / "0" / "items"
    _, _, length = value_location(items, f"{LEAF}/c/1/0/0")
    corrupt_value(items, f"{LEAF}/c/1/0/0", length // 3)  # inside the chunk's data, not its shard index
    deep = run_cli("inspect", str(ckpt), "--deep", "--json")
    assert deep.returncode == 1, deep.stdout
    assert any("wi_0/kernel: chunk" in p for p in json.loads(deep.stdout)["problems"])
    alone = run_cli("verify", str(ckpt), "--json", "--progress", "none")  # no SRC: the checksums alone
    assert alone.returncode == 1, alone.stdout + alone.stderr
    result = json.loads(alone.stdout)
    assert not result["ok"] and not result["compared_with_source"]
    assert any("wi_0/kernel: chunk" in p for p in result["mismatches"])
    exported = run_cli("export", str(ckpt), str(tmp_path / "hf"), "--like", str(src), "--progress", "none")
    assert exported.returncode == 1 and "wi_0/kernel is damaged" in one_line(exported)


def test_verify_without_a_source_accepts_a_whole_checkpoint(converted):
    _, ckpt = converted
    whole = run_cli("verify", str(ckpt), "--progress", "none")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "verify: OK" in whole.stdout and "no SRC given" in whole.stdout


def test_orbax_restores_checksummed_chunks_as_it_restores_orbax_own(converted, tmp_path, monkeypatch):
    """The crc32c codec is read from the stored zarr.json: Orbax restores the same numbers as from
    chunks written with Orbax's own codec chain (no checksum)."""
    from ckptconv.read.stored import open_database
    from ckptconv.write import orbax as writer
    from tests.test_convert import restore

    src, ckpt = converted
    zarr = json.loads(bytes(open_database(str(ckpt / "0" / "items")).read(f"{LEAF}/zarr.json").result().value))
    inner = zarr["codecs"][0]["configuration"]["codecs"]
    assert [codec["name"] for codec in inner] == ["bytes", "zstd", "crc32c"]
    # module-level, for the one synchronous convert() below: its producer and commit threads are joined before it
    # returns, and the CLI children other tests start import their own writer
    monkeypatch.setattr(writer, "_with_checksum", lambda spec: spec)
    plain = tmp_path / "plain"
    convert(ConvertRequest(str(src), str(plain), devices=16, progress="none"))
    want, got = restore(plain), restore(ckpt)
    assert got.keys() == want.keys() and len(got) > 10
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes(), name


# --- quantised values refused before anything is written -------------------------------------------

def _patch_tensor(src: Path, suffix: str, value: bytes, at: int = 0) -> str:
    """Overwrite element ``at`` of the first stored tensor whose name ends with ``suffix``."""
    from ckptconv.read.safetensors_io import index_checkpoint
    from ckptconv.read.sources import LocalSource

    info = next(info for name, info in sorted(index_checkpoint(LocalSource(str(src))).items()) if name.endswith(suffix))
    path = src / info.file
    raw = bytearray(path.read_bytes())
    start = info.offset + at * info.dtype.itemsize
    raw[start:start + len(value)] = value
    path.write_bytes(bytes(raw))
    return info.name


@pytest.mark.parametrize("model, suffix, value", [
    (synth.SynthModel(model_type="gpt_oss", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, num_experts=4, quantization="mxfp4", vocab_size=300),
     "down_proj_scales", b"\xff"),
    (synth.SynthModel(model_type="deepseek_v3", hidden_size=256, num_layers=2, num_heads=4, head_dim=16,
                      intermediate_size=320, moe_intermediate_size=192, num_experts=4, quantization="fp8",
                      vocab_size=300),
     "weight_scale_inv", np.float32("nan").tobytes()),
], ids=["mxfp4-255", "fp8-nan"])
def test_bad_quantised_scales_are_refused_before_anything_is_written(synth_dir, tmp_path, model, suffix, value):
    src = synth_dir(model)
    name = _patch_tensor(src, suffix, value, at=5)
    for dst in (tmp_path / "new", tmp_path / "old"):
        if dst.name == "old":  # a complete checkpoint that --overwrite would replace stays whole
            good = synth_dir(model, name="good")
            assert _convert(good, dst).returncode == 0
            before = tree_digest(dst)
        result = _convert(src, dst, "--overwrite")
        assert result.returncode == 2 and repr(name) in one_line(result)
        if dst.name == "new":
            assert not dst.exists() or not any(dst.iterdir())
        else:
            assert tree_digest(dst) == before


def test_a_report_of_another_version_is_held_only_to_the_fields_it_records():
    from ckptconv.errors import BadInputError
    from ckptconv.plan.export import check_recorded_model
    from ckptconv.read.spec import ModelSpec

    spec = ModelSpec(family="llama", model_type="llama", num_layers=2, dims={"emb": 64}, values={"new": 1},
                     runtime={"rope_scaling": {"rope_type": "llama3"}})
    older = {"family": "llama", "model_type": "llama", "num_layers": 2, "dims": {"emb": 64}, "values": {},
             "runtime": {"rope_scaling": {"rope_type": "llama3"}}}
    check_recorded_model(spec, older, "like", "report", same_tool=False)  # "values.new" is not recorded there
    with pytest.raises(BadInputError, match="values.new"):
        check_recorded_model(spec, older, "like", "report", same_tool=True)
    with pytest.raises(BadInputError, match="runtime.rope_scaling.rope_type"):
        check_recorded_model(spec, {**older, "runtime": {"rope_scaling": {"rope_type": "yarn"}}}, "like", "report",
                             same_tool=False)
