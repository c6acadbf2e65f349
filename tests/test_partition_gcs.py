"""One model over N workers on gs://: ``convert --partition I/N`` writes each share into the bucket,
``--finalize N`` proves every share is there (sizes and the crc32c the bucket computed), has the
bucket copy the shares into the step (no byte through the finalizing host) and commits once. Against
the real fake-gcs-server; the result must be leaf for leaf what a single conversion writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptconv.commands import synth
from tests.conftest import run_cli
from tests.held import hold_at, wait_held
from tests.test_convert import restore

ROOT = Path(__file__).resolve().parent.parent
# ~40 MB of bf16 over 8 layers (the killed partition needs no long run: it holds itself at its plan, tests.held).
MODEL = synth.SynthModel(vocab_size=16000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                         head_dim=64, intermediate_size=1536)
FLAGS = ("--devices", "4", "--progress", "none")


def _partition(src, dst: str, spec: str):
    return run_cli("convert", str(src), dst, *FLAGS, "--partition", spec)


def _finalize(src, dst: str, count: int):
    return run_cli("convert", str(src), dst, *FLAGS, "--finalize", str(count))


def _partition_killed_as_it_writes(src, dst: str, spec: str) -> int:
    """Run a partition and SIGKILL it when it says it starts writing (its "plan" event: its earlier
    attempt is already reset, its writer about to start), not after some time: its exit status.
    It holds itself there (tests.held): killed only after the line was read, a quick one could finish."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **hold_at("plan")}
    process = subprocess.Popen([sys.executable, "-m", "ckptconv", "convert", str(src), dst, "--devices", "4",
                                "--progress", "jsonl", "--partition", spec],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        for line in process.stderr:
            event = json.loads(line.removeprefix("CKPTCONV ")) if line.startswith("CKPTCONV ") else {}
            if event.get("event") == "plan":
                wait_held(process.pid)
                os.kill(process.pid, signal.SIGKILL)
                break
        return process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def _download(gcs, uri: str, local: Path) -> Path:
    bucket, _, prefix = uri[len("gs://"):].partition("/")
    for blob in gcs.client().list_blobs(bucket, prefix=f"{prefix}/"):
        target = local / blob.name[len(prefix) + 1:]
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(target))
    return local


@pytest.mark.slow
def test_partitions_on_gcs_with_one_killed_and_rerun_equal_a_single_conversion(gcs, synth_dir, tmp_path):
    src = synth_dir(MODEL)
    single = run_cli("convert", str(src), str(tmp_path / "single"), *FLAGS)
    assert single.returncode == 0, single.stderr
    dst = f"gs://{gcs.new_bucket('zoo')}/models/split"

    assert _partition(src, dst, "0/2").returncode == 0
    assert _partition_killed_as_it_writes(src, dst, "1/2") == -signal.SIGKILL
    staged = gcs.objects(f"{dst}/ckptconv-partitions")
    assert "partition0of2.json" in staged and "partition1of2.json" not in staged  # no marker: not finished
    early = _finalize(src, dst, 2)
    assert early.returncode == 1 and "partition(s) 1/2 not finished" in early.stderr, early.stderr
    inspected = run_cli("inspect", dst)
    assert inspected.returncode == 2 and "no checkpoint there" in inspected.stderr  # nothing reads as complete

    rerun = _partition(src, dst, "1/2")
    assert rerun.returncode == 0 and "nothing to do" not in rerun.stdout, rerun.stdout + rerun.stderr
    assert "already written; nothing to do" in _partition(src, dst, "0/2").stdout  # a finished one skips
    final = _finalize(src, dst, 2)
    assert final.returncode == 0, final.stderr
    report = json.loads(gcs.read(f"{dst}/ckptconv-report.json"))
    assert report["status"] == "complete" and [p["partition"] for p in report["partitions"]] == ["0/2", "1/2"]
    objects = gcs.objects(dst)
    assert not any(name.startswith("ckptconv-partitions/") for name in objects)  # staging gone after the commit
    assert {"0/commit_success.txt", "0/items/_METADATA"} <= set(objects)
    assert any(name.startswith("0/items/ocdbt.process_partition1/") for name in objects)

    verified = run_cli("verify", str(src), dst, "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stdout + verified.stderr
    expected, got = restore(tmp_path / "single"), restore(_download(gcs, dst, tmp_path / "downloaded"))
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes(), name


@pytest.mark.slow
def test_finalize_on_gcs_refuses_a_staged_object_that_changed_and_a_rerun_repairs(gcs, synth_dir):
    src = synth_dir(synth.SynthModel(num_layers=3))
    dst = f"gs://{gcs.new_bucket('zoo')}/models/damaged"
    for index in range(2):
        assert _partition(src, dst, f"{index}/2").returncode == 0
    bucket, _, prefix = dst[len("gs://"):].partition("/")
    staged = f"{prefix}/ckptconv-partitions/ocdbt.process_partition1/d/"
    data = max(gcs.client().list_blobs(bucket, prefix=staged), key=lambda b: b.size)
    raw = bytearray(data.download_as_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size, other bytes: only the checksum can tell
    data.upload_from_string(bytes(raw))
    early = _finalize(src, dst, 2)
    assert early.returncode == 1 and "partition 1/2" in early.stderr and data.name.rsplit("/", 1)[1] in early.stderr
    assert "changed since it was written" in early.stderr
    assert "ckptconv-report.json" not in gcs.objects(dst)
    redo = _partition(src, dst, "1/2")  # its marker no longer vouches for the data: redone, not skipped
    assert redo.returncode == 0 and "nothing to do" not in redo.stdout
    assert _finalize(src, dst, 2).returncode == 0
    assert json.loads(run_cli("verify", str(src), dst, "--json").stdout)["ok"]
