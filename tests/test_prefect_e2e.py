"""End to end as a user deploys it: a real Prefect server, process work pools, deploy/prefect.yaml,
a worker that picks up ``convert-model-cpu``, and the artifacts read back over the server's API."""

from __future__ import annotations

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

from tests.conftest import run_cli

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


@pytest.fixture
def prefect_api(tmp_path):
    """A real ``prefect server start`` on a free port (its own PREFECT_HOME); stopped by PID."""
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prefect server did not answer /api/health"
            time.sleep(0.5)
        yield env
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.slow
def test_deployed_convert_model_runs_on_a_process_worker(prefect_api, synth_dir, tmp_path):
    env = {**prefect_api, "CKPTCONV_MEMORY_LIMIT": f"ckptconv-memory-gb-e2e-{uuid.uuid4().hex[:6]}",
           "CKPTCONV_MEMORY_GB": "8"}
    api = env["PREFECT_API_URL"]
    pools = [subprocess.Popen([sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", "process"],
                              env=env, cwd=ROOT, stdout=subprocess.DEVNULL) for pool in ("cpu-pool", "tpu-pool")]
    assert [p.wait(timeout=120) for p in pools] == [0, 0]
    # the shipped prefect.yaml, with the workers' code directory pointed at this checkout
    config = (ROOT / "deploy" / "prefect.yaml").read_text()
    assert "directory: /opt/ckptconv" in config
    (tmp_path / "prefect.yaml").write_text(config.replace("directory: /opt/ckptconv", f"directory: {ROOT}"))
    _prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(tmp_path / "prefect.yaml"), env=env)
    deployments = {name: httpx.get(f"{api}/deployments/name/{name}", timeout=10).json() for name in (
        "convert-model/convert-model-cpu", "convert-model/convert-model-tpu", "convert-zoo/nightly-zoo")}
    assert [d["work_pool_name"] for d in deployments.values()] == ["cpu-pool", "tpu-pool", "cpu-pool"]
    assert deployments["convert-model/convert-model-cpu"]["job_variables"]["env"]["MALLOC_ARENA_MAX"] == "2"
    schedule = deployments["convert-zoo/nightly-zoo"]["schedules"][0]["schedule"]
    assert (schedule["cron"], schedule["timezone"]) == ("0 2 * * *", "Europe/Zurich")

    source, destination = synth_dir(), tmp_path / "e2e-out"
    started = _prefect("deployment", "run", "convert-model/convert-model-cpu", "--param", f"source={source}",
                       "--param", f"destination={destination}", "--param", "devices=4", "--param", "name=e2e-tiny", env=env)
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started).group(1)
    _prefect("worker", "start", "--pool", "cpu-pool", "--run-once", env=env, timeout=300)

    flow_run = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()
    assert flow_run["state"]["type"] == "COMPLETED", flow_run["state"]
    verified = run_cli("verify", str(source), str(destination), "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"]

    keys = [f"conversion-e2e-tiny{suffix}" for suffix in ("", "-summary", "-output", "-progress")]
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": keys}}}, timeout=10).json()
    artifacts = {a["key"]: a for a in found if a["flow_run_id"] == flow_run_id}
    assert set(artifacts) == set(keys)
    rows = artifacts["conversion-e2e-tiny"]["data"]
    rows = json.loads(rows) if isinstance(rows, str) else rows
    assert [r["stage"] for r in rows] == ["plan", "read", "transform", "write", "commit", "total (wall)"]
    assert all(isinstance(r["seconds"], (int, float)) for r in rows)
    assert isinstance(rows[-1]["peak_rss_bytes"], int) and rows[-1]["peak_rss_bytes"] > 50 * 2**20
    assert "| verify | OK" in artifacts["conversion-e2e-tiny-summary"]["data"]
    assert artifacts["conversion-e2e-tiny-progress"]["data"] == 100
    shutil.rmtree(destination)
