"""Stopping a conversion: SIGTERM ends it with one line and a state a rerun finishes; a conversion
started by a Prefect task ends itself when that task's process dies (no orphan keeps writing).

Each conversion here holds itself (``tests.held``) at the point it is to be interrupted, so the
signal lands there however fast the run is: a line read and then a signal sent is a race a quick
run wins (it is past the point, or done, before the signal lands)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ckptconv.commands import synth
from ckptconv.write import destination
from tests.conftest import ROOT
from tests.held import held_at_event, hold_at, wait_held

MODEL = synth.SynthModel(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                         intermediate_size=2048)


def _start(src, dst, **env):
    return subprocess.Popen([sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", "4",
                             "--progress", "jsonl"], cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("signum, status, line", [(signal.SIGTERM, 143, "ckptconv: terminated (SIGTERM)"),
                                                   (signal.SIGINT, 130, "ckptconv: interrupted")])
@pytest.mark.fault
def test_a_stop_signal_ends_the_conversion_cleanly_and_a_rerun_completes(synth_dir, tmp_path, signum, status, line):
    src, dst = synth_dir(MODEL, fast=True), tmp_path / "dst"
    proc = _start(src, dst, **hold_at("progress"))
    held_at_event(proc, "progress")  # mid-conversion: its first tile written, every other tile and the commit ahead
    proc.send_signal(signum)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == status, err
    assert err.strip().splitlines()[-1].startswith(line) and "rerun" in err
    assert "Traceback" not in err
    assert not destination.inspect_state(str(dst)).complete
    rerun = _start(src, dst)
    rerun.communicate(timeout=300)
    assert rerun.returncode == 0
    assert json.loads((dst / "ckptconv-report.json").read_text())["status"] == "complete"


@pytest.mark.fault
def test_a_conversion_whose_task_process_dies_stops_too(synth_dir, tmp_path):
    """The parent here is tasks.child.stream_child in its own process, SIGKILLed mid-conversion (the child
    held at its first written tile meanwhile, then let go: what ends it is its parent's death). The test
    keeps the reading end of the child's output open, as a worker's other processes may: a child that
    only died of its next write to a pipe nobody reads would pass without ever hearing its parent die."""
    src, dst, pidfile = synth_dir(MODEL, fast=True), tmp_path / "dst", tmp_path / "child.pid"
    script = ("import sys; from tasks.child import stream_child, child_env; "
              "stream_child(['convert', sys.argv[1], sys.argv[2], '--devices', '4', '--progress', 'jsonl'], "
              "child_env(4), lambda line, pid: open(sys.argv[3], 'w').write(str(pid)))")
    parent = subprocess.Popen([sys.executable, "-c", script, str(src), str(dst), str(pidfile)], cwd=ROOT,
                              env={**os.environ, **hold_at("progress")})  # child_env passes it on
    deadline = time.monotonic() + 300  # the child's first line: JAX's import alone takes a while on a busy machine
    while not (pidfile.exists() and pidfile.read_text()):
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    child = int(pidfile.read_text())
    wait_held(child)
    output = _reading_end(parent.pid, child)
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        os.kill(child, signal.SIGCONT)  # its SIGTERM (PR_SET_PDEATHSIG) waited while it was stopped
        deadline = time.monotonic() + 120  # SIGTERM from PR_SET_PDEATHSIG at once; 120 s only bounds a busy machine
        while _alive(child):
            assert time.monotonic() < deadline, "the conversion outlived the task process that started it"
            time.sleep(0.1)
    finally:
        os.close(output)
    assert not destination.inspect_state(str(dst)).complete


def _reading_end(parent: int, child: int) -> int:
    """A descriptor of the pipe ``parent`` reads ``child``'s output from, opened through /proc."""
    pipe = os.readlink(f"/proc/{child}/fd/1")
    fd = next(fd for fd in os.listdir(f"/proc/{parent}/fd") if os.readlink(f"/proc/{parent}/fd/{fd}") == pipe)
    return os.open(f"/proc/{parent}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.fault
def test_two_conversions_into_one_destination_one_refused_the_other_verifies(synth_dir, tmp_path):
    from tests.conftest import run_cli

    src, dst = synth_dir(MODEL, fast=True), tmp_path / "dst"
    first = _start(src, dst, **hold_at("plan"))
    held_at_event(first, "plan")  # it holds the lock until the second has tried, however slow the second's start
    try:
        second = run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none")
    finally:
        first.send_signal(signal.SIGCONT)
    first.communicate(timeout=300)
    assert first.returncode == 0
    assert second.returncode == 1 and "another conversion (pid" in second.stderr and "ckptconv.lock" in second.stderr
    assert json.loads(run_cli("verify", str(src), str(dst), "--json").stdout)["ok"]
    assert not (dst / "ckptconv.lock").exists()


def test_stale_and_foreign_locks(synth_dir, tmp_path):
    from ckptconv.write import lock
    from tests.conftest import run_cli

    src, dst = synth_dir(), tmp_path / "dst"
    dst.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = lock._me()
    (dst / "ckptconv.lock").write_text(json.dumps({**me, "pid": dead.pid, "start_ticks": 1}))  # this host, gone
    assert run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none").returncode == 0
    (dst / "ckptconv.lock").write_text(json.dumps({**me, "host": "another-host"}))  # cannot be checked from here
    refused = run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none", "--dtype", "float32")
    assert refused.returncode == 1 and "pid" in refused.stderr and "another-host" in refused.stderr
    broken = run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none", "--dtype", "float32",
                     "--overwrite")
    assert broken.returncode == 0, broken.stderr
    assert not (dst / "ckptconv.lock").exists()
    (dst / "ckptconv.lock").write_text(json.dumps(me))  # this test process: alive on this host
    kept = run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none", "--overwrite")
    assert kept.returncode == 1 and f"pid {me['pid']}" in kept.stderr  # --overwrite never breaks a live holder
    assert json.loads((dst / "ckptconv-report.json").read_text())["dtype"] == "float32"
