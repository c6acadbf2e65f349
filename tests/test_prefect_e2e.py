"""End to end as a user deploys it: a real Prefect server, process work pools, deploy/prefect.yaml
deployed from this checkout, process workers, and the artifacts read back over the server's API.

One server and one ``prefect deploy`` serve the module: a single conversion on a worker, then a
zoo spread over two workers of two pools, with a model killed on the first and retried on the second."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import run_cli
from tests.held import hold_at, wait_held
from tests.prefect_fixtures import stop_server

# One client for the module's API calls and polls: ``httpx.get`` makes a client per call, and each loads the
# system's CA certificates into a new SSL context (plain http:// too): 19 CPU-seconds of this module's polling,
# sampled over a `make test` run, were that.
HTTP = httpx.Client()

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prefect(*args: str, env: dict, timeout: float = 120) -> str:
    done = subprocess.run([sys.executable, "-m", "prefect", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A real ``prefect server start`` on a free port (its own PREFECT_HOME); stopped by PID."""
    tmp_path = tmp_path_factory.mktemp("prefect-server")
    for attempt in range(3):  # the free port can be taken between probing and binding: then another one
        server, env = _start_server(tmp_path, _free_port(), tmp_path / f"server-{attempt}.log")
        if server.returncode is None:
            break
    else:
        pytest.fail(f"prefect server did not start: {(tmp_path / 'server-2.log').read_text()[-3000:]}")
    try:
        yield env
    finally:
        stop_server(server)


def _start_server(tmp_path: Path, port: int, log_path: Path) -> tuple[subprocess.Popen, dict]:
    """Start the server and wait until /api/health answers (it is running) or it exits (returncode set)."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300  # ~4 s on an idle machine: this only bounds a busy one
    while server.poll() is None:
        try:
            if HTTP.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            server.wait()
            pytest.fail(f"prefect server did not answer /api/health: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return server, env


POOLS = ("cpu-pool", "tpu-pool", "highmem-pool")


@pytest.fixture(scope="module")
def deployed(prefect_api):
    """The three process pools and every deployment of the shipped prefect.yaml, deployed from this checkout."""
    env = {**prefect_api, "CKPTCONV_MEMORY_LIMIT": f"ckptconv-memory-gb-e2e-{uuid.uuid4().hex[:6]}",
           "CKPTCONV_MEMORY_GB": "8", "PREFECT_WORKER_QUERY_SECONDS": "1"}
    pools = [subprocess.Popen([sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", "process"],
                              env=env, cwd=ROOT, stdout=subprocess.DEVNULL) for pool in POOLS]
    assert [p.wait(timeout=120) for p in pools] == [0] * len(POOLS)
    _prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deploy/prefect.yaml", env=env)
    return env


@pytest.mark.slow
def test_deployed_convert_model_runs_on_a_process_worker(deployed, synth_dir, tmp_path):
    env = deployed
    api = env["PREFECT_API_URL"]
    names = ("convert-model/convert-model-cpu", "convert-model/convert-model-tpu", "convert-model/convert-model-highmem",
             "convert-zoo/nightly-zoo")
    deployments = {name: HTTP.get(f"{api}/deployments/name/{name}", timeout=10).json() for name in names}
    assert [d["work_pool_name"] for d in deployments.values()] == ["cpu-pool", "tpu-pool", "highmem-pool", "cpu-pool"]
    # no pull step in prefect.yaml: Prefect records the checkout it was deployed from
    assert all(d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
               for d in deployments.values())
    assert deployments["convert-model/convert-model-cpu"]["job_variables"]["env"]["MALLOC_ARENA_MAX"] == "2"
    schedule = deployments["convert-zoo/nightly-zoo"]["schedules"][0]["schedule"]
    assert (schedule["cron"], schedule["timezone"]) == ("0 2 * * *", "Europe/Zurich")
    assert deployments["convert-zoo/nightly-zoo"]["schedules"][0]["active"] is False  # switched on by hand

    source, destination = synth_dir(), tmp_path / "e2e-out"
    started = _prefect("deployment", "run", "convert-model/convert-model-cpu", "--param", f"source={source}",
                       "--param", f"destination={destination}", "--param", "devices=4", "--param", "name=e2e-tiny", env=env)
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started).group(1)
    _prefect("worker", "start", "--pool", "cpu-pool", "--run-once", env=env, timeout=300)

    flow_run = HTTP.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()
    assert flow_run["state"]["type"] == "COMPLETED", flow_run["state"]
    verified = run_cli("verify", str(source), str(destination), "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"]

    keys = [f"conversion-e2e-tiny{suffix}" for suffix in ("", "-row", "-progress")]
    found = HTTP.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": keys}}}, timeout=10).json()
    artifacts = {a["key"]: a for a in found if a["flow_run_id"] == flow_run_id}
    assert set(artifacts) == set(keys)
    page = artifacts["conversion-e2e-tiny"]["data"]
    for stage in ("plan", "read", "transform", "write", "commit", "**wall time**"):
        assert f"| {stage} | " in page, stage
    assert "](data:image/svg+xml;base64," in page and "| verify | OK" in page
    row = artifacts["conversion-e2e-tiny-row"]["data"]
    row = (json.loads(row) if isinstance(row, str) else row)[0]
    assert row["artifact_id"] == artifacts["conversion-e2e-tiny"]["id"] and row["peak_rss_mib"] > 50
    assert artifacts["conversion-e2e-tiny-progress"]["data"] == 100
    shutil.rmtree(destination)


@contextlib.contextmanager
def _workers(env: dict, tmp_path: Path, specs: dict[str, tuple[str, dict]], *extra: str):
    """Process workers named ``name`` on ``pool`` with extra env (and ``extra`` flags), for the block."""
    procs = {}
    try:
        for name, (pool, more) in specs.items():
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--name", name,
                     "--type", "process", *extra], env={**env, "CKPTCONV_WORKER": name, **more}, cwd=ROOT,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_online(env["PREFECT_API_URL"], specs, procs, tmp_path)
        yield procs
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_online(api: str, specs: dict[str, tuple[str, dict]], procs: dict, tmp_path: Path,
                 cap_seconds: float = 300) -> None:
    """Until the server lists every worker as online in its pool: a test that spreads runs over workers
    must not start while one is still importing Prefect (on a busy machine that takes a while)."""
    deadline = time.monotonic() + cap_seconds
    waiting = set(specs)
    while waiting:
        for name in sorted(waiting):
            pool = specs[name][0]
            if procs[name].poll() is not None:
                raise AssertionError(f"worker {name} exited: {(tmp_path / f'{name}.log').read_text()[-2000:]}")
            found = HTTP.post(f"{api}/work_pools/{pool}/workers/filter", json={}, timeout=30).json()
            if any(w.get("name") == name and w.get("status") == "ONLINE" for w in found):
                waiting.discard(name)
        if waiting and time.monotonic() > deadline:
            raise AssertionError(f"workers {sorted(waiting)} not online after {cap_seconds} s")
        if waiting:
            time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.fault
def test_zoo_runs_each_model_on_its_pool_and_retries_a_kill_on_the_bigger_one(deployed, synth_dir, tmp_path):
    """Three models, two workers on two pools; ``zoo-oom`` is SIGKILLed on worker-a (as the OOM
    killer would) and the zoo starts it again on highmem-pool, where worker-b completes it."""
    env = deployed
    models = [{"name": name, "source": str(synth_dir(name=f"src-{name}")), "destination": str(tmp_path / name),
               "pool": pool, **extra} for name, pool, extra in (
        ("zoo-a", "cpu-pool", {}), ("zoo-b", "highmem-pool", {}),
        ("zoo-oom", "cpu-pool", {"retry_pool": "highmem-pool"}))]
    manifest = tmp_path / "zoo.yaml"
    manifest.write_text(yaml.safe_dump({
        "name": "pool-zoo", "defaults": {"devices": 4},
        "deployments": {"cpu-pool": "convert-model/convert-model-cpu",
                        "highmem-pool": "convert-model/convert-model-highmem"},
        "models": models}))
    specs = {"worker-a": ("cpu-pool", {"CKPTCONV_TEST_KILL_MODEL": "zoo-oom"}), "worker-b": ("highmem-pool", {})}
    with _workers(env, tmp_path, specs):
        zoo = subprocess.run([sys.executable, "-c", "import sys; from flows.zoo import convert_zoo; "
                              "state = convert_zoo(manifest=sys.argv[1], return_state=True); "
                              "sys.exit(0 if state.is_completed() else 1)", str(manifest)],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert zoo.returncode == 0, zoo.stdout[-3000:] + zoo.stderr[-3000:]

    api = env["PREFECT_API_URL"]
    found = HTTP.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["zoo-pool-zoo-rows"]}},
                                                        "sort": "CREATED_DESC", "limit": 1}, timeout=10).json()
    rows = found[0]["data"]
    rows = {row["model"]: row for row in (json.loads(rows) if isinstance(rows, str) else rows)}
    where = {name: (row["status"], row["pool"], row["worker"]) for name, row in rows.items()}
    assert where == {"zoo-a": ("complete", "cpu-pool", "worker-a"), "zoo-b": ("complete", "highmem-pool", "worker-b"),
                     "zoo-oom": ("complete", "highmem-pool", "worker-b")}
    assert rows["zoo-oom"]["pools_tried"] == ["cpu-pool", "highmem-pool"]
    runs = HTTP.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [
        "zoo-oom-on-cpu-pool", "zoo-oom-on-highmem-pool"]}}}, timeout=10).json()
    states = {run["name"]: (run["state"]["type"], run["state"]["message"] or "") for run in runs}
    assert states["zoo-oom-on-highmem-pool"][0] == "COMPLETED"
    assert states["zoo-oom-on-cpu-pool"][0] == "FAILED" and "SIGKILL" in states["zoo-oom-on-cpu-pool"][1]
    # each convert-model run verified its checkpoint bit for bit (a mismatch fails the run, and the zoo)
    assert all(rows[m["name"]]["status"] == "complete" for m in models)


@pytest.mark.slow
@pytest.mark.timeout(600)  # today's failure mode is a hang: bounded here and by the zoo's own subprocess timeout
def test_a_zoo_entry_no_worker_takes_never_starts_and_the_rest_goes_on(deployed, synth_dir, tmp_path):
    """Two models: one on cpu-pool, where a worker runs it, one on tpu-pool, where no worker is. The
    second fails after its start wait with one line naming the pool and how to start a worker, its
    flow run is cancelled (a worker arriving later will not run it), and the zoo ends naming it."""
    env = deployed
    models = [{"name": "zoo-here", "source": str(synth_dir(name="src-here")), "destination": str(tmp_path / "here"),
               "pool": "cpu-pool"},
              {"name": "zoo-nowhere", "source": str(synth_dir(name="src-nowhere")),
               "destination": str(tmp_path / "nowhere"), "pool": "tpu-pool"}]
    manifest = tmp_path / "zoo.yaml"
    manifest.write_text(yaml.safe_dump({
        "name": "half-zoo", "defaults": {"devices": 4, "start_wait_seconds": 5},
        "deployments": {"cpu-pool": "convert-model/convert-model-cpu", "tpu-pool": "convert-model/convert-model-tpu"},
        "models": models}))
    with _workers(env, tmp_path, {"worker-h": ("cpu-pool", {})}):
        zoo = subprocess.run([sys.executable, "-c", "import sys; from flows.zoo import convert_zoo; "
                              "state = convert_zoo(manifest=sys.argv[1], return_state=True); "
                              "print(state.message); sys.exit(0 if state.is_completed() else 1)", str(manifest)],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert zoo.returncode == 1, zoo.stdout[-3000:] + zoo.stderr[-3000:]
    assert "1 of 2 models never started" in zoo.stdout and "zoo-nowhere (pool 'tpu-pool')" in zoo.stdout

    api = env["PREFECT_API_URL"]
    found = HTTP.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["zoo-half-zoo-rows"]}},
                                                        "sort": "CREATED_DESC", "limit": 1}, timeout=10).json()
    rows = found[0]["data"]
    rows = {row["model"]: row for row in (json.loads(rows) if isinstance(rows, str) else rows)}
    line = ("never started: no worker picked it up on pool 'tpu-pool' within 5 s; "
            "start one with: prefect worker start --pool tpu-pool")
    assert (rows["zoo-here"]["status"], rows["zoo-here"]["worker"]) == ("complete", "worker-h")
    assert (rows["zoo-nowhere"]["status"], rows["zoo-nowhere"]["error"]) == ("never started", line)
    runs = HTTP.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": ["zoo-nowhere-on-tpu-pool"]}}},
                      timeout=10).json()
    assert [(run["state"]["type"], run["state"]["message"]) for run in runs] == [("CANCELLED", line)]
    assert run_cli("verify", models[0]["source"], models[0]["destination"]).returncode == 0
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.slow
def test_partitioned_conversion_over_two_workers_equals_a_single_one(deployed, synth_dir, tmp_path):
    """``convert-partitioned`` starts 2 ``convert-partition`` flow runs; two workers of one pool write one
    partition each; the finalize commits one checkpoint."""
    from tests.test_convert import restore
    from tests.test_partition import MOE

    env = deployed
    source, single, split = synth_dir(MOE), tmp_path / "single", tmp_path / "split"
    assert run_cli("convert", str(source), str(single), "--devices", "4", "--progress", "none").returncode == 0
    script = ("import json, sys; from flows.partitioned import convert_partitioned; "
              "r = convert_partitioned(source=sys.argv[1], destination=sys.argv[2], partitions=2, devices=4, "
              "name='split'); print(json.dumps(r['partitions']))")
    done = _one_partition_per_worker(env, tmp_path, [script, str(source), str(split)], "split",
                                     {"worker-a": {}, "worker-b": {}})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(row["partition"] for row in rows) == ["0/2", "1/2"]
    assert sorted(row["worker"] for row in rows) == ["worker-a", "worker-b"]
    expected, got = restore(single), restore(split)
    assert got.keys() == expected.keys()
    assert all(got[name].tobytes() == value.tobytes() for name, value in expected.items())
    report = json.loads((split / "ckptconv-report.json").read_text())
    assert [p["partition"] for p in report["partitions"]] == ["0/2", "1/2"]  # the flow also verified it


@pytest.mark.slow
def test_partitioned_conversion_into_a_gcs_bucket_over_two_workers(deployed, gcs, synth_dir, tmp_path):
    """The same fan-out with the destination a gs:// prefix (fake-gcs-server): the partitions meet in the
    bucket, the finalize commits there, and the result equals a single conversion leaf for leaf."""
    from tests.test_convert import restore
    from tests.test_partition import MOE
    from tests.test_partition_gcs import _download

    env = {**deployed, **gcs.env}
    source, single = synth_dir(MOE), tmp_path / "single"
    split = f"gs://{gcs.new_bucket('zoo')}/models/split"
    assert run_cli("convert", str(source), str(single), "--devices", "4", "--progress", "none").returncode == 0
    script = ("import json, sys; from flows.partitioned import convert_partitioned; "
              "r = convert_partitioned(source=sys.argv[1], destination=sys.argv[2], partitions=2, devices=4, "
              "name='split-gcs'); print(json.dumps(r['partitions']))")
    done = _one_partition_per_worker(env, tmp_path, [script, str(source), split], "split-gcs",
                                     {"worker-a": gcs.env, "worker-b": gcs.env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(row["partition"] for row in rows) == ["0/2", "1/2"]
    assert sorted(row["worker"] for row in rows) == ["worker-a", "worker-b"]
    report = json.loads(gcs.read(f"{split}/ckptconv-report.json"))
    assert report["status"] == "complete" and [p["partition"] for p in report["partitions"]] == ["0/2", "1/2"]
    expected, got = restore(single), restore(_download(gcs, split, tmp_path / "downloaded"))
    assert got.keys() == expected.keys()
    assert all(got[name].tobytes() == value.tobytes() for name, value in expected.items())


def _one_partition_per_worker(env: dict, tmp_path: Path, script: list[str], slug: str,
                              workers: dict[str, dict]) -> subprocess.CompletedProcess:
    """Run ``python -c *script`` (a partitioned flow named ``slug``) and let each of ``workers`` (cpu-pool, extra env)
    take one of its partition runs; the flow process's result.

    A free worker takes any scheduled run, so two long-lived workers may share the partitions either way: in one CI
    run the server created the second partition's run 28 s after the first, which had finished by then, and the
    worker that ran the first took it too. Here each worker polls once (``--run-once --limit 1``: it takes the first
    scheduled run it sees and exits when that has ended) and the next starts only after the one before has taken its
    run, so worker n runs partition n's flow run whatever the server's timing."""
    api = env["PREFECT_API_URL"]

    def states() -> list[str]:
        found = _answer(lambda: HTTP.post(f"{api}/flow_runs/filter", timeout=10, json={
            "flow_runs": {"name": {"like_": f"{slug}-partition"}}}))
        return [(run["state"] or {}).get("type") for run in found]

    out, err = (open(tmp_path / f"{slug}-flow.{name}", "w+") for name in ("out", "err"))
    flow = subprocess.Popen([sys.executable, "-c", *script], env=env, cwd=ROOT, stdout=out, stderr=err, text=True)
    procs = []
    try:
        _wait_for("both partition runs", lambda: states().count("SCHEDULED") == len(workers) or flow.poll() is not None,
                  timeout=300)
        for taken, (name, more) in enumerate(workers.items()):
            if flow.poll() is not None:
                break
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "prefect", "worker", "start", "--pool", "cpu-pool", "--name", name,
                     "--type", "process", "--run-once", "--limit", "1"], env={**env, "CKPTCONV_WORKER": name, **more},
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            _wait_for(f"{name} to take a partition run",
                      lambda: sum(state != "SCHEDULED" for state in states()) > taken or flow.poll() is not None,
                      timeout=300)
        flow.wait(timeout=600)
        for proc in procs:
            proc.wait(timeout=120)
    finally:
        if flow.poll() is None:
            flow.kill()
        for proc in procs:  # a worker and the flow-run processes it started: one process group
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        flow.wait()
    with out, err:
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(flow.args, flow.returncode, out.read(), err.read())


def _start_run(api: str, destination: Path, source: Path, name: str, env: dict | None = None) -> str:
    """A flow run of the convert-model-cpu deployment, as the UI's "Run" makes it (``env``: more environment
    for this run's process, a job variable); returns its id."""
    deployment = _answer(lambda: HTTP.get(f"{api}/deployments/name/convert-model/convert-model-cpu", timeout=10))
    run = _answer(lambda: HTTP.post(f"{api}/deployments/{deployment['id']}/create_flow_run", timeout=10, json={
        "parameters": {"source": str(source), "destination": str(destination), "devices": 4, "name": name},
        **({"job_variables": {"env": env}} if env else {}),
        "idempotency_key": f"{destination}:{name}"}))  # a retried create cannot make a second run
    return run["id"]


def _answer(request, attempts: int = 5) -> dict:
    """The JSON of a successful API call. A server under the suite's load can answer an error once
    (a busy SQLite, a timeout): retried a few times, as Prefect's own client does; then the body is shown."""
    for attempt in range(attempts):
        try:
            response = request()
        except httpx.TransportError as error:
            failure = repr(error)
        else:
            if response.is_success:
                return response.json()
            failure = f"{response.status_code}: {response.text[:500]}"
        time.sleep(1 + attempt)
    raise AssertionError(f"the Prefect API kept failing: {failure}")


def _state(api: str, run_id: str) -> dict:
    return _answer(lambda: HTTP.get(f"{api}/flow_runs/{run_id}", timeout=10))["state"] or {}


def _wait_for(what: str, check, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def _conversions(destination: Path) -> list[int]:
    """PIDs of live ``python -m ckptconv convert ... DESTINATION`` processes."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ckptconv" in argv and b"convert" in argv and str(destination).encode() in argv:
            pids.append(int(entry))
    return pids


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
@pytest.mark.fault
def test_a_cancelled_flow_run_leaves_no_conversion_behind_and_the_next_run_finishes(deployed, synth_dir, tmp_path):
    """Cancel through the API while the conversion writes: the worker ends the flow run, the conversion
    process ends with it (no orphan keeps writing), nothing reads as complete, and a new run completes."""
    env, api = deployed, deployed["PREFECT_API_URL"]
    source, target = synth_dir(), tmp_path / "cancelled"  # any size: it holds itself mid-run
    with _workers(env, tmp_path, {"worker-c": ("cpu-pool", {})}):
        # held at its first written tile (tests.held): found by a poll and only then stopped, a quick run was
        # sometimes done (or gone) first
        run_id = _start_run(api, target, source, "cancel-me", env=hold_at("progress"))
        child = _wait_for("the conversion to start", lambda: _conversions(target))[0]
        wait_held(child)
        HTTP.post(f"{api}/flow_runs/{run_id}/set_state", timeout=10,
                   json={"state": {"type": "CANCELLING"}, "force": True}).raise_for_status()
        _wait_for("the flow run to be cancelled", lambda: _state(api, run_id).get("type") == "CANCELLED")
        with contextlib.suppress(ProcessLookupError):  # gone already if the worker killed its process group
            os.kill(child, signal.SIGCONT)
        _wait_for("the conversion to end with its flow run", lambda: not _conversions(target), timeout=60)
        assert run_cli("inspect", str(target)).returncode != 0  # incomplete, visibly
        again = _start_run(api, target, source, "cancel-me-again")
        _wait_for("the next run to finish", lambda: _state(api, again).get("type") in ("COMPLETED", "FAILED", "CRASHED"))
    assert _state(api, again)["type"] == "COMPLETED", _state(api, again)
    assert run_cli("verify", str(source), str(target)).returncode == 0


@pytest.mark.slow
@pytest.mark.fault
def test_a_worker_lost_mid_run_leaves_a_destination_the_next_runs_finish(deployed, synth_dir, tmp_path):
    """SIGKILL the worker, its flow-run process and the conversion at once (the VM is gone). Then two
    runs on two workers start on that destination together: one owns it and finishes the checkpoint,
    the other waits its turn or is refused naming the holder; the result verifies."""
    env, api = deployed, deployed["PREFECT_API_URL"]
    source, target = synth_dir(), tmp_path / "lost"
    with _workers(env, tmp_path, {"worker-d": ("cpu-pool", {})}) as procs:
        _start_run(api, target, source, "lost-worker", env=hold_at("progress"))  # held mid-write, as above
        child = _wait_for("the conversion to start", lambda: _conversions(target))[0]
        wait_held(child)
        doomed = {child, _parent(child), procs["worker-d"].pid}
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        _wait_for("the lost processes to be gone", lambda: not _conversions(target), timeout=30)
    assert run_cli("inspect", str(target)).returncode != 0
    with _workers(env, tmp_path, {"worker-e": ("cpu-pool", {}), "worker-f": ("cpu-pool", {})}, "--limit", "1"):
        runs = [_start_run(api, target, source, f"after-loss-{n}") for n in range(2)]
        ended = ("COMPLETED", "FAILED", "CRASHED")
        _wait_for("both runs to end", lambda: all(_state(api, r).get("type") in ended for r in runs), timeout=400)
    states = [_state(api, r) for r in runs]
    assert "COMPLETED" in [s["type"] for s in states], states
    for state in states:  # the other one: done after the first (skipped) or refused naming the holder
        assert state["type"] == "COMPLETED" or "another conversion" in (state.get("message") or ""), state
    assert run_cli("verify", str(source), str(target)).returncode == 0
