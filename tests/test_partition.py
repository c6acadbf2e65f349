"""One model over N workers: ``convert --partition I/N`` on each, then ``convert --finalize N``.

The partitions write their leaves as hosts of a multi-host Orbax save write theirs
(``ocdbt.process_<id>``); the finalize links them into the step, Orbax merges and commits once.
The result must restore leaf for leaf as a single conversion does, verify, and nothing may read
as complete before the finalize.
"""

from __future__ import annotations

import json

import pytest

from ckptconv.commands import synth
from ckptconv.write import destination
from tests.conftest import run_cli
from tests.test_convert import restore

MOE = synth.SynthModel(model_type="qwen3_moe", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=96, num_experts=4, moe_intermediate_size=32, vocab_size=200)


def _partition(src, dst, spec: str, *flags: str):
    return run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--partition", spec, *flags)


def _finalize(src, dst, count: int, *flags: str):
    return run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--finalize", str(count),
                   *flags)


def test_partitions_then_finalize_equal_a_single_conversion(synth_dir, tmp_path):
    """Scanned: stacked leaves (layers and experts) are what a partition must write whole."""
    src = synth_dir(MOE)
    layout = "--scan-layers"
    single = run_cli("convert", str(src), str(tmp_path / "single"), "--progress", "none", "--devices", "4", layout)
    assert single.returncode == 0, single.stderr
    dst = tmp_path / "split"
    for index in range(3):
        done = _partition(src, dst, f"{index}/3", layout)
        assert done.returncode == 0, done.stderr
        assert not destination.inspect_state(str(dst)).complete  # nothing reads as complete before the finalize
    reports = [json.loads((dst / "ckptconv-partitions" / f"partition{i}of3.json").read_text()) for i in range(3)]
    assert sum(r["leaves"] for r in reports) == json.loads(run_cli("plan", str(src), "--devices", "4", layout,
                                                                   "--json").stdout)["leaves"]
    assert all(r["leaves"] > 0 for r in reports)  # the jobs really are spread

    final = _finalize(src, dst, 3, layout)
    assert final.returncode == 0, final.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert report["status"] == "complete" and [p["partition"] for p in report["partitions"]] == ["0/3", "1/3", "2/3"]
    assert not (dst / "ckptconv-partitions").exists()
    assert sorted(p.name for p in (dst / "0" / "items").glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_partition0", "ocdbt.process_partition1", "ocdbt.process_partition2"]
    expected, got = restore(tmp_path / "single"), restore(dst)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes(), name
    verified = run_cli("verify", str(src), str(dst), "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"]
    inspected = run_cli("inspect", str(dst), "--json")
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["complete"]


@pytest.mark.fault
def test_a_crashed_partition_is_rerun_alone_and_finalize_waits_for_it(synth_dir, tmp_path):
    src, dst = synth_dir(), tmp_path / "dst"
    for index in range(2):
        assert _partition(src, dst, f"{index}/2").returncode == 0
    marker = dst / "ckptconv-partitions" / "partition1of2.json"
    marker.unlink()  # partition 1 died before its marker: its data does not count
    early = _finalize(src, dst, 2)
    assert early.returncode == 1 and "partition(s) 1/2 not finished" in early.stderr
    assert not (dst / "0").exists() and not destination.inspect_state(str(dst)).complete
    again = _partition(src, dst, "0/2")  # finished: skipped, its data untouched
    assert again.returncode == 0 and "already written; nothing to do" in again.stdout
    assert _partition(src, dst, "1/2").returncode == 0 and marker.exists()
    assert _finalize(src, dst, 2).returncode == 0
    assert json.loads(run_cli("verify", str(src), str(dst), "--json").stdout)["ok"]
    rerun = _finalize(src, dst, 2)  # complete: nothing to do
    assert rerun.returncode == 0 and "already converted" in rerun.stdout


def test_partitions_of_another_layout_or_source_do_not_count(synth_dir, tmp_path):
    src, dst = synth_dir(), tmp_path / "dst"
    assert _partition(src, dst, "0/2").returncode == 0
    assert _partition(src, dst, "1/2", "--dtype", "float32").returncode == 0
    stale = _finalize(src, dst, 2)
    assert stale.returncode == 1 and "1/2 (written for another source or layout)" in stale.stderr
    assert not (dst / "0").exists()


@pytest.mark.parametrize("flags, message", [
    (["--partition", "2/2"], "expected I/N with 0 <= I < N"),
    (["--partition", "x"], "expected I/N"),
    (["--finalize", "0"], "must be >= 1"),
])
def test_bad_partition_arguments_are_refused(synth_dir, tmp_path, flags, message):
    result = run_cli("convert", str(synth_dir()), str(tmp_path / "dst"), "--progress", "none", *flags)
    assert result.returncode == 2 and message in result.stderr and not (tmp_path / "dst").exists()
