"""The restore check in the flows, against the real test Prefect server: after the conversion, beside its page.

CI has no accelerator: ``restore_check_cpu_devices`` puts the same child on CPU devices. The held-accelerator
case uses the fake PJRT plugin of tests/test_accelerator.py, with JAX left to choose, as on a TPU worker.
"""

from __future__ import annotations

import json
import os

import pytest
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.model import convert_model
from flows.zoo import convert_zoo
from tasks import Conversion, restore_check
from tasks.failures import AcceleratorBusy
from tests.conftest import ROOT, run_cli
from tests.prefect_fixtures import latest_artifact

pytestmark = pytest.mark.usefixtures("prefect_server")
FAKE = ROOT / "tests" / "data" / "fake_accelerator"


def _table(key: str) -> list[dict]:
    data = latest_artifact(key).data
    return json.loads(data) if isinstance(data, str) else data


@pytest.fixture
def accelerator_limit(monkeypatch):
    """A fresh accelerator limit per test (the host's name would be shared by every test on this machine)."""
    name = f"ckptconv-accelerator-test-{os.urandom(4).hex()}"
    monkeypatch.setenv("CKPTCONV_ACCELERATOR_LIMIT", name)
    return name


def test_convert_model_restores_onto_the_devices_and_publishes_beside_the_conversion(
        synth_dir, tmp_path, memory_limit, accelerator_limit):
    memory_limit(8)
    source, destination = synth_dir(), tmp_path / "on-devices"
    row = convert_model(source=str(source), destination=str(destination), devices=16, restore_check=True,
                        restore_check_cpu_devices=4)
    assert (row["status"], row["restore_check"], row["restore_check_platform"]) == ("complete", "ok", "4 cpu")
    assert row["restore_check_seconds"] > 0 and row["restore_check_gib_per_s"] > 0
    checked = _table("conversion-on-devices-restore-check")[0]
    assert checked["ok"] is True and (checked["platform"], checked["devices"], checked["leaves"]) == ("cpu", 4, 14)
    assert checked["restore_seconds"] > 0 and checked["peak_rss_bytes"] > 0
    page = latest_artifact("conversion-on-devices").data
    assert "On the accelerator: OK: 14 leaves" in page and "onto 4 cpu device(s)" in page
    assert "| restore check | OK: 14 leaves" in page

    again = convert_model(source=str(source), destination=str(destination), devices=16, restore_check=True,
                          restore_check_cpu_devices=4)
    assert (again["status"], again["restore_check"]) == ("skipped", None)  # unchanged: not rerun, as verify


def test_a_zoo_entry_records_the_restore_check(synth_dir, tmp_path, memory_limit, accelerator_limit):
    memory_limit(8)
    source = synth_dir()
    manifest = tmp_path / "zoo.yaml"
    manifest.write_text(
        f"name: tpu-zoo\nmodels:\n"
        f"  - {{name: checked, source: {source}, destination: {tmp_path / 'checked'}, devices: 4, "
        f"restore_check: true, restore_check_cpu_devices: 2}}\n"
        f"  - {{name: unchecked, source: {source}, destination: {tmp_path / 'unchecked'}, devices: 4}}\n")
    state = convert_zoo(manifest=str(manifest), return_state=True)
    assert state.is_completed(), state.message
    rows = {row["model"]: row for row in _table("zoo-tpu-zoo-rows")}
    assert (rows["checked"]["restore_check"], rows["checked"]["restore_check_platform"]) == ("ok", "2 cpu")
    assert rows["unchecked"]["restore_check"] is None
    assert "restored onto 2 cpu in" in latest_artifact("zoo-tpu-zoo").data


def test_restore_checks_on_one_host_take_the_accelerator_in_turn(synth_dir, tmp_path, accelerator_limit):
    """Only one program may hold a TPU host's chips: two checks on one worker hold its one-slot limit in turn."""
    source, destination = synth_dir(), tmp_path / "twice"
    assert run_cli("convert", str(source), str(destination), "--devices", "4", "--progress", "none").returncode == 0
    job = Conversion(str(source), str(destination), devices=4, restore_check=True, restore_check_cpu_devices=4)

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def both() -> list[dict]:
        return [future.result() for future in [restore_check.submit(job), restore_check.submit(job)]]

    first, second = sorted((r["admission"] for r in both()), key=lambda a: a["admitted_at"])
    assert first["limit"] == second["limit"] == accelerator_limit and first["limit_gb"] == 1
    assert first["released_at"] <= second["admitted_at"]


def test_a_held_accelerator_is_retried_and_never_called_damage(synth_dir, tmp_path, monkeypatch, accelerator_limit):
    source, destination = synth_dir(), tmp_path / "held"
    assert run_cli("convert", str(source), str(destination), "--devices", "4", "--progress", "none").returncode == 0
    log = tmp_path / "opened"
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # as on a TPU worker: JAX chooses, and chooses the plugin
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE), str(ROOT)]))
    monkeypatch.setenv("CKPTCONV_FAKE_ACCELERATOR_LOG", str(log))
    task = restore_check.with_options(retries=1, retry_delay_seconds=0)
    state = task(Conversion(str(source), str(destination), devices=4, restore_check=True), return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, AcceleratorBusy), error
    assert "held by another program" in str(error) and "damaged" not in str(error)
    assert len(log.read_text().split()) == 2  # the first attempt and its retry each tried to open it


def test_the_shipped_tpu_deployment_and_zoo_entry_ask_for_the_restore_check():
    import inspect

    import yaml

    from flows.zoo import load_manifest

    deployments = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())["deployments"]
    tpu = next(d for d in deployments if d["name"] == "convert-model-tpu")
    assert tpu["parameters"] == {"restore_check": True} and tpu["work_pool"]["name"] == "tpu-pool"
    assert "restore_check" in inspect.signature(convert_model.fn).parameters
    checked = [e.job for e in load_manifest(str(ROOT / "deploy" / "zoo.yaml")).entries if e.job.restore_check]
    assert [job.slug for job in checked] == ["llama-3-1-8b"]  # a zoo sends every entry's own value
