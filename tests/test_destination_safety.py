"""What ckptconv may delete at a destination (only what it can prove it wrote), and the arguments
it refuses before any work (issues 13 and 14): real files, real conversions, one-line errors."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.conftest import run_cli


def _convert(src, dst, *flags: str, cwd=None):
    extra = {"cwd": cwd} if cwd else {}
    return run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", *flags, **extra)


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_a_step_folder_ckptconv_did_not_write_is_never_removed(synth_dir, tmp_path, overwrite):
    dst = tmp_path / "dst"
    (dst / "0").mkdir(parents=True)
    (dst / "0" / "notes.txt").write_text("mine")
    result = _convert(synth_dir(), dst, *(["--overwrite"] if overwrite else []))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and f"{dst / '0'}: not written by ckptconv" in result.stderr
    assert (dst / "0" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["notes_3.orbax-checkpoint-tmp.txt", "7.orbax-checkpoint-tmp-123", "x_0.orbax-checkpoint-tmp"])
def test_names_orbax_would_delete_stop_the_run_first(synth_dir, tmp_path, name):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / name).write_text("mine")
    result = _convert(synth_dir(), dst)
    assert result.returncode == 2 and "Orbax would delete this" in result.stderr and name in result.stderr
    assert (dst / name).read_text() == "mine" and not (dst / "0").exists()


def test_other_files_at_the_destination_are_kept_through_convert_and_overwrite(synth_dir, tmp_path):
    src, dst = synth_dir(), tmp_path / "dst"
    dst.mkdir()
    (dst / "README.md").write_text("mine")
    assert _convert(src, dst).returncode == 0
    assert _convert(src, dst, "--dtype", "float32", "--overwrite").returncode == 0
    assert (dst / "README.md").read_text() == "mine"
    assert json.loads((dst / "ckptconv-report.json").read_text())["dtype"] == "float32"


def test_our_own_unfinished_run_is_cleaned_and_redone(synth_dir, tmp_path):
    """Leftovers vouched for by our "writing" report (a crashed run) are ours to remove."""
    src, dst = synth_dir(), tmp_path / "dst"
    (dst / "0.orbax-checkpoint-tmp-1700000000").mkdir(parents=True)
    (dst / "ckptconv-report.json").write_text(json.dumps({"status": "writing", "fingerprint": "x", "pid": 1,
                                                           "host": "elsewhere"}))
    assert _convert(src, dst).returncode == 0
    assert not (dst / "0.orbax-checkpoint-tmp-1700000000").exists()
    assert json.loads((dst / "ckptconv-report.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("dst, message", [
    ("", "the destination is empty"),
    (" ", "the destination is empty"),
    ("/", "the filesystem root cannot be a destination"),
])
def test_empty_or_root_destinations_are_refused_before_any_work(synth_dir, tmp_path, dst, message):
    (tmp_path / "keep.txt").write_text("mine")
    result = _convert(synth_dir(), dst, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "src"]


@pytest.mark.parametrize("where", ["inside", "same", "holds"])
def test_source_and_destination_must_not_overlap(synth_dir, tmp_path, where):
    src = synth_dir()
    dst = {"inside": src / "out", "same": src, "holds": tmp_path}[where]
    result = _convert(src, dst)
    assert result.returncode == 2 and "overlap" in result.stderr
    assert not (src / "out").exists() and not (src / "0").exists()


def test_device_counts_that_cannot_help_are_refused_at_once(synth_dir):
    src = synth_dir()
    started = time.monotonic()
    huge = run_cli("plan", str(src), "--devices", "100000")
    assert huge.returncode == 2 and "at most 16384" in huge.stderr
    useless = run_cli("convert", str(src), str(src.parent / "dst"), "--devices", "3", "--progress", "none")
    assert useless.returncode == 2 and "shards none of the" in useless.stderr
    assert "largest power of two that shards some leaf is 2" in useless.stderr
    assert time.monotonic() - started < 30 and not os.path.exists(src.parent / "dst")


CANARY = "hf_CANARY0123456789abcdef"


@pytest.mark.parametrize("content, kind", [
    (CANARY + "\nsecond line\n", "a line break"),
    (CANARY + "\x00tail", "a non-printable or non-ASCII character"),
    (CANARY + "é", "a non-printable or non-ASCII character"),
    (CANARY + " x", "a space"),
])
def test_malformed_tokens_are_refused_before_use_and_never_shown(tmp_path, content, kind):
    token_file = tmp_path / "token"
    token_file.write_text(content, encoding="utf-8")
    by_file = run_cli("plan", "hf://org/model", "--hf-token-file", str(token_file))
    results = [by_file]
    if "\x00" not in content:  # an environment cannot hold a NUL
        results.append(run_cli("plan", "hf://org/model", env={"HF_TOKEN": content.rstrip("\n") + "\r"}))
    for result in results:
        assert result.returncode == 2 and "one line of printable ASCII" in result.stderr
        assert "CANARY" not in result.stdout + result.stderr and result.stderr.count("\n") == 1
    assert kind in by_file.stderr


@pytest.fixture
def small_fs(tmp_path):
    """Factory: a tmpfs of the given size (KiB) mounted in tmp_path; unmounted after the test."""
    import subprocess

    mounts = []

    def make(kib: int):
        where = tmp_path / f"fs{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'not permitted'})")
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.fault
def test_out_of_space_before_writing_says_how_much_and_writes_nothing(synth_dir, small_fs):
    dst = small_fs(128) / "dst"
    result = _convert(synth_dir(), dst)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "needs up to 0.2 MiB" in result.stderr and "nothing was deleted or written" in result.stderr
    assert not (dst / "0").exists() and not list(dst.glob("*.orbax-checkpoint-tmp*"))


@pytest.mark.fault
def test_out_of_space_while_writing_is_one_line_and_a_rerun_with_space_completes(synth_dir, small_fs):
    import subprocess

    # the plan's estimate (0.2 MiB) fits, the data files and metadata (about 280 KiB on tmpfs since tiles are gathered
    # into 64 MiB data files; more before) do not
    fs = small_fs(240)
    src, dst = synth_dir(), fs / "dst"
    result = _convert(src, dst)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "no space left on device" in result.stderr and "a rerun resumes" in result.stderr
    assert not destination_complete(dst)
    assert subprocess.run(["mount", "-o", "remount,size=4m", str(fs)]).returncode == 0
    assert _convert(src, dst).returncode == 0 and destination_complete(dst)


# Big enough that the data, not the files' page overhead, sizes a checkpoint: the tiny default's
# usage on tmpfs varies by tens of KiB with the number of OCDBT data files Orbax happens to write.
# Planned 2.75 MiB (bf16, uncompressed); it takes about 2.35 MiB on tmpfs, so a 4 MiB tmpfs holds
# one checkpoint but not two, and not a float32 one (5.5 MiB planned).
ROOMY = dict(hidden_size=256, intermediate_size=512, vocab_size=1024, head_dim=64)
ONE_CHECKPOINT_KIB = 4096


def test_overwrite_that_cannot_fit_deletes_nothing(synth_dir, small_fs):
    from ckptconv.commands import synth

    src, dst = synth_dir(synth.SynthModel(**ROOMY)), small_fs(ONE_CHECKPOINT_KIB) / "dst"
    assert _convert(src, dst).returncode == 0
    bigger = _convert(src, dst, "--dtype", "float32", "--overwrite")  # twice the bytes: old + free < new
    assert bigger.returncode == 1 and "nothing was deleted or written" in bigger.stderr
    assert destination_complete(dst) and json.loads((dst / "ckptconv-report.json").read_text())["dtype"] == "bfloat16"


def test_overwrite_without_room_beside_says_so_before_deleting_and_completes(synth_dir, small_fs):
    from ckptconv.commands import synth

    src, dst = synth_dir(synth.SynthModel(**ROOMY)), small_fs(ONE_CHECKPOINT_KIB) / "dst"
    assert _convert(src, dst).returncode == 0
    again = _convert(src, dst, "--overwrite", "--devices", "2")
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("\n") == 1 and "no room for the new checkpoint beside the old one" in again.stderr
    assert json.loads((dst / "ckptconv-report.json").read_text())["devices"] == 2
    assert sorted(p.name for p in dst.iterdir()) == ["0", "ckptconv-report.json", "ckptconv-rss.svg"]


def test_export_overwrite_without_room_beside_says_so_before_deleting_and_completes(synth_dir, small_fs, tmp_path):
    from ckptconv.commands import synth

    src = synth_dir(synth.SynthModel(**ROOMY))
    assert _convert(src, tmp_path / "mt").returncode == 0
    hf = small_fs(ONE_CHECKPOINT_KIB) / "hf"  # 2.75 MiB of safetensors: room for one export, not two
    export = ("export", str(tmp_path / "mt"), str(hf), "--like", str(src), "--progress", "none")
    assert run_cli(*export).returncode == 0
    again = run_cli(*export, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("\n") == 1 and "no room for the new export beside the old one" in again.stderr
    assert json.loads((hf / "ckptconv-report.json").read_text())["status"] == "complete"
    assert not (hf / ".ckptconv-pending").exists()


@pytest.mark.fault
def test_overwrite_writes_beside_so_a_crash_keeps_the_old_checkpoint(synth_dir, tmp_path):
    """SIGKILL while --overwrite writes: the old checkpoint is still complete and verifies; the rerun
    swaps the new one in and leaves nothing of ours behind."""
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.held import held_at_event, hold_at
    from tests.test_signals import MODEL

    src, dst = synth_dir(MODEL, fast=True), tmp_path / "dst"
    assert _convert(src, dst).returncode == 0
    # held at its first written tile (tests.held): killed when a poll saw the new files, a quick run had
    # sometimes swapped them in already
    replacing = subprocess.Popen([sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", "4",
                                  "--progress", "jsonl", "--overwrite", "--dtype", "float32"], cwd=ROOT,
                                 env={**os.environ, **hold_at("progress")}, stderr=subprocess.PIPE, text=True)
    held_at_event(replacing, "progress")
    assert list((dst / "ckptconv-replacement").glob("*")), "the new checkpoint is written beside the old one"
    replacing.send_signal(signal.SIGKILL)
    replacing.wait()
    replacing.stderr.close()
    assert destination_complete(dst)
    assert json.loads((dst / "ckptconv-report.json").read_text())["dtype"] == "bfloat16"
    assert run_cli("verify", str(src), str(dst)).returncode == 0
    assert _convert(src, dst, "--overwrite", "--dtype", "float32").returncode == 0
    assert json.loads((dst / "ckptconv-report.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in dst.iterdir()) == ["0", "ckptconv-report.json", "ckptconv-rss.svg"]
    assert run_cli("verify", str(src), str(dst)).returncode == 0


def destination_complete(dst) -> bool:
    from ckptconv.write import destination

    return destination.inspect_state(str(dst)).complete


@pytest.mark.parametrize("where, message", [
    ("dst/0/items/_METADATA", "inside the destination"),
    ("dst/notes.json", "inside the destination"),
    ("missing-dir/report.json", "is not a writable directory"),
    (".", "is a directory"),
])
def test_report_paths_that_could_do_harm_or_fail_late_are_refused_first(synth_dir, tmp_path, where, message):
    src = synth_dir()
    result = _convert(src, tmp_path / "dst", "--report", str(tmp_path / where))
    assert result.returncode == 2 and message in result.stderr and not (tmp_path / "dst").exists()


def test_a_source_whose_bytes_changed_is_not_already_converted(synth_dir, tmp_path):
    """Same header, names and shapes, other tensor bytes: refused without --overwrite (and redone with
    it), also when the file's mtime was put back (the change lies in a sampled piece)."""
    src, dst = synth_dir(), tmp_path / "dst"
    assert _convert(src, dst).returncode == 0
    shard = src / "model.safetensors"
    header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    for keep_mtime in (False, True):
        before = os.stat(shard)
        with open(shard, "r+b") as f:
            f.seek(header)
            first = f.read(2)
            f.seek(header)
            f.write(bytes([first[0] ^ 0xFF, first[1]]))
        if keep_mtime:
            os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
        again = _convert(src, dst)
        assert again.returncode == 2 and "different source or with different options" in again.stderr
        assert _convert(src, dst, "--overwrite").returncode == 0
    assert json.loads(run_cli("verify", str(src), str(dst), "--json").stdout)["ok"]
