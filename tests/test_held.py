"""The hook the fault tests hold a run with (``CKPTCONV_TEST_HOLD_AT``, :class:`ckptconv.progress.Hold`): unset it
holds nothing; set, the run stops where asked, and once let go it finishes as if never held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from ckptconv.progress import HOLD_ENV, Hold
from ckptconv.write import destination
from tests.conftest import ROOT, run_cli
from tests.held import hold_at, wait_held


def test_the_hold_is_one_event_of_one_kind_at_or_past_its_share():
    assert not Hold.from_env({}).due("plan", 0.0) and not Hold.from_env({}).due("progress", 1.0)
    hold = Hold.from_env({HOLD_ENV: "progress:0.5"})
    assert not hold.due("plan", 1.0) and not hold.due("progress", 0.49) and hold.due("progress", 0.5)
    hold.held = True  # what stop() records before it stops the process
    assert not hold.due("progress", 1.0)
    assert Hold.from_env({HOLD_ENV: "plan"}).due("plan", 0.0)


def test_a_run_held_half_way_stops_there_and_completes_when_let_go(synth_dir, tmp_path):
    src, dst = synth_dir(), tmp_path / "dst"
    proc = subprocess.Popen([sys.executable, "-m", "ckptconv", "convert", str(src), str(dst), "--devices", "4",
                             "--progress", "jsonl"], cwd=ROOT, env={**os.environ, **hold_at("progress", 0.5)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            event = json.loads(line.removeprefix("CKPTCONV ")) if line.startswith("CKPTCONV ") else {}
            if event.get("event") == "progress" and event["bytes"] >= event["total_bytes"] / 2:
                break
        wait_held(proc.pid)
        assert event["bytes"] < event["total_bytes"], event  # the first event past half the bytes, not the last
        assert not destination.inspect_state(str(dst)).complete
        os.kill(proc.pid, signal.SIGCONT)
        _, rest = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and '"event": "done"' in rest, rest
    assert json.loads(run_cli("verify", str(src), str(dst), "--json").stdout)["ok"]
