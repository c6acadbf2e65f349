"""The flows and tasks against a real (temporary) Prefect server; artifacts are read back from it.

All tests share one session-wide ``prefect_test_harness`` (tests/prefect_fixtures.py). Every
conversion, plan, verify and inspect runs ``python -m ckptconv`` in a child process.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re

import pytest
import yaml
from prefect import flow

from ckptconv.units import human_bytes, human_seconds
from flows.artifacts import ui_url
import flows.model
from flows.model import convert_model
from flows.zoo import convert_zoo
from tasks import Conversion, convert_checkpoint
from tasks.admission import GIB
from tasks.convert import KILL_HOOK
from tasks.failures import retryable
from tasks.progress import ProgressReporter
from tests.prefect_fixtures import latest_artifact, task_runs

pytestmark = pytest.mark.usefixtures("prefect_server")


def _table(key: str) -> list[dict]:
    artifact = latest_artifact(key)
    assert artifact.type == "table"
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def test_convert_model_converts_verifies_and_publishes(synth_dir, tmp_path, memory_limit):
    limit = memory_limit(8)
    source, destination = synth_dir(), tmp_path / "qwen3-tiny"
    row = convert_model(source=str(source), destination=str(destination), devices=4, scan_layers=True, dtype="bfloat16")
    assert (row["model"], row["status"], row["retries"], row["held_gb"]) == ("qwen3-tiny", "complete", 0, 1)
    assert (destination / "0" / "items" / "_METADATA").exists()

    page = latest_artifact("conversion-qwen3-tiny")  # the model's one page for people
    assert page.type == "markdown"
    report = json.loads((destination / "ckptconv-report.json").read_text())
    summary = page.data
    for stage in ("plan", "read", "transform", "write", "commit"):
        assert f"| {stage} | {human_seconds(report['stage_seconds'][stage])} |" in summary, stage
    assert f"| **wall time** | **{human_seconds(report['wall_seconds'])}** |" in summary and "overlap" in summary
    assert "](data:image/svg+xml;base64," in summary and (destination / "ckptconv-rss.svg").is_file()
    assert 50 * 2**20 < report["peak_rss_bytes"] < 2 * GIB  # the conversion's VmHWM
    assert f"peak RSS {human_bytes(report['peak_rss_bytes'])}" in summary
    for text in (f"`{source}` (kind local)", f"`{destination}`", "4 devices, scan_layers=true, bfloat16",
                 "| verify | OK: 13 leaves, 24 tensors", "(the conversion's own high-water mark, VmHWM)", f"held 1 GB of `{limit}` (limit 8 GB)",
                 "| sharding | 13 leaves sharded over 4 devices, 1 replicated; chunks within shards |",  # + MaxText's step
                 "| attempts | 1 |", f"CPU {human_seconds(report['cpu_seconds'])}, "
                 f"{human_seconds(report['cpu_seconds_per_gib'])} per GiB", f"Output: [{destination}](file://{destination})"):
        assert text in summary, text
    assert latest_artifact("conversion-qwen3-tiny-progress").data == 100
    published = _table("conversion-qwen3-tiny-row")[0]
    assert published["artifact_id"] == str(page.id) and published["peak_rss_mib"] == round(report["peak_rss_bytes"] / 2**20, 1)

    again = convert_model(source=str(source), destination=str(destination), devices=4)
    assert again["status"] == "skipped"
    summary = latest_artifact("conversion-qwen3-tiny").data
    assert "| status | skipped" in summary and "| verify | not rerun" in summary


def test_convert_model_passes_the_restore_layout_on(synth_dir, tmp_path, memory_limit):
    """``compression`` and ``data_files_by_device`` reach the child (a zoo manifest entry sets them alike): its chunks
    are lz4 and device 0's shard lies in fewer data files than the checkpoint has; the page says so."""
    memory_limit(8)
    source, destination = synth_dir(), tmp_path / "by-device"
    row = convert_model(source=str(source), destination=str(destination), devices=4, compression="lz4",
                        data_files_by_device=True)
    assert row["status"] == "complete"
    report = json.loads((destination / "ckptconv-report.json").read_text())
    assert report["compression"] == "lz4" and report["data_files_by_device"] is True
    assert 1 <= report["restore"]["device_data_files"] < report["restore"]["data_files"], report["restore"]
    assert "4 devices, scan_layers=true, bfloat16, lz4 chunks, data files by device" in latest_artifact("conversion-by-device").data


def test_progress_artifact_follows_the_child_lines():
    key = "conversion-progress-probe-progress"
    seen = []

    @flow
    def feed() -> None:
        reporter = ProgressReporter("progress-probe", logging.getLogger("probe"))
        seen.append(latest_artifact(key).data)
        for done in (25, 50):
            reporter.on_line('CKPTCONV {"event": "progress", "tensors": %d, "total_tensors": 100, "bytes": %d, '
                             '"total_bytes": 100, "rss_bytes": 1000000}' % (done, done), 1234)
            seen.append(latest_artifact(key).data)
        reporter.finish("complete")
        seen.append(latest_artifact(key).data)

    feed()
    assert seen == [0, 25, 50, 100]
    assert latest_artifact(key).description == "complete"


@pytest.mark.fault
def test_sigkilled_conversion_is_retried_and_completes(synth_dir, tmp_path, memory_limit, monkeypatch):
    memory_limit(8)
    # The environment is how a deployment hands the flow its settings, so the test sets it as a worker would,
    # for the synchronous flow call below; Prefect's threads that outlive it (log and event workers) read no
    # CKPTCONV_ name. The task is replaced in flows.model's namespace for this call only.
    monkeypatch.setenv(KILL_HOOK, "1")  # the task SIGKILLs its child at the child's first event, attempt 1 only
    # the decorator's backoff (10 s, 20 s, 40 s) without the wait; retries and retry_condition_fn stay as declared
    monkeypatch.setattr(flows.model, "convert_checkpoint", convert_checkpoint.with_options(retry_delay_seconds=0))
    assert (flows.model.convert_checkpoint.retries, flows.model.convert_checkpoint.retry_condition_fn) == (3, retryable)
    destination = tmp_path / "killed-once"
    state = convert_model(source=str(synth_dir()), destination=str(destination), devices=4, return_state=True)
    assert state.is_completed(), state.message
    assert state.result()["retries"] == 1
    runs = task_runs(state.state_details.flow_run_id)
    assert runs["convert-killed-once"].run_count == 2
    assert runs["verify-killed-once"].state.is_completed()
    summary = latest_artifact("conversion-killed-once").data
    assert "| attempts | 2 |" in summary and "| verify | OK" in summary


def test_bad_input_fails_once_and_its_message_reaches_the_flow_run(synth_dir, tmp_path, memory_limit):
    memory_limit(8)
    source = synth_dir(name="broken")
    os.remove(source / "config.json")
    state = convert_model(source=str(source), destination=str(tmp_path / "never"), devices=4, return_state=True)
    assert state.is_failed()
    assert "BadInput" in state.message and "config.json: missing" in state.message
    runs = task_runs(state.state_details.flow_run_id)
    assert runs["plan-never"].run_count == 1 and "convert-never" not in runs

    @flow
    def convert_directly() -> dict:  # the conversion task on its own: exit 2 is final too
        return convert_checkpoint(Conversion(str(source), str(tmp_path / "never"), devices=4), GIB)

    state = convert_directly(return_state=True)
    assert state.is_failed() and "exit 2" in state.message and "config.json: missing" in state.message
    assert task_runs(state.state_details.flow_run_id)["convert-never"].run_count == 1


def test_zoo_packs_by_memory_and_reports_the_broken_model(synth_dir, tmp_path, memory_limit):
    memory_limit(1)  # each tiny model is predicted at ~0.7 GiB -> 1 GB: the two good ones must take turns
    models = []
    for name in ("zoo-a", "zoo-b", "zoo-broken"):
        source = synth_dir(name=f"src-{name}")
        models.append({"name": name, "source": str(source), "destination": str(tmp_path / "out" / name)})
    os.remove(tmp_path / "src-zoo-broken" / "config.json")
    manifest = tmp_path / "zoo.yaml"
    manifest.write_text(yaml.safe_dump({"name": "test-zoo", "defaults": {"devices": 4, "pool": "cpu-pool"},
                                        "models": models}))

    state = convert_zoo(manifest=str(manifest), return_state=True)
    assert state.is_failed()
    assert state.message.startswith("1 of 3 models failed") and "zoo-broken: BadInput" in state.message

    rows = {row["model"]: row for row in _table("zoo-test-zoo-rows")}
    assert [rows[m]["status"] for m in ("zoo-a", "zoo-b", "zoo-broken")] == ["complete", "complete", "failed"]
    assert "config.json: missing" in rows["zoo-broken"]["error"] and rows["zoo-broken"]["retries"] == 0
    for name in ("zoo-a", "zoo-b"):
        row = rows[name]
        assert row["error"] is None and row["retries"] == 0 and row["held_gb"] == 1
        assert row["wall_seconds"] > 0 and 50 < row["peak_rss_mib"] < 2048 and row["output_mib"] == 0.2
        assert "| verify | OK" in latest_artifact(f"conversion-{name}").data
    page = latest_artifact("zoo-test-zoo")
    assert page.type == "markdown" and "## Zoo `test-zoo`: 2 of 3 models ok" in page.data
    assert re.search(r"^\| zoo-broken \| \*\*failed\*\* \| .*config\.json: missing", page.data, re.M)
    for name in ("zoo-a", "zoo-b"):
        assert f"| [{name}]({ui_url() or ''}/artifacts/artifact/{rows[name]['artifact_id']}) | complete |" in page.data
    windows = [(dt.datetime.fromisoformat(r["admitted_at"]), dt.datetime.fromisoformat(r["released_at"]), r["held_gb"])
               for r in rows.values() if r["held_gb"]]
    assert _max_concurrent_gb(windows) <= 1


def _max_concurrent_gb(windows: list[tuple[dt.datetime, dt.datetime, int]]) -> int:
    """Largest sum of GB held at any instant (a release at t happens before an admission at t)."""
    events = sorted([(start, 1, gb) for start, _, gb in windows] + [(end, 0, -gb) for _, end, gb in windows])
    held = peak = 0
    for _, _, change in events:
        held += change
        peak = max(peak, held)
    return peak



CANARY = "hf_CANARYflow0123456789abcdef"


@pytest.mark.parametrize("token, endpoint, reason", [
    (CANARY + "\nsecond line", None, "one line of printable ASCII"),  # malformed: refused before use
    (CANARY, "http://127.0.0.1:1", "cannot reach http://127.0.0.1:1"),  # the hub unreachable (and not cached): one line
])
def test_a_token_never_reaches_a_flow_runs_state_logs_or_artifacts(tmp_path, memory_limit, monkeypatch, token,
                                                                    endpoint, reason):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, LogFilter, LogFilterFlowRunId

    memory_limit(8)
    # as a worker's job variables hand them to the flow run (the environment is the interface under test), for
    # the synchronous flow call below; no thread that outlives it reads HF_* or CKPTCONV_*
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("CKPTCONV_REMOTE_DEADLINE", "3")
    if endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
    state = convert_model(source="hf://org/model", destination=str(tmp_path / "dst"), devices=1,
                          name="canary", return_state=True)
    assert state.is_failed() and state.message
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter())
        task_states = [run.state.message or "" for run in task_runs(run_id).values()]
    seen = "\n".join([state.message, *task_states, *(log.message for log in logs),
                      *(json.dumps(a.data, default=str) + (a.description or "") for a in artifacts)])
    assert reason in state.message and len(logs) > 0  # the failure itself is reported...
    assert "CANARY" not in seen  # ...and no part of the token is
