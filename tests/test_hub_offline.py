"""hf:// sources without the hub: ``HF_HUB_OFFLINE=1`` or no network reads the local Hugging Face cache.

The cache is made by huggingface_hub itself (``hf_hub_download`` through the fake hub of
tests/hub_server.py), so its layout is the real one: ``models--ORG--NAME/{refs,snapshots,blobs}``.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from ckptconv.commands import synth
from tests.conftest import run_cli

MODEL = synth.SynthModel(num_layers=2)


def fill_cache(hub, repo: str, revision: str, cache: Path) -> None:
    """Download every checkpoint file of ``repo@revision`` into ``cache`` as `hf download` would."""
    from huggingface_hub import hf_hub_download

    for name in ("config.json", "model.safetensors"):
        hf_hub_download(repo, name, revision=revision, cache_dir=str(cache), endpoint=hub.endpoint, token=False)


def closed_port() -> int:
    """A loopback port nothing listens on: connecting is refused at once, as with no network."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_line(result, code: int, expected: str) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and expected in result.stderr and "Traceback" not in result.stderr, \
        result.stderr


@pytest.fixture
def cached(hub, synth_dir):
    """``org/cached`` tagged ``v1`` on the hub, and downloaded once into the client's cache (HF_HOME/hub)."""
    sha = hub.add_commit("org/cached", synth_dir(MODEL), tags=("v1",))
    fill_cache(hub, "org/cached", "v1", Path(hub.client_env["HF_HOME"]) / "hub")
    hub.clear_log()
    return sha


def test_offline_converts_and_verifies_from_the_cache(tmp_path, hub, cached):
    env = {**hub.client_env, "HF_HUB_OFFLINE": "1"}
    dst = tmp_path / "dst"
    result = run_cli("convert", "hf://org/cached@v1", str(dst), "--devices", "1", "--progress", "none", env=env)
    assert result.returncode == 0, result.stderr
    assert f"hf://org/cached@v1: HF_HUB_OFFLINE is set; using the cached snapshot of commit {cached}" in result.stderr
    source = json.loads((dst / "ckptconv-report.json").read_text())["source"]
    assert (source["kind"], source["repo"], source["revision"], source["commit"]) == ("hf", "org/cached", "v1", cached)
    assert set(source["files"]) == {"config.json", "model.safetensors"}
    checked = run_cli("verify", "hf://org/cached@v1", str(dst), "--progress", "none", env=env)
    assert checked.returncode == 0 and "verify: OK" in checked.stdout, checked.stderr
    assert hub.requests() == []  # offline means not one request


def test_offline_follows_hf_hub_cache(tmp_path, hub, cached):
    """HF_HUB_CACHE names the cache wherever it is, whatever HF_HOME says."""
    moved = tmp_path / "elsewhere"
    shutil.move(Path(hub.client_env["HF_HOME"]) / "hub", moved)
    env = {**hub.client_env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(moved)}
    planned = run_cli("plan", "hf://org/cached@v1", "--json", env=env)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["family"] == "qwen3" and str(moved) in planned.stderr
    gone = run_cli("plan", "hf://org/cached@v1", env={**env, "HF_HUB_CACHE": str(tmp_path / "empty-cache")})
    one_line(gone, 2, "has no complete copy of org/cached at 'v1'")


def test_offline_without_a_cached_copy_is_one_line(hub, cached):
    env = {**hub.client_env, "HF_HUB_OFFLINE": "1"}
    result = run_cli("plan", "hf://org/never-downloaded", env=env)
    one_line(result, 2, "hf://org/never-downloaded: HF_HUB_OFFLINE is set, and the Hugging Face cache ("
                        f"{hub.client_env['HF_HOME']}/hub) has no complete copy of org/never-downloaded at 'main'")
    other_revision = run_cli("plan", "hf://org/cached@v2", env=env)
    one_line(other_revision, 2, "no complete copy of org/cached at 'v2'; download it once with network access "
                                "(`hf download org/cached --revision v2`)")


def test_no_network_uses_the_cache_and_says_so(hub, cached):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = {**hub.client_env, "HF_ENDPOINT": endpoint}
    planned = run_cli("plan", "hf://org/cached@v1", "--json", env=env)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["family"] == "qwen3"
    assert f"hf://org/cached@v1: cannot reach {endpoint} (ConnectError" in planned.stderr
    assert f"using the cached snapshot of commit {cached}" in planned.stderr and "Traceback" not in planned.stderr
    missing = run_cli("plan", "hf://org/never-downloaded", env=env)
    one_line(missing, 1, f"cannot reach {endpoint} (ConnectError")
    assert "has no complete copy of org/never-downloaded" in missing.stderr
