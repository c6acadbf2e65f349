"""hf:// sources against the fake hub (tests/hub_server.py): revisions, tokens, ranged reads, retries.

Conversions run through the CLI in fresh processes pointed at the fake hub by ``HF_ENDPOINT``.
Every test checks the token never shows up in what a user or a log collector sees.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptconv.commands import synth
from tests.conftest import run_cli
from tests.hub_server import TOKEN

MODEL = synth.SynthModel(num_layers=2)


def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "secrets" / "hf-token"
    path.parent.mkdir()
    path.write_text(TOKEN + "\n")
    return path


def assert_token_hidden(tmp_path: Path, *results) -> None:
    """No CLI output and no file the test wrote outside ``secrets/`` (DST, reports, HF_HOME) holds the token."""
    for result in results:
        assert TOKEN not in result.stdout + result.stderr
    for path in tmp_path.rglob("*"):
        if path.is_file() and "secrets" not in path.parts:
            assert TOKEN.encode() not in path.read_bytes(), path


@pytest.fixture
def private_repo(hub, synth_dir):
    """``org/private`` with tag ``v1`` (seed 0) and a later ``main`` (seed 1, same shapes)."""
    old = hub.add_commit("org/private", synth_dir(MODEL, name="v1"), tags=("v1",), private=True)
    new = hub.add_commit("org/private", synth_dir(synth.SynthModel(num_layers=2, seed=1), name="v2"),
                         private=True)
    return {"v1": old, "main": new}


def test_revision_with_token_file_converts_and_verifies(tmp_path, hub, private_repo):
    """hf://ORG/REPO@REV with --hf-token-file: the tagged commit is read by range, pinned, verified."""
    dst, tokens = tmp_path / "dst", token_file(tmp_path)
    result = run_cli("convert", "hf://org/private@v1", str(dst), "--devices", "4", "--progress", "none",
                     "--hf-token-file", str(tokens), "--report", str(tmp_path / "extra-report.json"),
                     env=hub.client_env)
    assert result.returncode == 0, result.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert report["source"]["commit"] == private_repo["v1"] and report["source"]["revision"] == "v1"
    assert report["source"]["uri"] == "hf://org/private@v1" and set(report["source"]["files"]) == {
        "config.json", "model.safetensors"}

    # Hub API calls carried the token; the CDN (another origin) never saw it; every read was a range.
    hub_calls, cdn_calls = hub.requests("hub"), hub.requests("cdn")
    assert hub_calls and all(call.auth == "valid" for call in hub_calls)
    assert cdn_calls and all(call.auth == "none" for call in cdn_calls)
    assert all(call.range and not call.range.endswith("-") for call in hub_calls + cdn_calls
               if "/resolve/" in call.path or call.server == "cdn")
    assert all(f"/{private_repo['v1']}/" in call.path for call in hub_calls + cdn_calls if "resolve" in call.path)
    # ...and together they read the shard exactly once: header, then each tensor's own bytes.
    size = hub.repos["org/private"].commits[private_repo["v1"]].files["model.safetensors"].stat().st_size
    lengths = [int(b) - int(a) + 1 for a, b in (c.range.removeprefix("bytes=").split("-") for c in cdn_calls)]
    assert sum(lengths) == size and max(lengths) < size / 2
    assert not any(Path(hub.client_env["HF_HOME"]).rglob("*.safetensors"))  # streamed, nothing cached

    checked = run_cli("verify", "hf://org/private@v1", str(dst), "--hf-token-file", str(tokens), env=hub.client_env)
    assert checked.returncode == 0 and "verify: OK" in checked.stdout, checked.stdout + checked.stderr
    assert_token_hidden(tmp_path, result, checked)


def test_hf_token_env_rerun_and_upstream_change(tmp_path, hub, private_repo, synth_dir):
    """HF_TOKEN works too; a rerun is a no-op until the branch moves, then it is refused (exit 2)."""
    env = {**hub.client_env, "HF_TOKEN": TOKEN}
    dst = tmp_path / "dst"
    first = run_cli("convert", "hf://org/private", str(dst), "--devices", "1", "--progress", "jsonl", env=env)
    assert first.returncode == 0, first.stderr
    assert json.loads((dst / "ckptconv-report.json").read_text())["source"]["commit"] == private_repo["main"]
    again = run_cli("convert", "hf://org/private", str(dst), "--devices", "1", "--progress", "none", env=env)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr

    hub.add_commit("org/private", synth_dir(synth.SynthModel(num_layers=2, seed=2), name="v3"), private=True)
    moved = run_cli("convert", "hf://org/private", str(dst), "--devices", "1", "--progress", "none", env=env)
    assert moved.returncode == 2 and "--overwrite" in moved.stderr
    assert_token_hidden(tmp_path, first, again, moved)


@pytest.mark.parametrize("how, message", [
    ("none", "repository not found, or private"),
    ("wrong", "access denied"),
    ("empty-file", "token file is empty"),
    ("missing-file", "cannot read the hub token file"),
])
def test_token_problems_fail_with_one_line(tmp_path, hub, private_repo, how, message):
    """Missing, wrong or unreadable tokens: exit 2, one line, no traceback, DST untouched, token not shown."""
    args, env = [], dict(hub.client_env)
    if how == "wrong":
        env["HF_TOKEN"] = TOKEN[:-3] + "bad"
    elif how == "empty-file":
        (tmp_path / "empty").write_text("\n")
        args = ["--hf-token-file", str(tmp_path / "empty")]
    elif how == "missing-file":
        args = ["--hf-token-file", str(tmp_path / "nope")]
    dst = tmp_path / "dst"
    result = run_cli("plan", "hf://org/private@v1", *args, env=env) if how.endswith("file") else run_cli(
        "convert", "hf://org/private@v1", str(dst), "--progress", "none", *args, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not dst.exists()
    assert_token_hidden(tmp_path, result)
    assert TOKEN[:-3] not in result.stdout + result.stderr  # nor the wrong token


def test_unknown_revision_and_bad_uri(tmp_path, hub, private_repo):
    env = {**hub.client_env, "HF_TOKEN": TOKEN}
    missing = run_cli("plan", "hf://org/private@v9", env=env)
    assert missing.returncode == 2 and "revision 'v9' not found" in missing.stderr
    malformed = run_cli("plan", "hf://just-a-name", env=env)
    assert malformed.returncode == 2 and "expected hf://ORG/REPO" in malformed.stderr


@pytest.mark.fault
def test_transient_errors_are_retried_and_resumed(tmp_path, hub, synth_dir):
    """503s and a connection cut mid-body are retried (resuming the range); the result verifies."""
    sha = hub.add_commit("org/public", synth_dir(MODEL))
    hub.faults.extend(["503", "cut", "503", "cut"])
    dst = tmp_path / "dst"
    result = run_cli("convert", f"hf://org/public@{sha}", str(dst), "--devices", "1", "--progress", "none",
                     env=hub.client_env)
    assert result.returncode == 0, result.stderr
    assert not hub.faults, "every injected fault was hit"
    assert result.stderr.count("retrying in") >= 4
    cdn = hub.requests("cdn")
    assert [call.status for call in cdn].count(503) == 2
    for i, call in enumerate(cdn):  # after a cut, the retry asks only for the bytes still missing
        if call.fault == "cut":
            start, end = map(int, call.range.removeprefix("bytes=").split("-"))
            # The retry is the next request for the rest of this range (other workers' reads may come between).
            retry = next(later for later in cdn[i + 1:] if later.path == call.path and later.range.endswith(f"-{end}"))
            resumed = retry.range.removeprefix("bytes=").split("-")
            assert start < int(resumed[0]) <= start + (end - start + 1) // 2 and int(resumed[1]) == end
    assert all(call.auth == "none" for call in hub.requests())  # public repo, no token configured
    checked = run_cli("verify", f"hf://org/public@{sha}", str(dst), env=hub.client_env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
