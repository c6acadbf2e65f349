"""``export CKPT hf://org/repo[@branch]``: staged locally, uploaded by huggingface_hub, one commit.

Against the fake hub's write side (tests/hub_server.py: preupload, LFS batch, single and
multipart uploads checked by sha256, a commit conditional on its parent), with huggingface_hub's
LFS path (``HF_HUB_DISABLE_XET=1``). Each export runs the CLI in a fresh process. The end state
is always compared byte for byte with a local export of the same checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptconv.commands import synth
from tests.conftest import ROOT, run_cli
from tests.hub_server import READ_TOKEN, TOKEN

MODEL = synth.SynthModel(num_layers=4)
SHARD = "40KB"  # several shards: some multipart uploads (>= 64 KiB on the fake hub), some single PUTs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict[str, Path]:
    """A MaxText checkpoint of a small synthetic model, its HF source, and its local export."""
    root = tmp_path_factory.mktemp("hub-export")
    src, mt, local = root / "src", root / "maxtext", root / "local-export"
    synth.write_checkpoint(MODEL, str(src))
    done = run_cli("convert", str(src), str(mt), "--devices", "1", "--progress", "none")
    assert done.returncode == 0, done.stderr
    done = run_cli("export", str(mt), str(local), "--like", str(src), "--shard-size", SHARD, "--progress", "none")
    assert done.returncode == 0, done.stderr
    return {"src": src, "maxtext": mt, "local": local}


def export_to(hub, tmp_path: Path, checkpoint: dict, uri: str, *extra: str, token: str | None = TOKEN):
    env = {**hub.client_env, "CKPTCONV_HUB_STAGING": str(tmp_path / "staging")}
    if token:
        env["HF_TOKEN"] = token
    return run_cli("export", str(checkpoint["maxtext"]), uri, "--like", str(checkpoint["src"]), "--shard-size", SHARD,
                   "--progress", "none", *extra, env=env)


def exported_files(local: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in local.iterdir() if p.is_file() and p.name != "ckptconv-report.json"}


def assert_holds_the_export(hub, repo: str, local: Path, extra: tuple[str, ...] = (".gitattributes",)) -> dict:
    """The branch head holds exactly the local export's files (byte for byte), our record and ``extra``."""
    head = hub.head(repo)
    want = exported_files(local)
    assert sorted(head.files) == sorted([*want, "ckptconv-export.json", *extra])
    for name, data in want.items():
        assert head.files[name].read_bytes() == data, name
    return json.loads(head.files["ckptconv-export.json"].read_text())


def uploads(hub) -> list:
    return [call for call in hub.requests("cdn") if call.method == "PUT"]


def test_export_creates_the_repo_and_commits_once_then_a_rerun_skips(tmp_path, hub, checkpoint):
    result = export_to(hub, tmp_path, checkpoint, "hf://org/exported")
    assert result.returncode == 0, result.stderr
    assert "committed" in result.stdout and "created the repository (private)" in result.stderr
    repo = hub.repos["org/exported"]
    assert repo.private and len(repo.commits) == 2  # the new repo's own, and ours: one commit
    record = assert_holds_the_export(hub, "org/exported", checkpoint["local"])
    assert record["kind"] == "export" and record["family"] == "qwen3" and len(record["files"]) == len(
        exported_files(checkpoint["local"]))
    assert str(tmp_path) not in json.dumps(record)  # no local path leaves the machine
    # uploads went to storage without the token; big files in parts, small ones whole
    puts = uploads(hub)
    assert puts and all(call.auth == "none" for call in puts)
    assert any("/part/" in call.path for call in puts) and any("/part/" not in call.path for call in puts)
    assert all(call.auth == "valid" for call in hub.requests("hub") if "complete_multipart" not in call.path)
    assert not (tmp_path / "staging" / "org--exported@main").exists()  # removed once committed
    assert TOKEN not in result.stdout + result.stderr
    assert not any(TOKEN.encode() in path.read_bytes() for path in tmp_path.rglob("*") if path.is_file())
    assert all(TOKEN.encode() not in blob.read_bytes() for blob in hub.head("org/exported").files.values())

    hub.clear_log()
    again = export_to(hub, tmp_path, checkpoint, "hf://org/exported")
    assert again.returncode == 0, again.stderr
    assert "already exported" in again.stdout and len(repo.commits) == 2 and not uploads(hub)
    assert not any(call.method == "POST" for call in hub.requests())


@pytest.mark.fault
def test_a_cut_upload_and_a_5xx_are_retried_in_the_run(tmp_path, hub, checkpoint):
    """A connection dropped half way through a part and a 503 on a whole-file PUT: huggingface_hub
    sends them again; the one commit holds the export."""
    hub.create_repo("org/faults")
    hub.write_faults += [("part", "cut"), ("put", "503"), ("batch", "503")]
    result = export_to(hub, tmp_path, checkpoint, "hf://org/faults")
    assert result.returncode == 0, result.stderr
    assert not hub.write_faults  # every fault was met
    assert {call.fault for call in uploads(hub)} >= {"cut", "503"}
    assert len(hub.repos["org/faults"].commits) == 2
    assert_holds_the_export(hub, "org/faults", checkpoint["local"])


@pytest.mark.fault
@pytest.mark.parametrize("fault", ["503", "lost"])
def test_a_failed_commit_leaves_the_branch_as_it_was_and_a_rerun_finishes(tmp_path, hub, checkpoint, fault):
    """The commit answered 503 (nothing committed) or its answer was lost after it landed: the run
    fails in one line; the rerun sends no blob again and commits (or finds the export there)."""
    repo_id = f"org/commit-{fault}"
    hub.create_repo(repo_id)
    before = hub.head(repo_id).sha
    hub.write_faults.append(("commit", fault))
    failed = export_to(hub, tmp_path, checkpoint, f"hf://{repo_id}")
    assert failed.returncode == 1, failed.stderr
    error = [line for line in failed.stderr.splitlines() if line.startswith("ckptconv: error:")]
    assert len(error) == 1 and "nothing was committed" in error[0] and "rerun" in error[0]
    if fault == "503":
        assert hub.head(repo_id).sha == before  # the branch shows what it showed: nothing half-written
    assert os.path.isdir(tmp_path / "staging" / f"{repo_id.replace('/', '--')}@main")  # kept for the rerun

    hub.clear_log()
    rerun = export_to(hub, tmp_path, checkpoint, f"hf://{repo_id}")
    assert rerun.returncode == 0, rerun.stderr
    assert not uploads(hub)  # every blob was already there
    assert ("already exported" in rerun.stdout) == (fault == "lost")
    assert len(hub.repos[repo_id].commits) == 2
    assert_holds_the_export(hub, repo_id, checkpoint["local"])


@pytest.mark.fault
def test_a_branch_that_moved_refuses_the_commit_and_a_rerun_commits_on_the_new_head(tmp_path, hub, checkpoint):
    """Another writer commits between our look and our commit: the Hub refuses ours (its parent is
    no longer the head), one line, exit 1; the rerun looks again and commits on top, theirs kept."""
    hub.create_repo("org/moved")
    hub.write_faults.append(("commit", "moved"))
    failed = export_to(hub, tmp_path, checkpoint, "hf://org/moved")
    assert failed.returncode == 1 and "the branch moved" in failed.stderr, failed.stderr
    assert "ckptconv-export.json" not in hub.head("org/moved").files
    rerun = export_to(hub, tmp_path, checkpoint, "hf://org/moved")
    assert rerun.returncode == 0, rerun.stderr
    assert_holds_the_export(hub, "org/moved", checkpoint["local"], extra=(".gitattributes", "README.md"))
    assert len(hub.repos["org/moved"].commits) == 3  # creation, theirs, ours


@pytest.mark.fault
def test_sigterm_during_the_upload_commits_nothing_and_a_rerun_finishes(tmp_path, hub, checkpoint):
    """A stop request while a file is uploading: the run ends at the next batch boundary with one
    line (143), before the commit; the branch is as it was; the rerun commits. The upload stalls until
    the signal is sent (``hub.unstall``): a stall of fixed length let a test process late by that
    much signal a run that had gone on to commit."""
    hub.create_repo("org/stopped")
    before = hub.head("org/stopped").sha
    hub.stall_seconds = 300.0  # only bounds a test that never lets it go (the hub fixture sets it back)
    hub.write_faults.append(("part", "stall"))
    env = {**os.environ, **hub.client_env, "HF_TOKEN": TOKEN, "CKPTCONV_HUB_STAGING": str(tmp_path / "staging")}
    env.pop("XLA_FLAGS", None)
    child = subprocess.Popen([sys.executable, "-m", "ckptconv", "export", str(checkpoint["maxtext"]),
                              "hf://org/stopped", "--like", str(checkpoint["src"]), "--shard-size", SHARD,
                              "--progress", "none"],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # only bounds a busy machine
    while not any(call.status == -1 for call in uploads(hub)):
        assert time.monotonic() < deadline and child.poll() is None, "no upload stalled"
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    hub.unstall.set()  # the stalled part goes on; its batch ends, the stop is heard before the next
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 143 and "ckptconv: terminated (SIGTERM)" in stderr, stderr
    assert hub.head("org/stopped").sha == before
    rerun = export_to(hub, tmp_path, checkpoint, "hf://org/stopped")
    assert rerun.returncode == 0, rerun.stderr
    assert_holds_the_export(hub, "org/stopped", checkpoint["local"])


def test_bad_input_is_one_line_and_uploads_nothing(tmp_path, hub, checkpoint, synth_dir):
    hub.add_commit("org/tagged", synth_dir(MODEL, name="tagged"), tags=("v1",))
    cases = {
        "no-token": (export_to(hub, tmp_path, checkpoint, "hf://org/any", token=None), "needs a Hugging Face token"),
        "read-only": (export_to(hub, tmp_path, checkpoint, "hf://org/tagged@main", token=READ_TOKEN),
                      "may not write"),
        "tag": (export_to(hub, tmp_path, checkpoint, "hf://org/tagged@v1"), "'v1' is a tag"),
        "commit": (export_to(hub, tmp_path, checkpoint, f"hf://org/tagged@{hub.head('org/tagged').sha}"),
                   "is a commit"),
        "no-branch": (export_to(hub, tmp_path, checkpoint, "hf://org/tagged@dev"), "is no branch"),
        "foreign": (export_to(hub, tmp_path, checkpoint, "hf://org/tagged"), "not exported by ckptconv"),
        "bad-uri": (export_to(hub, tmp_path, checkpoint, "hf://org"), "expected hf://ORG/REPO"),
        "bad-like": (run_cli("export", str(checkpoint["maxtext"]), "hf://org/never", "--like",
                             str(synth_dir(synth.SynthModel(num_layers=3), name="other")), "--progress", "none",
                             env={**hub.client_env, "HF_TOKEN": TOKEN}), "layers"),
    }
    for name, (result, said) in cases.items():
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and said in lines[0], (name, result.stderr)
        assert READ_TOKEN not in result.stderr and TOKEN not in result.stderr
    assert not uploads(hub) and "org/any" not in hub.repos and "org/never" not in hub.repos
    assert not any(call.method == "POST" for call in hub.requests())  # no repo made, nothing uploaded or committed
    assert len(hub.repos["org/tagged"].commits) == 1


def test_overwrite_replaces_foreign_files_and_another_export(tmp_path, hub, checkpoint, synth_dir):
    """--overwrite commits over a repo not ours (its weights deleted in the same commit, the model
    card kept; the token from --hf-token-file); an export with other options is refused, then
    replaces ours, stale shards deleted."""
    theirs = synth_dir(MODEL, name="theirs")
    (theirs / "README.md").write_text("# a model card\n")
    hub.add_commit("org/theirs", theirs)
    tokens = tmp_path / "secrets" / "hf-token"
    tokens.parent.mkdir()
    tokens.write_text(TOKEN + "\n")
    result = export_to(hub, tmp_path, checkpoint, "hf://org/theirs", "--overwrite", "--hf-token-file", str(tokens),
                       token=None)
    assert result.returncode == 0, result.stderr
    assert_holds_the_export(hub, "org/theirs", checkpoint["local"], extra=("README.md",))

    other = export_to(hub, tmp_path, checkpoint, "hf://org/theirs", "--shard-size", "5GB")
    assert other.returncode == 2 and "another checkpoint or with other options" in other.stderr
    replaced = export_to(hub, tmp_path, checkpoint, "hf://org/theirs", "--shard-size", "5GB", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    head = hub.head("org/theirs")
    record = json.loads(head.files["ckptconv-export.json"].read_text())
    assert sorted(name for name in head.files if name.endswith(".safetensors")) == sorted(
        name for name in record["files"] if name.endswith(".safetensors")) and len(record["files"]) == 3
    assert len(hub.repos["org/theirs"].commits) == 3
