"""The zoo never waits forever, ships its schedule switched off, and reads its manifest from gs:// too.

A dispatched model whose pool has no worker (or is paused) fails on its own after its start wait,
its flow run cancelled; a queue behind a live worker does not count. Against the session's Prefect
test server (no workers at all) and the real fake-gcs-server; the same with real process workers
is ``test_prefect_e2e.py::test_a_zoo_entry_no_worker_takes_never_starts_and_the_rest_goes_on``.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from flows.run_waits import never_started_reason
from flows.zoo import Entry, ManifestError, convert_zoo, load_manifest, never_started_row
from tasks.job import Conversion
from tests.prefect_fixtures import latest_artifact

ROOT = Path(__file__).resolve().parent.parent


def test_every_shipped_schedule_is_inactive():
    """``prefect deploy --all`` must not start converting into the example buckets every night."""
    config = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
    schedules = [(d["name"], s) for d in config["deployments"] for s in d.get("schedules") or []]
    assert schedules, "prefect.yaml ships no schedule at all"
    assert [name for name, s in schedules if s.get("active") is not False] == []


def test_manifest_is_read_from_gcs(gcs, tmp_path):
    local = ROOT / "deploy" / "zoo.yaml"
    uri = f"gs://{gcs.new_bucket('zoo')}/manifests/zoo.yaml"
    bucket, _, name = uri[len("gs://"):].partition("/")
    gcs.client().bucket(bucket).blob(name).upload_from_filename(str(local))
    assert load_manifest(uri) == load_manifest(str(local))


def test_a_missing_or_unreadable_manifest_is_one_line_naming_it(gcs, tmp_path):
    bucket = gcs.new_bucket("zoo")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    cases = {
        f"gs://{bucket}/nowhere/zoo.yaml": "zoo manifest not found",
        f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/zoo.yaml": "zoo manifest not found",
        str(tmp_path / "missing.yaml"): "zoo manifest not found",
        str(tmp_path): "cannot read the zoo manifest",  # a directory
        str(bad): "not valid YAML",
    }
    for path, expected in cases.items():
        with pytest.raises(ManifestError) as caught:
            load_manifest(path)
        assert str(caught.value).startswith(f"{path}: {expected}") and "\n" not in str(caught.value), caught.value


def test_a_zoo_with_a_missing_manifest_fails_in_one_line(prefect_server, tmp_path):
    path = str(tmp_path / "missing.yaml")
    state = convert_zoo(manifest=path, return_state=True)
    assert state.is_failed() and state.message == f"{path}: zoo manifest not found"


def test_start_wait_must_be_a_positive_number(tmp_path):
    path = tmp_path / "zoo.yaml"
    path.write_text("models:\n  - {name: a, source: s, destination: d, start_wait_seconds: soon}\n")
    with pytest.raises(ManifestError, match=r"models\[0\] \(a\): start_wait_seconds must be a positive number"):
        load_manifest(str(path))


def test_never_started_lines_name_the_pool_the_wait_and_the_fix():
    from prefect.client.schemas.objects import WorkPoolStatus

    assert never_started_reason("tpu-pool", WorkPoolStatus.NOT_READY, 1800) == (
        "never started: no worker picked it up on pool 'tpu-pool' within 30 min; "
        "start one with: prefect worker start --pool tpu-pool")
    assert never_started_reason("tpu-pool", WorkPoolStatus.PAUSED, 90).endswith(
        "within 1.5 min; resume it with: prefect work-pool resume tpu-pool")
    assert "work pool 'gone' does not exist" in never_started_reason("gone", None, 5)


def test_a_model_killed_on_its_pool_that_no_worker_takes_on_its_retry_pool_says_both():
    entry = Entry(Conversion("s", "d", name="big"), "cpu-pool", "highmem-pool")
    row = never_started_row(entry, "highmem-pool", "never started: no worker ...", ["cpu-pool: ChildKilled: SIGKILL"])
    assert (row["status"], row["pool"], row["pools_tried"]) == ("never started", "highmem-pool",
                                                                ["cpu-pool", "highmem-pool"])
    assert row["error"] == "cpu-pool: ChildKilled: SIGKILL; then highmem-pool: never started: no worker ..."


def _pool_with_deployment(paused: bool = False) -> tuple[str, str]:
    """A fresh process work pool that no worker polls, with a ``convert-model`` deployment on it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    pool = f"nobody-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process", is_paused=paused))
        flow_id = client.create_flow_from_name("convert-model")
        client.create_deployment(flow_id=flow_id, name=f"on-{pool}", work_pool_name=pool,
                                 entrypoint="flows/model.py:convert_model")
    return pool, f"convert-model/on-{pool}"


def _zoo(tmp_path: Path, name: str, pool: str, deployment: str, **defaults) -> str:
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump({
        "name": name, "deployments": {pool: deployment}, "defaults": {"pool": pool, **defaults},
        "models": [{"name": f"{name}-a", "source": str(tmp_path / "src"), "destination": str(tmp_path / "a")}]}))
    return str(manifest)


def _flow_run_state(name: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    assert len(runs) == 1, runs
    return runs[0].state


def _rows(key: str) -> dict[str, dict]:
    import json

    data = latest_artifact(key).data
    return {row["model"]: row for row in (json.loads(data) if isinstance(data, str) else data)}


@pytest.mark.timeout(300)
def test_a_model_whose_pool_has_no_worker_never_starts_and_its_run_is_cancelled(prefect_server, tmp_path):
    pool, deployment = _pool_with_deployment()
    manifest = _zoo(tmp_path, "lonely", pool, deployment, start_wait_seconds=2)
    state = convert_zoo(manifest=manifest, return_state=True)

    line = (f"never started: no worker picked it up on pool '{pool}' within 2 s; "
            f"start one with: prefect worker start --pool {pool}")
    assert state.is_failed()
    assert "1 of 1 models never started" in state.message and f"lonely-a (pool '{pool}')" in state.message
    row = _rows("zoo-lonely-rows")["lonely-a"]
    assert (row["status"], row["error"], row["pool"], row["worker"]) == ("never started", line, pool, None)
    run_state = _flow_run_state(f"lonely-a-on-{pool}")  # cancelled: a worker arriving later will not run it
    assert run_state.type.value == "CANCELLED" and run_state.message == line


@pytest.mark.timeout(300)
def test_the_start_wait_runs_only_while_no_worker_can_take_the_run(prefect_server, tmp_path):
    """A worker online (busy, say) keeps the clock still; once the pool is paused it runs and says so."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    pool, deployment = _pool_with_deployment()
    with get_client(sync_client=True) as client:
        client.send_worker_heartbeat(pool, "busy-worker", heartbeat_interval_seconds=60)  # online, takes nothing
    online = 8.0

    def pause() -> None:
        with get_client(sync_client=True) as client:
            client.update_work_pool(pool, WorkPoolUpdate(is_paused=True))

    timer = threading.Timer(online, pause)
    started = time.monotonic()
    timer.start()
    try:
        state = convert_zoo(manifest=_zoo(tmp_path, "queued", pool, deployment), start_wait_seconds=2,
                            return_state=True)
    finally:
        timer.cancel()
    assert time.monotonic() - started >= online  # not given up while a worker was online
    row = _rows("zoo-queued-rows")["queued-a"]
    assert state.is_failed() and row["status"] == "never started"
    assert row["error"] == (f"never started: pool '{pool}' is paused and no worker picked it up within 2 s; "
                            f"resume it with: prefect work-pool resume {pool}")


@pytest.mark.timeout(300)
def test_a_started_run_whose_worker_vanished_is_cancelled_after_the_run_wait(prefect_server, tmp_path):
    """A worker takes the run and is lost with it (the run stays Running on the server): the zoo
    gives up after its run wait, cancels the run and fails that model, instead of waiting forever."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Running

    pool, deployment = _pool_with_deployment()
    name = f"lost-a-on-{pool}"

    def take_and_vanish() -> None:
        with get_client(sync_client=True) as client:
            while not (runs := client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))):
                time.sleep(0.2)
            client.set_flow_run_state(runs[0].id, Running(), force=True)

    worker = threading.Thread(target=take_and_vanish, daemon=True)
    worker.start()
    state = convert_zoo(manifest=_zoo(tmp_path, "lost", pool, deployment, start_wait_seconds=600), run_wait_seconds=3,
                        return_state=True)
    worker.join(timeout=10)
    row = _rows("zoo-lost-rows")["lost-a"]
    assert state.is_failed() and row["status"] == "failed"
    assert f"{pool}: no result 3 s after a worker of pool '{pool}' started it" in row["error"], row["error"]
    assert _flow_run_state(name).type.value == "CANCELLING"  # a live worker would now stop it


def _partition_pool() -> tuple[str, str]:
    """A fresh process work pool that no worker polls, with a ``convert-partition`` deployment on it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    pool = f"nobody-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        flow_id = client.create_flow_from_name("convert-partition")
        client.create_deployment(flow_id=flow_id, name=f"on-{pool}", work_pool_name=pool,
                                 entrypoint="flows/partitioned.py:convert_partition")
    return pool, f"convert-partition/on-{pool}"


@pytest.mark.timeout(300)
def test_a_partitioned_conversion_whose_pool_has_no_worker_fails_in_one_line(prefect_server, synth_dir, tmp_path):
    """The partitioned flow waits for its partitions as the zoo waits for its models: never for ever."""
    from flows.partitioned import convert_partitioned

    pool, deployment = _partition_pool()
    state = convert_partitioned(source=str(synth_dir()), destination=str(tmp_path / "dst"), partitions=2, devices=1,
                                deployment=deployment, start_wait_seconds=2, return_state=True)
    assert state.is_failed()
    line = (f"never started: no worker picked it up on pool '{pool}' within 2 s; "
            f"start one with: prefect worker start --pool {pool}")
    assert "2 of 2 partitions failed" in state.message and line in state.message, state.message
    assert not (tmp_path / "dst" / "ckptconv-report.json").exists()
