"""A gs:// destination that refuses writes (out of quota, no permission) or goes mute: one line
naming the destination and the condition, a non-zero exit, nothing that reads as complete, and a
rerun once the bucket accepts writes again completes and verifies (issues 13 and 14). The bucket
is the real emulator behind :class:`tests.gcs_gate.Gate`, which refuses the writes itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.gcs_gate import Gate

QUICK = {"CKPTCONV_REMOTE_TIMEOUT": "2", "CKPTCONV_REMOTE_DEADLINE": "8", "CKPTCONV_REMOTE_ANNOUNCE": "2"}


@pytest.fixture
def gate(gcs):
    g = Gate(gcs.url)
    yield g
    g.close()


def _run(env, *args):
    return subprocess.run([sys.executable, "-m", "ckptconv", *map(str, args)], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def _convert(src, dst, env):
    return _run(env, "convert", src, dst, "--devices", "4", "--progress", "none")


def _complete(dst: str, env: dict) -> bool:
    """Asked of a fresh process, as a user would (this one's gcsfs caches listings)."""
    inspected = _run(env, "inspect", dst, "--json")
    return inspected.returncode == 0 and json.loads(inspected.stdout)["complete"]


def _errors(stderr: str) -> list[str]:
    """stderr without the progress of waiting and tensorstore's info line about the emulator's test token."""
    return [line for line in stderr.splitlines()
            if not line.startswith("ckptconv: still waiting") and "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in line]


@pytest.mark.fault
@pytest.mark.parametrize("refuse, said, where", [
    ("forbidden", "permission denied", "/items/"),  # the data: after the lock and the report
    ("quota", "giving up on writes to gs://", "/items/"),  # tensorstore retries 429 until our deadline
    ("silent", "giving up on writes to gs://", "/items/"),  # a mute endpoint, the same way
    ("forbidden", "the bucket refused the lock object (403", "ckptconv.lock"),  # before anything is written
    ("quota", "the bucket refused the lock object for 8s (last: HTTP 429 The project exceeded", "ckptconv.lock"),
])
def test_a_bucket_that_refuses_writes_is_one_line_and_a_rerun_completes(gcs, gate, synth_dir, refuse, said, where):
    src, dst = synth_dir(), f"gs://{gcs.new_bucket()}/model"
    env = {**gate.env(gcs.env), **QUICK}
    gate.refuse, gate.only = refuse, where
    failed = _convert(src, dst, env)
    assert failed.returncode == 1, failed.stderr
    lines = _errors(failed.stderr)
    assert len(lines) == 1 and said in lines[0], failed.stderr
    assert dst in lines[0] and "Traceback" not in failed.stderr
    if refuse != "forbidden" and where == "/items/":  # our watchdog: lines every 2 s of an 8 s deadline
        assert "still waiting for" in failed.stderr  # it said what it waited for while it waited
    # (the lock's retries are google-cloud-storage's: with its jittered backoff they may give up
    # before the first 2 s line; the one error line then says how long it tried)
    assert gate.refused > 0 and not _complete(dst, env)
    if where == "ckptconv.lock":  # refused before anything was written: nothing there to resume
        assert gcs.objects(dst) == {}
        return
    gate.refuse = None
    env = gate.env(gcs.env)  # the rerun with the default deadlines: a loaded machine is not an outage
    rerun = _convert(src, dst, env)
    assert rerun.returncode == 0, rerun.stderr
    assert _complete(dst, env) and _run(env, "verify", src, dst).returncode == 0


@pytest.mark.fault
@pytest.mark.parametrize("refuse", ["silent", "forbidden"])
def test_an_export_to_a_bucket_that_goes_mute_or_refuses_is_one_line_and_a_rerun_completes(gcs, gate, synth_dir,
                                                                                           tmp_path, refuse):
    src, dst = synth_dir(), f"gs://{gcs.new_bucket()}/exported"
    assert _convert(src, tmp_path / "maxtext", {}).returncode == 0
    export = ("export", tmp_path / "maxtext", dst, "--like", src, "--progress", "none")
    env = {**gate.env(gcs.env), **QUICK}
    gate.refuse, gate.only = refuse, ".safetensors"
    failed = _run(env, *export)
    assert failed.returncode == 1, failed.stderr
    lines = _errors(failed.stderr)
    assert len(lines) == 1 and dst in lines[0] and "Traceback" not in failed.stderr, failed.stderr
    if refuse == "silent":  # gcsfs would wait on its own; our watchdog says so, then gives up
        assert "giving up on writes to gs://" in lines[0] and "still waiting for writes to gs://" in failed.stderr
    assert gate.refused > 0 and json.loads(gcs.read(f"{dst}/ckptconv-report.json"))["status"] == "writing"
    gate.refuse = None
    rerun = _run(gate.env(gcs.env), *export)
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(gcs.read(f"{dst}/ckptconv-report.json"))["status"] == "complete"


@pytest.mark.fault
def test_a_bucket_that_refuses_reads_is_a_refusal_not_a_damaged_checkpoint(gcs, gate, synth_dir):
    """Issue 39: an error never calls a checkpoint damaged for a reason that is not in it. With the bucket refusing
    reads of the stored data (403), inspect --deep, verify DST and verify SRC DST say permission denied on a read,
    exit non-zero, and never say damaged; once the bucket reads again, the same checkpoint verifies."""
    src, dst = synth_dir(), f"gs://{gcs.new_bucket()}/model"
    env = gate.env(gcs.env)
    assert _convert(src, dst, env).returncode == 0
    gate.refuse, gate.only, gate.reads = "forbidden", "/items/", True
    for command in (("inspect", dst, "--deep"), ("verify", dst), ("verify", src, dst)):
        refused = _run(env, *command, "--progress", "none") if command[0] == "verify" else _run(env, *command)
        assert refused.returncode != 0, (command, refused.stdout, refused.stderr)
        said = refused.stdout + refused.stderr
        assert "permission denied (the bucket refused the read)" in said, (command, said)
        assert "damaged" not in said and "Traceback" not in said, (command, said)
    assert gate.refused > 0
    gate.refuse = None
    assert _run(env, "verify", src, dst).returncode == 0
