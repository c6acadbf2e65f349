"""The destination protocol's steps, in the order every writer takes them (convert, its partitions and
export go through them end to end in their own tests): nothing reads as complete before the last step,
a crash at any step leaves a destination that reads as ours and unfinished, and nothing that is not
ours is ever removed."""

from __future__ import annotations

import json

import pytest

from ckptconv.layout import REPORT_NAME
from ckptconv.settings import Status
from ckptconv.write import destination
from ckptconv.write.destination import STAGING, Destination


def _report(root) -> dict:
    return json.loads((root / REPORT_NAME).read_text())


def test_begin_then_commit_the_report_is_the_last_step(tmp_path):
    dst = Destination(str(tmp_path))
    writing = destination.writing_report("print-1", "2026-12-05T00:00:00+00:00", kind="test")
    dst.begin(writing)
    assert _report(tmp_path)["status"] == Status.WRITING and _report(tmp_path)["fingerprint"] == "print-1"
    (tmp_path / "data.bin").write_bytes(b"x")
    extra = tmp_path.parent / f"{tmp_path.name}-extra.json"
    dst.commit({**writing, "status": Status.COMPLETE}, str(extra))
    assert _report(tmp_path)["status"] == Status.COMPLETE
    assert json.loads(extra.read_text())["status"] == Status.COMPLETE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckptconv-report.json", "data.bin"]  # no temporary left
    skipped = dst.skip(_report(tmp_path), None)
    assert skipped["skipped"] is True and "skipped" not in _report(tmp_path)


def test_swap_in_keeps_the_old_result_complete_until_it_retires(tmp_path):
    dst = Destination(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"old")
    dst.commit({"status": Status.COMPLETE, "fingerprint": "old"}, None)
    staged = tmp_path / STAGING["export"]
    staged.mkdir()
    writing = destination.writing_report("new", "now")
    dst.begin(writing, at=str(staged))  # the old result keeps its own report meanwhile
    (staged / "model.safetensors").write_bytes(b"new")
    (staged / "model-2.safetensors.partial").write_bytes(b"unfinished")
    assert _report(tmp_path)["fingerprint"] == "old" and _report(tmp_path)["status"] == Status.COMPLETE

    seen = []

    def retire_old():
        seen.append(_report(tmp_path))  # what a crash here would leave
        (tmp_path / "model.safetensors").unlink()

    dst.swap_in(str(staged), writing, retire_old)
    assert seen[0]["status"] == Status.WRITING and seen[0]["fingerprint"] not in ("old", "new")
    assert (tmp_path / "model.safetensors").read_bytes() == b"new"
    assert not staged.exists() and not (tmp_path / "model-2.safetensors.partial").exists()
    assert _report(tmp_path)["status"] == Status.WRITING and _report(tmp_path)["fingerprint"] == "new"


def test_a_failure_while_the_old_result_retires_leaves_it_unfinished_for_no_run_to_resume(tmp_path):
    dst = Destination(str(tmp_path))
    dst.commit({"status": Status.COMPLETE, "fingerprint": "old"}, None)
    staged = tmp_path / STAGING["replacement"]
    staged.mkdir()

    def crash():
        raise OSError("disk gone")

    with pytest.raises(OSError):
        dst.swap_in(str(staged), destination.writing_report("new", "now"), crash)
    left = _report(tmp_path)
    assert left["status"] == Status.WRITING and left["fingerprint"].startswith("retiring-")


def test_clear_removes_the_report_first_and_only_what_is_ours(tmp_path):
    dst = Destination(str(tmp_path))
    dst.commit({"status": Status.COMPLETE, "fingerprint": "x"}, None)
    (tmp_path / "ours.safetensors").write_bytes(b"1")
    (tmp_path / STAGING["export"]).mkdir()
    (tmp_path / STAGING["export"] / "a").write_bytes(b"2")
    (tmp_path / "notes.txt").write_text("the user's")
    dst.clear(lambda name: name.endswith(".safetensors") or name == STAGING["export"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert dst.report() is None


def test_every_staging_directory_is_one_of_ours(tmp_path):
    """One table: the names are distinct, none is a name a result itself uses, and each lives inside DST."""
    assert len(set(STAGING.values())) == len(STAGING)
    assert not set(STAGING.values()) & {"0", REPORT_NAME, "config.json"}
    dst = Destination(str(tmp_path))
    for what, name in STAGING.items():
        assert dst.staging(what) == f"{tmp_path}/{name}"
