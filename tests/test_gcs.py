"""gs:// sources and destinations against the real fake-gcs-server (tests/gcs_server.py).

End to end through the CLI (gs->gs, local->gs, gs->local, inspect, verify, skip/refuse/overwrite)
plus in-process checks of what the emulator cannot be made to do on its own: transient errors
in the middle of a ranged read, and an object replaced while a conversion reads it.
"""

from __future__ import annotations

import json
import re

import pytest
import requests

from ckptconv.commands import synth
from ckptconv.errors import CkptConvError
from tests.conftest import run_cli

MODEL = synth.SynthModel(num_layers=3)
# ~130 MB of bf16: big enough that buffering a shard would show in the peak RSS.
MEDIUM = synth.SynthModel(vocab_size=32000, hidden_size=512, num_layers=16, num_heads=8, num_kv_heads=4,
                          head_dim=64, intermediate_size=1536)


@pytest.fixture
def gs_src(gcs, synth_dir):
    """A sharded synthetic checkpoint uploaded to ``gs://<fresh bucket>/models/tiny``."""
    src = synth_dir(MODEL, max_shard_bytes=100_000)
    return gcs.upload_dir(src, f"gs://{gcs.new_bucket('src')}/models/tiny"), src


def test_gs_to_gs_inspect_verify_skip_refuse_overwrite_upstream_change(gcs, gs_src):
    uri, local_src = gs_src
    dst = f"gs://{gcs.new_bucket('zoo')}/qwen/tiny"
    first = run_cli("convert", uri, dst, "--devices", "4", "--progress", "none")
    assert first.returncode == 0, first.stderr
    report = json.loads(gcs.read(f"{dst}/ckptconv-report.json"))
    listed = {blob.name.rsplit("/", 1)[1]: blob.generation
              for blob in gcs.client().list_blobs(uri[5:].split("/")[0], prefix="models/tiny/")}
    assert report["source"] == {"uri": uri, "kind": "gcs", "generations": listed}
    assert {"0/commit_success.txt", "0/items/_METADATA", "ckptconv-report.json"} <= set(gcs.objects(dst))
    assert gcs.read(f"{dst}/ckptconv-rss.svg").startswith(b"<svg")  # the RSS plot beside the report, on GCS too

    inspected = run_cli("inspect", dst)
    assert inspected.returncode == 0, inspected.stderr
    assert re.search(rf"{dst}: complete; \d+ leaves; custom metadata {{'scan_layers': True}}", inspected.stdout)
    assert inspected.stdout.count("P('checkpoint_sharding_axis')") >= 10
    verified = run_cli("verify", uri, dst)
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr

    again = run_cli("convert", uri, dst, "--devices", "4", "--progress", "none")
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr
    other = run_cli("convert", uri, dst, "--devices", "1", "--progress", "none")
    assert other.returncode == 2 and "--overwrite" in other.stderr and "Traceback" not in other.stderr
    replaced = run_cli("convert", uri, dst, "--devices", "1", "--progress", "none", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(gcs.read(f"{dst}/ckptconv-report.json"))["devices"] == 1

    # Re-uploading the source (same bytes, new generations) reads as an upstream change: refused.
    gcs.upload_dir(local_src, uri)
    changed = run_cli("convert", uri, dst, "--devices", "1", "--progress", "none")
    assert changed.returncode == 2 and "--overwrite" in changed.stderr


def test_local_to_gs_and_gs_to_local(tmp_path, gcs, gs_src):
    uri, local_src = gs_src
    to_gcs = f"gs://{gcs.new_bucket('zoo')}/from-local"
    up = run_cli("convert", str(local_src), to_gcs, "--devices", "2", "--progress", "none")
    assert up.returncode == 0, up.stderr
    down = run_cli("convert", uri, str(tmp_path / "from-gcs"), "--devices", "2", "--progress", "none")
    assert down.returncode == 0, down.stderr
    assert json.loads((tmp_path / "from-gcs" / "ckptconv-report.json").read_text())["source"]["kind"] == "gcs"
    # Cross-check: each checkpoint verifies against the *other* copy of the source.
    for src, dst in ((uri, to_gcs), (str(local_src), str(tmp_path / "from-gcs"))):
        checked = run_cli("verify", src, dst)
        assert checked.returncode == 0 and "verify: OK" in checked.stdout, checked.stdout + checked.stderr


def test_missing_gcs_source_is_bad_input(gcs, tmp_path):
    result = run_cli("plan", f"gs://{gcs.new_bucket('empty')}/nothing")
    assert result.returncode == 2 and "no files there" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_gcs_source_memory_like_local(tmp_path, gcs, synth_dir):
    """Streaming from gs:// costs about what reading local files does: no shard is held whole."""
    src = synth_dir(MEDIUM)  # one 133 MB file: holding it whole would add that much
    uri = gcs.upload_dir(src, f"gs://{gcs.new_bucket('src')}/medium")
    peaks = {}
    for name, source in (("local", str(src)), ("gcs", uri)):
        result = run_cli("convert", source, str(tmp_path / name), "--devices", "4", "--progress", "none")
        assert result.returncode == 0, result.stderr
        peaks[name] = json.loads((tmp_path / name / "ckptconv-report.json").read_text())["peak_rss_bytes"]
    assert peaks["gcs"] - peaks["local"] < 80 * 2**20, peaks  # measured: ~25-30 MB (the cloud client libraries)


@pytest.fixture
def gcs_source(gs_src):
    from ckptconv.read.gcs import GcsSource
    from ckptconv.read.ranged import RetryPolicy

    source = GcsSource(gs_src[0])
    source.retry = RetryPolicy(attempts=3, first_wait=0.01, max_wait=0.02)
    return source, gs_src[1]


@pytest.mark.fault
def test_ranged_reads_resume_after_transient_errors(gcs_source, monkeypatch):
    """A 503 and a connection dropped half-way are retried, asking only for the missing bytes."""
    from google.api_core import exceptions as gexc
    from google.cloud.storage import Blob

    source, local = gcs_source
    name = next(n for n in source.list_names() if n.endswith(".safetensors"))
    expected = (local / name).read_bytes()[1000:41000]
    real = Blob.download_to_file
    calls: list[tuple[int, int]] = []

    def flaky(self, file_obj, *, start, end, **kwargs):
        calls.append((start, end))
        if len(calls) == 1:
            raise gexc.ServiceUnavailable("injected")
        if len(calls) == 2:  # deliver half, then drop the connection
            half = (end - start + 1) // 2
            file_obj.write(self.bucket.blob(self.name, generation=self.generation).download_as_bytes(
                start=start, end=start + half - 1))
            raise requests.exceptions.ChunkedEncodingError("injected: connection broken")
        return real(self, file_obj, start=start, end=end, **kwargs)

    # class-level, for the one synchronous read_range below (it reads on this thread); no other GCS reader runs in
    # this worker meanwhile, and monkeypatch puts the method back when the test ends
    monkeypatch.setattr(Blob, "download_to_file", flaky)
    assert bytes(source.read_range(name, 1000, 40000)) == expected
    assert calls == [(1000, 40999), (1000, 40999), (21000, 40999)]


def test_permanent_errors_are_not_retried(gcs_source, monkeypatch):
    from google.api_core import exceptions as gexc
    from google.cloud.storage import Blob

    source, _ = gcs_source
    calls = []

    def forbidden(self, file_obj, **kwargs):
        calls.append(1)
        raise gexc.Forbidden("injected")

    monkeypatch.setattr(Blob, "download_to_file", forbidden)  # class-level, for the one read below, as above
    with pytest.raises(CkptConvError, match="permission denied"):
        source.read_range("config.json", 0, 10)
    assert len(calls) == 1


def test_reads_are_pinned_to_the_listed_generation(gcs, gcs_source):
    """An object replaced after the source was opened is an error, not silently mixed bytes."""
    source, local = gcs_source
    assert bytes(source.read_range("config.json", 0, 5)) == (local / "config.json").read_bytes()[:5]
    gcs.upload_dir(local, source.uri)  # new generations of every file
    with pytest.raises(CkptConvError, match="changed during the conversion"):
        source.read_range("config.json", 0, 5)
    with pytest.raises(CkptConvError, match="truncated"):
        source.read_range("config.json", 0, source.size("config.json") + 1)


def test_a_gcs_destination_is_locked_by_a_generation_precondition(gcs):
    """Two owners of one gs:// destination cannot coexist: the lock object is created only if absent
    (ifGenerationMatch=0). A dead holder on this host is taken over, one on another host is
    refused unless broken (--overwrite), and the lock is gone once the owner is done."""
    import subprocess
    import sys

    from ckptconv.errors import CkptConvError
    from ckptconv.write import lock

    dst = f"gs://{gcs.new_bucket('lock')}/models/locked"
    with lock.hold(dst):
        assert gcs.objects(dst) == {"ckptconv.lock": gcs.objects(dst)["ckptconv.lock"]}
        with pytest.raises(CkptConvError, match=rf"{dst}/ckptconv.lock: another conversion \(pid \d+ on "):
            with lock.hold(dst):
                pass
    assert gcs.objects(dst) == {}

    bucket, _, prefix = dst[len("gs://"):].partition("/")
    blob = gcs.client().bucket(bucket).blob(f"{prefix}/ckptconv.lock")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    blob.upload_from_string(json.dumps({**lock._me(), "pid": dead.pid, "start_ticks": 1}))
    with lock.hold(dst):  # this host, its pid gone: stale, taken over
        assert json.loads(blob.download_as_text())["pid"] == lock._me()["pid"]
    blob.upload_from_string(json.dumps({**lock._me(), "host": "another-host"}))
    with pytest.raises(CkptConvError, match="another-host"):
        with lock.hold(dst):
            pass
    with lock.hold(dst, break_foreign=True):
        assert json.loads(blob.download_as_text())["host"] != "another-host"
    assert gcs.objects(dst) == {}


def test_export_from_gs_to_gs_gives_back_the_source(tmp_path, gcs, gs_src):
    """The issue's own example, against the emulator: ``export gs://zoo/.../0/items gs://exports/...
    --like gs://...``; a rerun skips, --overwrite redoes it, and a foreign prefix is refused."""
    import glob

    import numpy as np
    from safetensors.numpy import load_file

    uri, local_src = gs_src
    zoo = f"gs://{gcs.new_bucket('zoo')}/qwen/tiny"
    assert run_cli("convert", uri, zoo, "--devices", "4", "--progress", "none").returncode == 0
    out = f"gs://{gcs.new_bucket('exports')}/qwen/tiny"
    export = ("export", f"{zoo}/0/items", out, "--like", uri, "--progress", "none", "--shard-size", "40KB")
    first = run_cli(*export)
    assert first.returncode == 0, first.stderr
    report = json.loads(gcs.read(f"{out}/ckptconv-report.json"))
    assert report["status"] == "complete" and len(report["files"]) > 2
    assert set(gcs.objects(out)) == {*report["files"], "config.json", "model.safetensors.index.json",
                                     "ckptconv-report.json"}
    for file in report["files"]:  # the reference reader (it reads bfloat16 from files only)
        (tmp_path / file).write_bytes(gcs.read(f"{out}/{file}"))
    exported = {name: array for file in report["files"] for name, array in load_file(tmp_path / file).items()}
    source = {name: array for file in glob.glob(f"{local_src}/*.safetensors") for name, array in load_file(file).items()}
    assert sorted(exported) == sorted(source)
    assert all(exported[name].dtype == source[name].dtype and np.array_equal(exported[name].view(np.uint8),
                                                                             source[name].view(np.uint8))
               for name in source)

    again = run_cli(*export)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    other = run_cli(*export[:-2], "--shard-size", "1GB")
    assert other.returncode == 2 and "--overwrite" in other.stderr
    redone = run_cli(*export[:-2], "--shard-size", "1GB", "--overwrite")
    assert redone.returncode == 0, redone.stderr
    files = json.loads(gcs.read(f"{out}/ckptconv-report.json"))["files"]
    assert len(files) == 1 and set(gcs.objects(out)) == {*files, "config.json", "model.safetensors.index.json",
                                                         "ckptconv-report.json"}

    foreign = f"gs://{gcs.new_bucket('mine')}/notes"
    gcs.client().bucket(foreign[5:].split("/")[0]).blob("notes/readme.txt").upload_from_string("mine")
    refused = run_cli("export", f"{zoo}/0/items", foreign, "--like", uri, "--progress", "none")
    assert refused.returncode == 2 and gcs.objects(foreign) == {"readme.txt": 4}


def test_other_directories_under_a_gcs_destination_survive_a_conversion(gcs, gs_src):
    """On GCS, Orbax's own clean-up takes every directory under DST without a commit_success.txt for
    an unfinished step and deletes it; what is not ours must survive (as it does locally)."""
    uri, _ = gs_src
    dst = f"gs://{gcs.new_bucket('zoo')}/shared/prefix"
    bucket, _, prefix = dst[len("gs://"):].partition("/")
    gcs.client().bucket(bucket).blob(f"{prefix}/notes/readme.txt").upload_from_string(b"the team's notes")
    done = run_cli("convert", uri, dst, "--devices", "2", "--progress", "none")
    assert done.returncode == 0, done.stderr
    assert gcs.read(f"{dst}/notes/readme.txt") == b"the team's notes"
