"""The GCS emulator stopped and restarted in the middle of a conversion (issue 12): a read from a
gs:// source and a write to a gs:// destination each lose their endpoint for a few seconds. The
run either rides it out (retried) or fails in one line, and then a rerun completes; either way
the result verifies, and nothing reads as complete before it is.

The emulator here keeps its objects on disk (``-backend filesystem``), so a restart on the same
port serves the same bucket, as the real service does after an outage. The conversion holds
itself (SIGSTOP, ``tests.held``) while the emulator goes down, at an event it prints before the work
the outage is to interrupt, so the outage lands mid-run however fast the run is: a source loses its
endpoint at the ``plan`` event (headers read, no tensor's data yet), a destination at the first
``progress`` event (its first tile written, the rest and the commit still ahead).
"""

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
from tests.conftest import ROOT, run_cli
from tests.gcs_server import STATIC_ENV, _binary, _free_port, _wait_ready
from tests.held import held_at_event, hold_at

MODEL = synth.SynthModel(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                         intermediate_size=2048)
OUTAGE_SECONDS = 3.0


class RestartableEmulator:
    """fake-gcs-server on one port with its objects under ``root``; ``stop()`` and ``start()`` it."""

    def __init__(self, root) -> None:
        self.root, self.port = root, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**STATIC_ENV, "STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                    "CKPTCONV_REMOTE_TIMEOUT": "5", "CKPTCONV_REMOTE_DEADLINE": "60"}
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.root / "emulator.log", "ab")
        self.process = subprocess.Popen(
            [str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend",
             "filesystem", "-filesystem-root", str(self.root / "data"), "-log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        assert _wait_ready(self.url, self.process), (self.root / "emulator.log").read_text()[-2000:]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="test", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.url})


@pytest.fixture
def emulator(tmp_path):
    server = RestartableEmulator(tmp_path)
    server.start()
    yield server
    if server.process.poll() is None:
        server.stop()


def _convert_through_an_outage(src: str, dst: str, emulator: RestartableEmulator,
                               at_event: str) -> subprocess.CompletedProcess:
    """Start a conversion; at its first ``at_event`` event, take the emulator down for OUTAGE_SECONDS.

    Not a time: the first progress event of a small run can come when every read is done (its
    first line waits half a second; a run on a quiet host took 1.1 s), and an outage after the
    last read is no outage for the source.
    """
    proc = subprocess.Popen([sys.executable, "-m", "ckptconv", "convert", src, dst, "--devices", "4", "--progress",
                             "jsonl"], cwd=ROOT, env={**os.environ, **emulator.env, **hold_at(at_event)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held_at_event(proc, at_event)  # it stopped itself there: a SIGSTOP sent after the line could land later
    emulator.stop()
    proc.send_signal(signal.SIGCONT)  # it now meets a dead endpoint
    time.sleep(OUTAGE_SECONDS)
    emulator.start()
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _finish(first: subprocess.CompletedProcess, src: str, dst: str, emulator: RestartableEmulator,
            local_src) -> None:
    """Ridden out, or one clean line then a rerun that completes; then the result verifies."""
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    print("outage ridden out" if first.returncode == 0 else f"outage: {first.stderr.strip().splitlines()[-1]}")
    if first.returncode != 0:
        assert first.returncode == 1 and first.stderr.strip().splitlines()[-1].startswith("ckptconv: error: "), \
            first.stderr[-3000:]
        assert not _complete(dst, emulator)
        rerun = run_cli("convert", src, dst, "--devices", "4", "--progress", "none", env=emulator.env)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
    verified = run_cli("verify", str(local_src), dst, "--json", env=emulator.env)
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]


def _complete(dst: str, emulator: RestartableEmulator) -> bool:
    if "://" not in dst:
        return destination.inspect_state(dst).complete
    inspected = run_cli("inspect", dst, "--json", env=emulator.env)
    return inspected.returncode == 0 and json.loads(inspected.stdout)["complete"]


@pytest.mark.slow
@pytest.mark.fault
def test_the_source_endpoint_goes_down_and_comes_back_mid_read(tmp_path, emulator, synth_dir):
    local = synth_dir(MODEL, fast=True)
    bucket = emulator.client().create_bucket("src-bucket")
    for path in sorted(local.iterdir()):
        bucket.blob(f"model/{path.name}").upload_from_filename(str(path))
    dst = str(tmp_path / "dst")
    first = _convert_through_an_outage("gs://src-bucket/model", dst, emulator, at_event="plan")
    assert "transient error" in first.stderr, first.stderr[-3000:]  # it saw the outage
    _finish(first, "gs://src-bucket/model", dst, emulator, local)


@pytest.mark.slow
@pytest.mark.fault
def test_the_destination_endpoint_goes_down_and_comes_back_mid_write(tmp_path, emulator, synth_dir):
    local = synth_dir(MODEL, fast=True)
    emulator.client().create_bucket("dst-bucket")
    dst = "gs://dst-bucket/zoo/model"
    first = _convert_through_an_outage(str(local), dst, emulator, at_event="progress")
    _finish(first, str(local), dst, emulator, local)
