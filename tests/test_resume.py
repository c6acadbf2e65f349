"""Crash and rerun: a converting process SIGKILLed part-way never leaves DST reading as complete,
and rerunning the same command cleans the leftovers, converts again and verifies bit for bit.

How a rerun recovers (by design, see convert.py): Orbax commits a step as a whole (a tmp dir
renamed into place locally, ``commit_success.txt`` on GCS) and OCDBT files are content-named,
so a half-written step cannot be continued; the rerun deletes it and starts over. Only our
report, written last, makes a checkpoint "complete".
"""

from __future__ import annotations

import json
import shutil
import os
import signal
import subprocess
import sys

import pytest

from ckptconv import layout
from ckptconv.commands import synth
from ckptconv.write import destination
from tests.conftest import ROOT, run_cli
from tests.held import hold_at, wait_held

# ~130 MB of bf16 in three shards: 178 tensors, so each share of the bytes is reached at a tile of its own.
MEDIUM = synth.SynthModel(vocab_size=32000, hidden_size=512, num_layers=16, num_heads=8, num_kv_heads=4,
                          head_dim=64, intermediate_size=1536)


def convert_and_kill(src: str, dst: str, fraction: float, devices: int = 4) -> tuple[int, list[dict]]:
    """Run ``convert`` and SIGKILL it where its progress reaches ``fraction`` of the bytes.

    The run holds itself at that event (``tests.held``), so the kill lands there however fast the run:
    killed only after reading the line, a quick run had gone on to commit (``fraction`` 1.0) or past
    the share it was to die at. Returns the exit status (-9: the kill landed) and the events seen.
    """
    env = {**os.environ, **hold_at("progress", fraction)}
    env.pop("XLA_FLAGS", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "ckptconv", "convert", src, dst, "--devices", str(devices), "--progress", "jsonl"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    events = []
    try:
        for line in process.stderr:
            if not line.startswith("CKPTCONV "):
                continue
            event = json.loads(line.removeprefix("CKPTCONV "))
            events.append(event)
            if event["event"] == "progress" and event["bytes"] >= fraction * event["total_bytes"] > 0:
                wait_held(process.pid)
                os.kill(process.pid, signal.SIGKILL)
                break
        return process.wait(timeout=120), events
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def assert_killed_at(event: dict, fraction: float) -> None:
    """The kill landed where the case says: at ``fraction`` of the bytes, and before the last byte unless
    ``fraction`` is 1 (then every byte written, nothing committed)."""
    assert event["event"] == "progress" and event["bytes"] >= fraction * event["total_bytes"], event
    assert (event["bytes"] == event["total_bytes"]) == (fraction == 1.0), event


def assert_incomplete(dst: str) -> None:
    inspected = run_cli("inspect", dst)
    assert inspected.returncode == 1 and f"{dst}: INCOMPLETE" in inspected.stdout, inspected.stdout + inspected.stderr


def assert_rerun_recovers(src: str, dst: str) -> None:
    rerun = run_cli("convert", src, dst, "--devices", "4", "--progress", "none")
    assert rerun.returncode == 0 and "nothing to do" not in rerun.stdout, rerun.stdout + rerun.stderr
    inspected = run_cli("inspect", dst)
    assert inspected.returncode == 0 and f"{dst}: complete" in inspected.stdout and "leftovers" not in inspected.stdout
    verified = run_cli("verify", src, dst)
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr


@pytest.fixture(scope="module")
def medium_src(tmp_path_factory):
    directory = tmp_path_factory.mktemp("medium") / "src"
    synth.write_checkpoint(MEDIUM, str(directory), max_shard_bytes=50_000_000)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.1, 0.6, 1.0], ids=["early", "middle", "all-bytes-before-commit"])
@pytest.mark.fault
def test_local_kill_then_rerun(tmp_path, medium_src, fraction):
    dst = str(tmp_path / "dst")
    status, events = convert_and_kill(str(medium_src), dst, fraction)
    assert status == -signal.SIGKILL, f"the conversion finished before the kill: {events[-3:]}"
    assert not any(event["event"] == "done" for event in events)
    assert_killed_at(events[-1], fraction)
    state = destination.inspect_state(dst)
    assert not state.complete and state.leftovers and state.report["status"] == "writing"  # our pending report
    assert_incomplete(dst)
    assert_rerun_recovers(str(medium_src), dst)


@pytest.fixture(scope="module")
def gcs_medium_src(gcs_server, medium_src) -> str:
    """``medium_src`` uploaded once for the GCS cases, which only read it (130 MB through the emulator, which keeps
    every object in memory for the session)."""
    return gcs_server.upload_dir(medium_src, f"gs://{gcs_server.new_bucket('src')}/medium")


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.3, 1.0], ids=["middle", "all-bytes-before-commit"])
@pytest.mark.fault
def test_gcs_kill_then_rerun(gcs, gcs_medium_src, fraction):
    src = gcs_medium_src
    dst = f"gs://{gcs.new_bucket('zoo')}/medium"
    status, events = convert_and_kill(src, dst, fraction)
    assert status == -signal.SIGKILL, f"the conversion finished before the kill: {events[-3:]}"
    assert_killed_at(events[-1], fraction)
    objects = gcs.objects(dst)
    assert objects and "0/commit_success.txt" not in objects
    assert destination.inspect_state(dst).report["status"] == "writing"  # only our pending report
    assert_incomplete(dst)
    unfinished = run_cli("verify", src, dst)
    assert unfinished.returncode != 0 and "verify: OK" not in unfinished.stdout
    assert_rerun_recovers(src, dst)


@pytest.mark.slow
def test_checkpoint_without_report_is_incomplete_and_never_deleted(tmp_path, synth_dir):
    """A step without our report (our pending report is written before any data, so this is not
    a crash of ours: another tool's checkpoint, or a report someone removed): never complete, and
    not ours to delete, with or without ``--overwrite`` (issue 13); once moved away, DST converts."""
    src, dst = synth_dir(), tmp_path / "dst"
    assert run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none").returncode == 0
    (dst / layout.REPORT_NAME).unlink()
    assert_incomplete(str(dst))
    files = sorted(p.relative_to(dst) for p in dst.rglob("*"))
    for flags in ((), ("--overwrite",)):
        refused = run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none", *flags)
        assert refused.returncode == 2 and f"{dst / '0'}: not written by ckptconv" in refused.stderr
        assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == files
    shutil.rmtree(dst / "0")
    redone = run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none")
    assert redone.returncode == 0, redone.stderr
    assert destination.inspect_state(str(dst)).complete


@pytest.mark.slow
@pytest.mark.fault
def test_crash_after_commit_before_final_report_reruns_without_overwrite(tmp_path, synth_dir):
    """Our pending report ("writing", written before any data) marks the output as ours and
    unfinished, even when Orbax's commit already happened: the same command simply redoes it."""
    src, dst = synth_dir(), tmp_path / "dst"
    assert run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none").returncode == 0
    report_path = dst / layout.REPORT_NAME
    final = json.loads(report_path.read_text())
    report_path.write_text(json.dumps({"status": "writing", "fingerprint": final["fingerprint"]}))
    assert_incomplete(str(dst))
    redone = run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none")
    assert redone.returncode == 0, redone.stderr
    assert "nothing to do" not in redone.stdout
    assert destination.inspect_state(str(dst)).complete
    assert run_cli("verify", str(src), str(dst)).returncode == 0


@pytest.mark.fault
def test_a_live_run_is_never_cleared_and_a_dead_one_is_redone(tmp_path, synth_dir):
    """A "writing" report names its process: alive on this host means hands off; gone means redo."""
    import socket

    src, dst = synth_dir(), tmp_path / "dst"
    dst.mkdir()
    report = dst / layout.REPORT_NAME
    report.write_text(json.dumps({"status": "writing", "pid": os.getpid(), "host": socket.gethostname()}))
    busy = run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none", "--overwrite")
    assert busy.returncode == 1 and f"another conversion (pid {os.getpid()}" in busy.stderr, busy.stderr
    assert json.loads(report.read_text())["pid"] == os.getpid(), "the live run's output must be left alone"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    report.write_text(json.dumps({"status": "writing", "pid": int(dead.stdout), "host": socket.gethostname()}))
    redone = run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none")
    assert redone.returncode == 0, redone.stderr
    assert destination.inspect_state(str(dst)).complete


def test_report_without_checkpoint_is_a_leftover(tmp_path, synth_dir):
    src, dst = synth_dir(), tmp_path / "dst"
    assert run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none").returncode == 0
    (dst / "0").rename(tmp_path / "moved-away")
    rerun = run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none")
    assert rerun.returncode == 0 and "nothing to do" not in rerun.stdout, rerun.stderr
    assert destination.inspect_state(str(dst)).complete


def test_crash_while_clearing_never_reads_complete(tmp_path, synth_dir, monkeypatch):
    """``--overwrite`` removes the report before anything else, so dying mid-removal is never 'complete'."""
    from etils import epath

    src, dst = synth_dir(), tmp_path / "dst"
    assert run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none").returncode == 0
    assert destination.inspect_state(str(dst)).complete

    def crash(self, *args, **kwargs):
        raise KeyboardInterrupt("simulated crash while removing the step")

    # class-level, for the one synchronous clear() below (no thread of it outlives the call; undone at the end)
    monkeypatch.setattr(type(epath.Path(str(dst))), "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        destination.clear(str(dst))
    state = destination.inspect_state(str(dst))
    assert state.checkpoint and not state.complete
