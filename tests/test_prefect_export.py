"""The ``export-model`` flow against the session's Prefect test server: the export runs in a child
process, its report comes back, and the stage table and link are stored as artifacts."""

from __future__ import annotations

import json

import pytest
import yaml

from ckptconv.commands import synth
from flows.export import export_model
from tests.conftest import ROOT, run_cli
from tests.prefect_fixtures import latest_artifact

pytestmark = pytest.mark.usefixtures("prefect_server")


def test_export_model_exports_and_publishes(tmp_path, memory_limit):
    memory_limit(8)
    src, maxtext, hf = tmp_path / "src", tmp_path / "maxtext", tmp_path / "qwen3-hf"
    synth.write_checkpoint(synth.SynthModel(), str(src))
    converted = run_cli("convert", str(src), str(maxtext), "--devices", "4", "--progress", "none")
    assert converted.returncode == 0, converted.stderr

    report = export_model(checkpoint=str(maxtext / "0" / "items"), destination=str(hf), like=str(src))
    assert (report["status"], report["skipped"], report["family"], report["attempts"]) == ("complete", False, "qwen3", 1)
    assert report["peak_rss_bytes"] > 50 * 2**20 and (hf / "model.safetensors.index.json").exists()
    rows = latest_artifact("export-qwen3-hf").data
    rows = json.loads(rows) if isinstance(rows, str) else rows
    assert [r["stage"] for r in rows] == ["plan", "read", "transform", "write", "commit", "total (wall)"]
    assert rows[-1]["peak_rss_bytes"] == report["peak_rss_bytes"]
    assert latest_artifact("export-qwen3-hf-output").data.endswith(f"(file://{hf})")
    assert latest_artifact("export-qwen3-hf-progress").data == 100


def test_export_deployment_sits_beside_convert_model():
    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())["deployments"]}
    export = deployments["export-model-cpu"]
    assert export["entrypoint"] == "flows/export.py:export_model"
    assert export["work_pool"] == deployments["convert-model-cpu"]["work_pool"]


def test_export_model_to_the_hub_commits_once_and_links_the_branch(tmp_path, memory_limit, hub, monkeypatch):
    """An ``hf://`` destination goes through the same flow: the child uploads and commits, the
    artifacts say the upload's seconds and link the repo's branch."""
    from tests.hub_server import TOKEN

    memory_limit(8)
    env = {**hub.client_env, "HF_TOKEN": TOKEN, "CKPTCONV_HUB_STAGING": str(tmp_path / "staging")}
    for key, value in env.items():  # as a worker's job variables would, for the synchronous flow call below
        monkeypatch.setenv(key, value)
    src, maxtext = tmp_path / "src", tmp_path / "maxtext"
    synth.write_checkpoint(synth.SynthModel(), str(src))
    converted = run_cli("convert", str(src), str(maxtext), "--devices", "1", "--progress", "none")
    assert converted.returncode == 0, converted.stderr

    report = export_model(checkpoint=str(maxtext), destination="hf://org/flow-export", like=str(src))
    assert (report["status"], report["skipped"], report["attempts"]) == ("complete", False, 1)
    head = hub.head("org/flow-export")
    assert report["hub"]["commit"] == head.sha and "ckptconv-export.json" in head.files
    rows = latest_artifact("export-flow-export").data
    rows = json.loads(rows) if isinstance(rows, str) else rows
    assert [r["stage"] for r in rows] == ["plan", "read", "transform", "write", "commit", "upload", "total (wall)"]
    assert latest_artifact("export-flow-export-output").data.endswith(f"({hub.endpoint}/org/flow-export/tree/main)")
